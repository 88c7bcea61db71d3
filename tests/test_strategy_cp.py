"""Context parallelism (tracer/context_parallel.py): the rank traced on its share of each sequence with ring
attention, against torch's own ring attention run for that rank on CPU (tests/cp_runtime.py), alone and with its
parameters replicated or sharded over the data- and context-parallel GPUs. Four layers and a vocabulary of 32 put
the peak in the layers, where the ring's buffers live."""

from __future__ import annotations

import pytest
from cp_runtime import context_parallel_peak
from tiny_models import tiny_model

from analysis.estimate import analyze
from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from tracer.errors import UserError
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

TOLERANCE = 0.01  # as tests/test_strategy_*.py
MODEL = tiny_model("llama", num_hidden_layers=4, vocab_size=32)
SPLITTABLE = tiny_model("llama", num_hidden_layers=4, vocab_size=32, num_attention_heads=8, num_key_value_heads=8)
SLOW = pytest.mark.slow


def _check(layout: Layout, model=MODEL, **options) -> None:
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=64, **options)
    prepared = prepare(layout, setup, model.config)
    step = prepared.rank_step(build_graph(trace_step(model, prepared.traced)), Rank())
    estimate = find_peak(timeline(step, rounded=False)).bytes
    runtime = context_parallel_peak(model, setup, layout)
    assert abs(estimate - runtime) / runtime <= TOLERANCE, (estimate, runtime)


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        (Layout(gpus=2, cp=2), {}),
        (Layout(gpus=4, cp=4, zero=3), {"mixed_precision": "bf16"}),
        pytest.param(Layout(gpus=4, cp=4), {}, marks=SLOW),
        pytest.param(Layout(gpus=2, cp=2), {"mixed_precision": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=2, cp=2, zero=3), {}, marks=SLOW),
        pytest.param(Layout(gpus=4, cp=2, zero=2), {"mixed_precision": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=4, cp=2), {"grad_checkpointing": "full"}, marks=SLOW),
        pytest.param(
            Layout(gpus=4, cp=2, zero=3),
            {"mixed_precision": "bf16", "grad_checkpointing": "full", "lora": LoraSetup(r=4, targets=("q_proj",))},
            marks=[
                SLOW,
                pytest.mark.xfail(
                    strict=True,
                    reason="+2.2% on this tiny case: with activation checkpointing the traced ring is 7-12 KiB above "
                    "torch's (0.2-1.1% without LoRA); not located yet (docs/limits.md)",
                ),
            ],
        ),
    ],
    ids=lambda value: value.describe() if isinstance(value, Layout) else str(value),
)
def test_first_rank_matches_torch_ring_attention(layout, options):
    _check(layout, **options)


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        (Layout(gpus=4, cp=2, tp=2, zero=3), {}),
        pytest.param(Layout(gpus=4, cp=2, tp=2, zero=2), {"mixed_precision": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=4, cp=2, tp=2, zero=3, tp_output="gathered"), {}, marks=SLOW),
        pytest.param(Layout(gpus=8, cp=2, tp=4, zero=3), {"mixed_precision": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=8, cp=4, tp=2, zero=3), {}, marks=SLOW),
        pytest.param(Layout(gpus=8, cp=2, tp=2, zero=2), {}, marks=SLOW),
        pytest.param(Layout(gpus=4, cp=2, tp=2, zero=3), {"grad_checkpointing": "full"}, marks=SLOW),
    ],
    ids=lambda value: value.describe() if isinstance(value, Layout) else str(value),
)
def test_with_tensor_parallelism_matches_torch(layout, options):
    """torchtitan's cp x tp mesh: DTensor slices each rank's heads and MLP, the ring runs over the rank's heads,
    FSDP2 shards the slices over the data- and context-parallel GPUs."""
    _check(layout, SPLITTABLE, **options)


def test_report_states_the_ring_and_the_local_tokens():
    report = analyze(MODEL, TrainingSetup(batch_size=1, seq_len=64), Layout(gpus=4, cp=4, zero=3))
    assert report.setup.seq_len == 64  # the sequence the user asked for; each rank traced on its 16 tokens
    assert "16 tokens" in report.assumptions["context_parallel"]
    assert "context parallel 4 x FSDP2 over 4" in report.assumptions["layout"]


@pytest.mark.parametrize(
    ("layout", "options", "message"),
    [
        ({"gpus": 4, "cp": 2, "tp": 2}, {}, "add --zero 2 or 3"),
        ({"gpus": 4, "cp": 2, "zero": 3, "engine": "deepspeed"}, {}, "use --engine fsdp"),
        ({"gpus": 2, "cp": 2}, {"seq_len": 30}, "must be a multiple of 4"),
        ({"gpus": 2, "cp": 2}, {"attn": "eager"}, "drop --attn eager"),
        ({"gpus": 2, "cp": 2}, {"mode": "inference"}, "modelled in training"),
        ({"gpus": 3, "cp": 2}, {}, "--cp 2 must divide --gpus 3"),
    ],
)
def test_context_parallel_refusals_name_the_fix(layout, options, message):
    with pytest.raises(UserError, match=message):
        prepare(Layout(**layout), TrainingSetup(**({"seq_len": 64} | options)), MODEL.config)


def test_context_parallelism_with_experts_is_refused_by_name():
    moe = tiny_model("qwen3_moe")
    with pytest.raises(UserError, match="--cp with --ep is not modelled yet"):
        prepare(Layout(gpus=4, cp=2, ep=2, zero=3), TrainingSetup(seq_len=64), moe.config)
