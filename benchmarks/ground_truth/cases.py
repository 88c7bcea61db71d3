"""The ground-truth matrix: which real steps to measure on a GPU, each as a JSON-able case.

A case names a model (a bundled Hugging Face id), the setup flags of ``python -m tracer analyze`` and, for
one rank of a parallel layout, the layout. Sizes stay within one 80 GB GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SMALL = ("openai-community/gpt2", "EleutherAI/pythia-410m", "Qwen/Qwen2.5-0.5B", "facebook/opt-350m")
MEDIUM = ("meta-llama/Llama-3.2-1B", "google/gemma-2-2b", "EleutherAI/pythia-1.4b")
LARGE = ("meta-llama/Llama-2-7b-hf",)

SETUPS: dict[str, dict[str, Any]] = {
    "fp32-adamw": {},
    "bf16-adamw": {"dtype": "bf16"},
    "amp-bf16": {"mixed_precision": "bf16"},
    "fp32-sgd": {"optimizer": "sgd"},
    "amp-bf16-ckpt": {"mixed_precision": "bf16", "grad_checkpointing": "full"},
    "bf16-eager-attn": {"dtype": "bf16", "attn": "eager"},
    "bf16-lora": {"dtype": "bf16", "lora_r": 8},
}
SHAPES = ((1, 512), (4, 512), (2, 2048))  # (batch, seq) sweeps
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp-4": {"gpus": 4},
    "zero1-4": {"gpus": 4, "zero": 1},
    "fsdp-zero2-4": {"gpus": 4, "zero": 2},
    "fsdp-zero3-4": {"gpus": 4, "zero": 3},
    "tp-2": {"gpus": 2, "tp": 2},
}
# Pipelines, measured on their first rank: a model whose output layer is not tied to its embedding (--pp refuses
# tied ones), the first of 4 stages holding the embedding and a quarter of the layers.
PIPELINE_MODEL = "Qwen/Qwen3-8B"
PIPELINES: dict[str, dict[str, Any]] = {
    "pp-4-1f1b": {"gpus": 4, "pp": 4, "microbatches": 4},
    "pp-4-interleaved": {"gpus": 4, "pp": 4, "pp_schedule": "interleaved-1f1b", "microbatches": 4},
    "pp-4-fsdp-zero2-8": {"gpus": 8, "pp": 4, "zero": 2, "microbatches": 4},
}


@dataclass(frozen=True)
class Case:
    model: str
    batch_size: int
    seq_len: int
    setup: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _name(model: str, batch: int, seq: int, setup: str, layout: str = "") -> str:
    slug = model.split("/")[-1].lower()
    return "__".join(part for part in (slug, f"b{batch}-s{seq}", setup, layout) if part)


def matrix(size: str) -> list[Case]:
    """``quick``: a few minutes on one GPU; ``full``: every model, shape and setup, and the layouts."""
    cases = []
    models = SMALL[:2] if size == "quick" else SMALL + MEDIUM
    setups = ("fp32-adamw", "amp-bf16", "bf16-lora") if size == "quick" else tuple(SETUPS)
    shapes = SHAPES[:2] if size == "quick" else SHAPES
    for model in models:
        for batch, seq in shapes:
            for setup in setups:
                cases.append(Case(model, batch, seq, SETUPS[setup], name=_name(model, batch, seq, setup)))
    if size == "full":
        for model in LARGE:
            for setup in ("bf16-lora", "amp-bf16-ckpt"):
                cases.append(Case(model, 1, 2048, SETUPS[setup], name=_name(model, 1, 2048, setup)))
    layout_models = SMALL[:1] if size == "quick" else SMALL[:1] + MEDIUM[:1]
    for model in layout_models:
        for layout_name, layout in LAYOUTS.items():
            if size == "quick" and layout_name not in ("fsdp-zero3-4", "tp-2"):
                continue
            name = _name(model, 2, 512, "amp-bf16", layout_name)
            cases.append(Case(model, 2, 512, SETUPS["amp-bf16"], layout, name=name))
    for layout_name, layout in PIPELINES.items():
        if size == "quick" and layout_name != "pp-4-1f1b":
            continue
        name = _name(PIPELINE_MODEL, 1, 2048, "bf16-adamw", layout_name)
        cases.append(Case(PIPELINE_MODEL, 1, 2048, SETUPS["bf16-adamw"], layout, name=name))
    return cases
