"""The step of accumulating micro-steps derived from the step without accumulation is the step traced as the
loop runs it: every op, every storage, every lifetime (tracer/accumulation.py). Features in combination, on every
family, on models deep enough to be stamped (the planner derives from stamped traces)."""

from __future__ import annotations

import dataclasses

import pytest
from test_stamping import LAYERS, VARIANTS, assert_same_trace
from tiny_models import FAMILIES, deep_tiny_model, tiny_model

import analysis.estimate
from analysis.estimate import StepSource
from tracer.accumulation import NotDerivable, accumulating_trace
from tracer.roles import Phase, Role
from tracer.tracing import accumulating_from, trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

SETUP = TrainingSetup(batch_size=2, seq_len=32, mixed_precision="bf16")
FAST_FAMILIES = {"llama", "deepseek_v3"}
LORA_TARGETS = {
    "mixtral": ("q_proj", "v_proj"),
    "deepseek_v3": ("q_b_proj", "kv_b_proj"),
    "gpt_oss": ("q_proj",),
    "qwen3_next": ("q_proj", "v_proj"),
}


def _derived_and_traced(model, setup: TrainingSetup):
    accumulating = dataclasses.replace(setup, grad_accum=4)
    plain = trace_step(model, dataclasses.replace(setup, grad_accum=1))
    return accumulating_from(plain, accumulating), trace_step(model, accumulating, derive_accumulation=False)


@pytest.mark.parametrize(
    "family", [f if f in FAST_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_every_family_derives_its_accumulating_trace(family):
    assert_same_trace(*_derived_and_traced(tiny_model(family), SETUP))


DERIVED_VARIANTS = VARIANTS | {
    "cpu, fp32": dict(target=Target.CPU),
    "lora on bf16 weights, bf16 autocast": dict(lora=LoraSetup(r=4), dtype="bf16", mixed_precision="bf16"),
}
FAST_VARIANTS = {
    "lora, reentrant checkpointing, bf16 autocast, accumulation",
    "fp16 autocast with a gradient scaler",
    "accelerate loop: outputs kept in fp32, bf16 autocast",
}


@pytest.mark.parametrize(
    "variant",
    [v if v in FAST_VARIANTS else pytest.param(v, marks=pytest.mark.slow) for v in DERIVED_VARIANTS],
)
def test_variants_derive_on_stamped_layers(variant):
    setup = TrainingSetup(batch_size=2, seq_len=32, **DERIVED_VARIANTS[variant])
    derived, traced = _derived_and_traced(deep_tiny_model("llama", LAYERS.get("llama", 6)), setup)
    assert "stamped" in traced.assumptions["decoder_layers"]
    assert_same_trace(derived, traced)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "gemma3_text", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_moe_mla_sliding_window_and_linear_attention_layers_derive_with_lora_and_checkpointing(family):
    variant = VARIANTS["lora, reentrant checkpointing, bf16 autocast, accumulation"]
    setup = TrainingSetup(
        batch_size=2, seq_len=32, **variant | {"lora": LoraSetup(r=4, targets=LORA_TARGETS.get(family))}
    )
    assert_same_trace(*_derived_and_traced(deep_tiny_model(family, LAYERS.get(family, 6)), setup))


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, options",
    [
        ("qwen3_moe", {"expert_parallel": 2}),
        ("llama", {"context_parallel": 2, "mixed_precision": "bf16"}),
        ("llama", {"accelerate_prepared": True, "mixed_precision": "bf16"}),
        ("llama", {"use_cache": True}),
    ],
    ids=["expert parallel rank", "context parallel rank", "accelerate's fp32 outputs", "cache in training"],
)
def test_ranks_and_loops_derive(family, options):
    assert_same_trace(*_derived_and_traced(tiny_model(family), TrainingSetup(batch_size=2, seq_len=32, **options)))


@pytest.mark.slow
def test_a_custom_models_loss_outside_the_model_derives():
    from test_custom_model import ADAPTERS, MODEL

    setup = TrainingSetup(batch_size=2, seq_len=32, lora=ADAPTERS, grad_checkpointing="full", mixed_precision="bf16")
    assert_same_trace(*_derived_and_traced(MODEL, setup))


def test_a_step_of_another_shape_is_refused_by_name_and_traced_as_the_loop_runs(monkeypatch):
    """A gradient AccumulateGrad would clone rather than steal (one held elsewhere) has no derivation."""
    model = tiny_model("llama")
    plain = trace_step(model, SETUP)
    gradient = next(s for s in plain.storages.values() if s.role is Role.GRADIENT)
    steal = max(op.index for op in plain.ops if gradient.id in op.outputs and op.phase is Phase.BACKWARD)
    plain.ops[steal] = dataclasses.replace(plain.ops[steal], target="aten.clone.default")
    with pytest.raises(NotDerivable, match=f"gradient of {gradient.param} is not stolen"):
        accumulating_trace(plain, "")

    def refused(plain, setup):
        raise NotDerivable("refused")

    monkeypatch.setattr("tracer.tracing.accumulating_from", refused)
    accumulating = dataclasses.replace(SETUP, grad_accum=2)
    traced = trace_step(model, accumulating, derive_accumulation=False)
    assert_same_trace(trace_step(model, accumulating), traced)
    source = StepSource(model, accumulating, plain=StepSource(model, SETUP))  # the planner's way
    assert_same_trace(source.trace(SETUP.batch_size), traced)


def test_a_source_derives_from_its_plain_source_and_traces_only_that(monkeypatch):
    model = tiny_model("llama")
    traced = []

    def recorded(model, setup, *args, **kwargs):
        traced.append(setup.grad_accum)
        return trace_step(model, setup, *args, **kwargs)

    monkeypatch.setattr(analysis.estimate, "trace_step", recorded)
    plain = StepSource(model, SETUP)
    accumulating = StepSource(model, dataclasses.replace(SETUP, grad_accum=2), plain=plain)
    assert accumulating.traced_from(3) == (plain, 3)
    derived = accumulating.trace(3)
    assert traced == [1]
    expected = trace_step(model, dataclasses.replace(SETUP, batch_size=3, grad_accum=2), derive_accumulation=False)
    assert_same_trace(derived, expected)
