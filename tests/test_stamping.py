"""A step traced on a few decoder layers and stamped out is the step traced on every layer: every op, every
storage, every lifetime and name, and so every estimate, byte for byte (tracer/layers.py, tracer/stamping.py).

The models are the registry families' tiny configs made deep enough that the stamped block is copied at
least twice, so copies read from and free into other copies as well as into traced layers."""

from __future__ import annotations

import json
from functools import partial

import pytest
from tiny_models import FAMILIES, deep_tiny_model, tiny_model

import analysis.estimate
from analysis.estimate import analyze
from strategies.layout import Layout
from tracer.layers import plan_layers
from tracer.resolve import resolve_model
from tracer.trace import Trace
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

# Layer counts that leave two copies to stamp: head layer + 3 blocks + 2 more blocks.
ALTERNATING = {"gemma2", "gemma3_text", "gpt_oss", "smollm3", "gpt_neo", "qwen3_next"}  # blocks of two layers
LAYERS = {family: 11 for family in ALTERNATING} | {"llama4_text": 21}  # dense/MoE x NoPE every 4th
FAST_FAMILIES = {"llama", "gemma3_text", "deepseek_v3"}

SETUP = TrainingSetup(batch_size=2, seq_len=32)


def deep(family: str):
    return deep_tiny_model(family, LAYERS.get(family, 6))


def assert_same_trace(stamped: Trace, full: Trace) -> None:
    assert len(stamped.ops) == len(full.ops), "op counts differ"
    for ours, theirs in zip(stamped.ops, full.ops, strict=True):
        assert ours == theirs, f"op {ours.index} differs"
    assert stamped.storages.keys() == full.storages.keys()
    for storage_id, storage in stamped.storages.items():
        assert storage == full.storages[storage_id], f"storage {storage_id} differs"
    assert stamped.optimizer_traffic == full.optimizer_traffic
    assert (stamped.parameter_count, stamped.trainable_parameter_count) == (
        full.parameter_count,
        full.trainable_parameter_count,
    )
    assert stamped.structure == full.structure


def _stamped_and_full(model, setup: TrainingSetup) -> tuple[Trace, Trace]:
    stamped = trace_step(model, setup)
    assert "stamped" in stamped.assumptions["decoder_layers"], stamped.assumptions["decoder_layers"]
    return stamped, trace_step(model, setup, every_layer=True)


@pytest.mark.parametrize(
    "family", [f if f in FAST_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES]
)
def test_every_family_stamps_to_its_full_trace(family):
    assert_same_trace(*_stamped_and_full(deep(family), SETUP))


VARIANTS = {  # features in combination, as users run them
    "lora, reentrant checkpointing, bf16 autocast, accumulation": dict(
        lora=LoraSetup(r=4),
        grad_checkpointing="full",
        reentrant=True,
        dtype="bf16",
        mixed_precision="bf16",
        grad_accum=3,
    ),
    "non-reentrant checkpointing, bf16 autocast": dict(grad_checkpointing="full", mixed_precision="bf16"),
    "qlora nf4, checkpointing": dict(lora=LoraSetup(r=4), quantize="nf4", dtype="bf16", grad_checkpointing="full"),
    "accelerate loop: outputs kept in fp32, bf16 autocast": dict(
        keep_outputs=True, accelerate_prepared=True, mixed_precision="bf16"
    ),
    "cpu, per-parameter optimizer loop, lora, checkpointing": dict(
        target=Target.CPU, lora=LoraSetup(r=4), grad_checkpointing="full"
    ),
    "int8 base weights, lora": dict(lora=LoraSetup(r=4), quantize="int8", dtype="bf16"),
    "torchtitan per-op checkpointing": dict(grad_checkpointing="op", mixed_precision="bf16"),
    "selective checkpointing": dict(grad_checkpointing="selective"),
    "fp16 autocast with a gradient scaler": dict(mixed_precision="fp16"),
    "fused adamw": dict(optimizer_impl="fused"),
    "adafactor": dict(optimizer="adafactor"),
    "8-bit adamw": dict(optimizer="adamw8bit"),
    "sgd, kept outputs": dict(optimizer="sgd", keep_outputs=True),
}
FAST_VARIANTS = {
    "lora, reentrant checkpointing, bf16 autocast, accumulation",
    "non-reentrant checkpointing, bf16 autocast",  # torch 2.11's checkpoint makes empty tensors between layers
}


