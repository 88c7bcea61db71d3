"""``--recipe``: each framework's own loop, run on CPU, against the estimate of the setup its recipe gives
from the command line. The configs put the peak where the feature acts: eight layers and a vocabulary of 32
put it in backward (gradients, checkpointing, adapters); a vocabulary of 4,096 puts it at the logits."""

from __future__ import annotations

import dataclasses

import pytest
from runtimes import accelerate_loop_peak, trainer_peak
from tiny_models import tiny_model

from analysis.arguments import setup_of
from analysis.cli import _parse
from analysis.peak import find_peak, timeline
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import Target

TOLERANCE = 0.01
BACKWARD_PEAK = {"num_hidden_layers": 8, "vocab_size": 32, "num_attention_heads": 8, "num_key_value_heads": 8}
LOGITS_PEAK = {"num_hidden_layers": 2, "vocab_size": 4096}
ADAPTERS = ("--lora-r", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj")
TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
SLOW = pytest.mark.slow


def estimate_and_runtime(
    shape: dict, stored: str, recipe: str, flags: tuple[str, ...], run, directory
) -> tuple[int, int]:
    """The estimate of the setup ``--recipe`` gives for a tiny config.json stored in ``stored``, and
    ``run(model, setup)``: the framework's own peak for that model (benchmarks/framework_accuracy.py too)."""
    model = tiny_model("llama", **shape, dtype=TORCH_DTYPES[stored])
    path = directory / "config.json"
    path.write_text(model.config.to_json_string())
    argv = ["analyze", str(path), "--recipe", recipe, "--target", "cpu", "--batch-size", "2", "--seq-len", "32"]
    setup = setup_of(_parse([*argv, "--quiet", *flags]))
    assert setup.target is Target.CPU
    runtime = run(model, dataclasses.replace(setup, dtype=stored, mixed_precision=None, accelerate_prepared=False))
    estimate = find_peak(timeline(build_graph(trace_step(model, setup)), rounded=False)).bytes
    return estimate, runtime


def _compare(tmp_path, shape: dict, stored: str, recipe: str, flags: tuple[str, ...], run) -> None:
    estimate, runtime = estimate_and_runtime(shape, stored, recipe, flags, run, tmp_path)
    assert abs(estimate - runtime) / runtime <= TOLERANCE, (estimate, runtime)


# (model config, the checkpoint's dtype, TrainingArguments, the flags that say the same with --recipe trainer)
TRAINER_RUNS = [
    (BACKWARD_PEAK, "bf16", {"bf16": True}, ()),
    (BACKWARD_PEAK, "fp32", {"bf16": True}, ()),
    pytest.param(
        BACKWARD_PEAK, "bf16", {"bf16": True, "gradient_checkpointing": True}, ("--grad-checkpointing",), marks=SLOW
    ),
    pytest.param(
        BACKWARD_PEAK, "bf16", {"bf16": True, "gradient_accumulation_steps": 2}, ("--grad-accum", "2"), marks=SLOW
    ),
    (LOGITS_PEAK, "bf16", {"bf16": True}, ()),
    pytest.param(LOGITS_PEAK, "fp32", {"bf16": True}, (), marks=SLOW),
    pytest.param(LOGITS_PEAK, "fp32", {}, ("--mixed-precision", "off"), marks=SLOW),
    pytest.param(BACKWARD_PEAK, "bf16", {"bf16": True}, ADAPTERS, marks=SLOW),
    (BACKWARD_PEAK, "bf16", {"bf16": True, "gradient_checkpointing": True}, (*ADAPTERS, "--grad-checkpointing")),
    pytest.param(
        BACKWARD_PEAK,
        "bf16",
        {"bf16": True, "gradient_checkpointing": True, "gradient_accumulation_steps": 2},
        (*ADAPTERS, "--grad-checkpointing", "--grad-accum", "2"),
        marks=SLOW,
    ),
]


@pytest.mark.parametrize(("shape", "stored", "arguments", "flags"), TRAINER_RUNS)
def test_trainer_recipe_matches_the_trainers_own_loop(tmp_path, shape, stored, arguments, flags):
    """``Trainer.train`` with its default optimizer (adamw_torch_fused) and accelerate's wrapping; a bf16
    checkpoint loads in bf16 (transformers 5) and bf16=True adds autocast over it; peft keeps the adapters of a
    bf16 model in fp32."""

    def run(model, setup):
        return trainer_peak(model, setup, **arguments)

    _compare(tmp_path, shape, stored, "trainer", flags, run)


@pytest.mark.parametrize("shape", [BACKWARD_PEAK, LOGITS_PEAK], ids=["backward", "logits"])
@pytest.mark.parametrize(
    ("stored", "flags"),
    [
        pytest.param("fp32", ("--mixed-precision", "off"), marks=SLOW),
        ("bf16", ()),
        pytest.param("fp32", (), marks=SLOW),
        ("bf16", ("--grad-checkpointing",)),
    ],
)
def test_accelerate_loop_recipe_matches_the_loop(tmp_path, shape, stored, flags):
    """The loop keeps its outputs, which accelerate copies to fp32 under mixed precision; under checkpointing they
    hold no key/value cache (transformers turns the cache off in a forward that checkpoints)."""
    precision = "no" if "off" in flags else "bf16"

    def run(model, setup):
        return accelerate_loop_peak(model, setup, precision)

    _compare(tmp_path, shape, stored, "accelerate-loop", flags, run)
