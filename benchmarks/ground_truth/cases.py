"""The ground-truth matrix: which real steps to measure on a GPU, each as a JSON-able case.

A case names a model (a bundled Hugging Face id), the setup flags of ``python -m tracer analyze`` and, for
one rank of a parallel layout, the layout. Sizes stay within one 80 GB GPU. A case with an ``allocator_capacity``
runs under ``torch.cuda.set_per_process_memory_fraction``: a ``cudaMalloc`` past it fails as on a full GPU, and the
allocator releases its cached segments and retries (or runs out of memory), as ``analyze`` models a full GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tracer.units import GIB

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
MAX_SEQ = {"openai-community/gpt2": 1024}  # learned position embeddings: a longer sequence indexes past them
# generate() as users call it: greedy, bf16 weights, a 512-token prompt, 64 new tokens, each of its caches.
INFERENCE_MODELS = ("openai-community/gpt2", "Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.2-1B", "google/gemma-2-2b")
INFERENCE_SETUPS: dict[str, dict[str, Any]] = {
    f"generate-{cache}": {"mode": "inference", "dtype": "bf16", "max_new_tokens": 64, "cache": cache}
    for cache in ("dynamic", "static")
}
INFERENCE_SHAPE = (4, 512)
# Layouts are measured on models with a tensor-parallel plan (GPT-2 has none).
LAYOUT_MODELS = ("EleutherAI/pythia-410m", "meta-llama/Llama-3.2-1B")
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp-4": {"gpus": 4},
    "zero1-4": {"gpus": 4, "zero": 1},
    "fsdp-zero2-4": {"gpus": 4, "zero": 2},
    "fsdp-zero3-4": {"gpus": 4, "zero": 3},
    "tp-2": {"gpus": 2, "tp": 2},
}
# Tensor parallelism without sequence parallelism leaves the norms' weights plain tensors beside DTensors, which
# torch's foreach AdamW (its default on CUDA) refuses in one list: such runs step with foreach=False.
LAYOUT_SETUPS = {"tp-2": {"optimizer_impl": "for-loop"}}
# Pipelines, measured on their first rank: a model whose output layer is not tied to its embedding (--pp refuses
# tied ones), the first of 4 stages holding the embedding and a quarter of the layers.
PIPELINE_MODEL = "Qwen/Qwen3-8B"
PIPELINES: dict[str, dict[str, Any]] = {
    "pp-4-1f1b": {"gpus": 4, "pp": 4, "microbatches": 4},
    "pp-4-interleaved": {"gpus": 4, "pp": 4, "pp_schedule": "interleaved-1f1b", "microbatches": 4},
    "pp-4-fsdp-zero2-8": {"gpus": 8, "pp": 4, "zero": 2, "microbatches": 4},
}
# Mixture-of-experts models, their experts run as transformers runs them on the GPU (grouped_mm where it runs): the
# attention projections as LoRA's targets (peft finds none of its own in OLMoE's), a full bf16 step where it fits.
ATTENTION_LORA = {"dtype": "bf16", "lora_r": 8, "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
MOE: tuple[tuple[str, int, int, str, dict[str, Any]], ...] = (  # model, batch, seq, setup's name, setup
    ("allenai/OLMoE-1B-7B-0924", 1, 2048, "bf16-adamw", SETUPS["bf16-adamw"]),
    ("allenai/OLMoE-1B-7B-0924", 2, 2048, "bf16-lora-attn", ATTENTION_LORA),
    ("allenai/OLMoE-1B-7B-0924", 4, 512, "generate-dynamic", INFERENCE_SETUPS["generate-dynamic"]),
    ("deepseek-ai/DeepSeek-V2-Lite", 1, 2048, "bf16-lora-attn", ATTENTION_LORA),
    ("Qwen/Qwen3-30B-A3B", 1, 2048, "bf16-lora-attn", ATTENTION_LORA),
    ("mistralai/Mixtral-8x7B-v0.1", 1, 2048, "bf16-lora-attn", ATTENTION_LORA),
    ("deepseek-ai/DeepSeek-V2-Lite", 4, 512, "generate-dynamic", INFERENCE_SETUPS["generate-dynamic"]),
    ("Qwen/Qwen3-30B-A3B", 4, 512, "generate-dynamic", INFERENCE_SETUPS["generate-dynamic"]),
    # generate() decodes with batched_mm on a GPU, a copy of each routed token's experts: the peak at those copies
    ("allenai/OLMoE-1B-7B-0924", 32, 128, "generate-dynamic", INFERENCE_SETUPS["generate-dynamic"]),
    ("Qwen/Qwen3-30B-A3B", 16, 256, "generate-static", INFERENCE_SETUPS["generate-static"]),
    ("mistralai/Mixtral-8x7B-v0.1", 8, 256, "generate-dynamic", INFERENCE_SETUPS["generate-dynamic"]),
)
# A full GPU, made small: capacities between the step's allocated and reserved peaks (measured on the H200), where
# the allocator must release its cache to go on, and below what the cache's fragmentation lets fit.
CAPACITIES: tuple[tuple[str, int, int, str, float], ...] = (  # model, batch, seq, setup, GiB
    ("Qwen/Qwen2.5-0.5B", 4, 512, "amp-bf16-ckpt", 11),
    ("Qwen/Qwen2.5-0.5B", 4, 512, "amp-bf16-ckpt", 9),
    ("EleutherAI/pythia-410m", 2, 2048, "amp-bf16-ckpt", 8.5),
    ("facebook/opt-350m", 2, 2048, "amp-bf16-ckpt", 7.5),
    ("meta-llama/Llama-3.2-1B", 4, 512, "amp-bf16", 24.5),
    ("meta-llama/Llama-3.2-1B", 4, 512, "amp-bf16", 23.5),
    ("Qwen/Qwen2.5-0.5B", 2, 2048, "amp-bf16", 21),
)


@dataclass(frozen=True)
class Case:
    model: str
    batch_size: int
    seq_len: int
    setup: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    allocator_capacity: int = 0  # bytes the allocator may reserve (0: the whole GPU)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def result_key(path: Path) -> str:
    """A result's or its trace's device and case, ``nvidia-h200/gpt2__b1-s512__amp-bf16``: the same case measured on
    two GPUs is two results."""
    return f"{path.parent.name}/{path.name.removesuffix('.trace.json.gz').removesuffix('.json')}"


def _name(model: str, batch: int, seq: int, setup: str, layout: str = "") -> str:
    slug = model.split("/")[-1].lower()
    return "__".join(part for part in (slug, f"b{batch}-s{seq}", setup, layout) if part)


def matrix(size: str) -> list[Case]:
    """``quick``: a few minutes on one GPU; ``full``: every model, shape and setup, the layouts and generate(),
    the quick cases first (a run stopped early has them), then the MoE cases, the rest and the capacity cases;
    ``capacity``: those alone."""
    if size == "capacity":
        return capacity_cases()
    quick = _matrix("quick")
    if size == "quick":
        return quick
    return quick + moe_cases() + [case for case in _matrix("full") if case not in quick] + capacity_cases()


def moe_cases() -> list[Case]:
    return [
        Case(model, batch, seq, setup, name=_name(model, batch, seq, label)) for model, batch, seq, label, setup in MOE
    ]


def capacity_cases() -> list[Case]:
    cases = []
    for model, batch, seq, setup, gib in CAPACITIES:
        name = _name(model, batch, seq, setup, f"capacity-{gib:g}g")
        cases.append(Case(model, batch, seq, SETUPS[setup], name=name, allocator_capacity=int(gib * GIB)))
    return cases


def _matrix(size: str) -> list[Case]:
    cases = []
    models = SMALL[:2] if size == "quick" else SMALL + MEDIUM
    setups = ("fp32-adamw", "amp-bf16", "bf16-lora") if size == "quick" else tuple(SETUPS)
    shapes = SHAPES[:2] if size == "quick" else SHAPES
    for model in models:
        for batch, seq in shapes:
            if seq > MAX_SEQ.get(model, seq):
                continue
            for setup in setups:
                cases.append(Case(model, batch, seq, SETUPS[setup], name=_name(model, batch, seq, setup)))
    layout_models = LAYOUT_MODELS[:1] if size == "quick" else LAYOUT_MODELS
    for model in layout_models:
        for layout_name, layout in LAYOUTS.items():
            if size == "quick" and layout_name not in ("fsdp-zero3-4", "tp-2"):
                continue
            name = _name(model, 2, 512, "amp-bf16", layout_name)
            setup = SETUPS["amp-bf16"] | LAYOUT_SETUPS.get(layout_name, {})
            cases.append(Case(model, 2, 512, setup, layout, name=name))
    for layout_name, layout in PIPELINES.items():
        if size == "quick" and layout_name != "pp-4-1f1b":
            continue
        name = _name(PIPELINE_MODEL, 1, 2048, "bf16-adamw", layout_name)
        cases.append(Case(PIPELINE_MODEL, 1, 2048, SETUPS["bf16-adamw"], layout, name=name))
    inference_models = INFERENCE_MODELS[:2] if size == "quick" else INFERENCE_MODELS
    batch, seq = INFERENCE_SHAPE
    for model in inference_models:
        for setup_name, setup in INFERENCE_SETUPS.items():
            cases.append(Case(model, batch, seq, setup, name=_name(model, batch, seq, setup_name)))
    if size == "full":
        for model in LARGE:
            for setup in ("bf16-lora", "amp-bf16-ckpt"):
                cases.append(Case(model, 1, 2048, SETUPS[setup], name=_name(model, 1, 2048, setup)))
    return cases