@pytest.mark.parametrize(
    "variant", [v if v in FAST_VARIANTS else pytest.param(v, marks=pytest.mark.slow) for v in VARIANTS]
)
def test_variants_stamp_to_their_full_trace(variant):
    setup = TrainingSetup(batch_size=2, seq_len=32, **VARIANTS[variant])
    assert_same_trace(*_stamped_and_full(deep("llama"), setup))


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, targets",
    [
        ("mixtral", ("q_proj", "v_proj")),
        ("gemma3_text", None),
        ("deepseek_v3", ("q_b_proj", "kv_b_proj")),
        ("gpt_oss", ("q_proj", "v_proj")),
    ],
)
def test_combined_variant_stamps_on_moe_mla_and_sliding_window_layers(family, targets):
    variant = VARIANTS["lora, reentrant checkpointing, bf16 autocast, accumulation"] | {
        "lora": LoraSetup(r=4, targets=targets)
    }
    assert_same_trace(*_stamped_and_full(deep(family), TrainingSetup(batch_size=2, seq_len=32, **variant)))


LORA_CHECKPOINTED = TrainingSetup(batch_size=2, seq_len=32, lora=LoraSetup(r=4), grad_checkpointing="full")
SELECTIVE_BF16 = TrainingSetup(batch_size=2, seq_len=32, grad_checkpointing="selective", mixed_precision="bf16")


@pytest.mark.parametrize(
    "layout, setup",
    [
        (Layout(), LORA_CHECKPOINTED),
        (Layout(gpus=2, zero=3), LORA_CHECKPOINTED),
        pytest.param(Layout(gpus=2, tp=2, sequence_parallel=True), SELECTIVE_BF16, marks=pytest.mark.slow),
        pytest.param(Layout(gpus=4, tp=2, zero=3), SELECTIVE_BF16, marks=pytest.mark.slow),
        pytest.param(Layout(gpus=2, zero=1, engine="deepspeed"), LORA_CHECKPOINTED, marks=pytest.mark.slow),
        pytest.param(Layout(gpus=2, zero=3, engine="deepspeed"), SELECTIVE_BF16, marks=pytest.mark.slow),
    ],
    ids=["single GPU", "FSDP2 over 2", "TP 2 with SP", "TP 2 x FSDP2 2", "DeepSpeed ZeRO-1", "DeepSpeed ZeRO-3"],
)
def test_estimates_are_byte_identical(monkeypatch, layout, setup):
    model = deep("llama")
    stamped = analyze(model, setup, layout).to_json()
    monkeypatch.setattr(analysis.estimate, "trace_step", partial(trace_step, every_layer=True))
    full = analyze(model, setup, layout).to_json()
    for report in (stamped, full):
        report["setup"].pop("decoder_layers")
    assert json.dumps(stamped, sort_keys=True) == json.dumps(full, sort_keys=True)


def test_layers_that_do_not_repeat_are_all_traced():
    trace = trace_step(tiny_model("llama"), SETUP)  # two layers: nothing to stamp
    assert trace.assumptions["decoder_layers"] == "every layer traced"
    assert len(trace.structure.blocks) == 2


@pytest.mark.parametrize(
    "model_id, traced",
    [
        ("meta-llama/Llama-2-7b-hf", 4),  # uniform: the first layer, then three
        ("deepseek-ai/DeepSeek-V3", 6),  # three dense layers, then MoE
        ("google/gemma-2-9b", 8),  # sliding and full attention alternate
        ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", 16),  # dense/MoE x NoPE every fourth layer
        ("EleutherAI/gpt-neo-1.3B", 8),  # global and local attention alternate
    ],
)
def test_bundled_models_trace_a_few_layers(model_id, traced):
    config = resolve_model(model_id).config
    plan = plan_layers(config)
    assert plan is not None and plan.traced == traced
    assert plan.traced + plan.copies * plan.period == plan.layers == config.num_hidden_layers
