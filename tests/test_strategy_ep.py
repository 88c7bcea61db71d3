"""Expert parallelism in training (``--ep``): the busiest rank's step, traced with its experts and torchtitan's
all-to-all token dispatcher on an assumed routing, alone, under DDP and under torchtitan's FSDP2, against that
dispatcher run for real with PyTorch's own ``all_to_all_single`` on a fake process group and the router forced to
the same routing (tests/ep_runtime.py). Four layers and a vocabulary of 32 put the peak in the MoE layers."""

from __future__ import annotations

import json

import pytest
import torch
from ep_runtime import (
    PER_PARAMETER_MESH,
    PER_PARAMETER_MESH_MISSING,
    expert_parallel_fsdp_step,
    expert_parallel_peak,
    forced_routing,
)
from tiny_models import deep_tiny_model

from analysis.cli import EXIT_USER_ERROR, main
from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from tracer.errors import UserError
from tracer.expert_parallel import ALL_TO_ALL_SINGLE, Routing
from tracer.graph import ALL_TO_ALL, EXPERT_PARALLEL, StepGraph, build_graph
from tracer.modules import count_parameters
from tracer.roles import Phase
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

TOLERANCE = 0.01
SHAPE = {"target": Target.CPU, "batch_size": 2, "seq_len": 32}
SETUP = TrainingSetup(**SHAPE)
# torchtitan's FSDP2 with expert parallelism, the reference of --ep with --zero 2/3, runs on torch 2.13 only
NEEDS_PER_PARAMETER_MESH = pytest.mark.skipif(not PER_PARAMETER_MESH, reason=PER_PARAMETER_MESH_MISSING)


def _estimate(model, setup: TrainingSetup, degree: int, imbalance: float, ddp: bool) -> int:
    prepared = prepare(Layout(gpus=degree, ep=degree, routing_imbalance=imbalance), setup, model.config)
    step = build_graph(trace_step(model, prepared.traced))
    return find_peak(timeline(prepared.rank_step(step, Rank()) if ddp else step, rounded=False)).bytes


def _check(family: str, imbalance: float = 1.0, ddp: bool = True, degree: int = 2, setup: TrainingSetup = SETUP):
    model = deep_tiny_model(family, 4, vocab_size=32)
    runtime = expert_parallel_peak(model, setup, degree, imbalance, ddp)
    estimate = _estimate(model, setup, degree, imbalance, ddp)
    assert abs(estimate - runtime) / runtime <= TOLERANCE, (estimate, runtime)


@pytest.mark.parametrize(
    ("family", "imbalance", "ddp"),
    [
        ("qwen3_moe", 1.0, True),
        ("gpt_oss", 1.5, False),  # transposed experts with biases
        *(
            pytest.param(family, imbalance, ddp, marks=pytest.mark.slow)
            for family in ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next")
            for imbalance, ddp in ((1.0, False), (2.0, True))
        ),
    ],
)
def test_expert_parallel_matches_the_runtime(family, imbalance, ddp):
    _check(family, imbalance, ddp)


@pytest.mark.slow
@pytest.mark.parametrize("imbalance", [1.0, 2.0])
def test_expert_parallel_over_four_ranks(imbalance):
    """One expert per rank: a token sends at most one of its pairs to a rank, so the busiest receives at most 2x."""
    _check("qwen3_moe", imbalance, degree=4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [
        TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, dtype="bf16"),
        TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, mixed_precision="bf16"),
        TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, grad_checkpointing="full"),
    ],
    ids=["bf16", "autocast", "checkpointing"],
)
def test_expert_parallel_with_precision_and_checkpointing(setup):
    """The exchange runs again in the recomputed forward; bf16 rows are scored in float32 in the combine."""
    _check("qwen3_moe", 1.5, setup=setup)


@pytest.mark.slow
def test_expert_parallel_stamped_from_a_cut_model():
    """Eight layers are traced on four and stamped out; the parameters are the model's, not the rank's."""
    model = deep_tiny_model("deepseek_v3", 8, vocab_size=32)
    runtime = expert_parallel_peak(model, SETUP, 2, 1.5)
    prepared = prepare(Layout(gpus=2, ep=2, routing_imbalance=1.5), SETUP, model.config)
    trace = trace_step(model, prepared.traced)
    assert trace.assumptions["decoder_layers"].startswith("4 of 8 traced")
    with torch.device("meta"):
        assert trace.parameter_count == count_parameters(model.build(SETUP))[0]
    estimate = find_peak(timeline(prepared.rank_step(build_graph(trace), Rank()), rounded=False)).bytes
    assert abs(estimate - runtime) / runtime <= TOLERANCE, (estimate, runtime)


def _fsdp_check(
    family: str, gpus: int, degree: int, zero: int, setup: TrainingSetup = SETUP, imbalance: float = 1.0, rank: int = 0
) -> tuple[StepGraph, StepGraph]:
    """The rank's step under torchtitan's FSDP2 (``--zero 2/3``), estimated and run, their peaks compared."""
    model = deep_tiny_model(family, 4, vocab_size=32)
    runtime = expert_parallel_fsdp_step(model, setup, gpus, degree, imbalance, zero == 3, rank)
    layout = Layout(gpus=gpus, ep=degree, zero=zero, routing_imbalance=imbalance)
    prepared = prepare(layout, setup, model.config)
    estimate = prepared.rank_step(build_graph(trace_step(model, prepared.traced)), Rank(dp=rank))
    measured, estimated = (find_peak(timeline(s, rounded=False)).bytes for s in (runtime, estimate))
    assert abs(estimated - measured) / measured <= TOLERANCE, (estimated, measured)
    return estimate, runtime


@NEEDS_PER_PARAMETER_MESH
@pytest.mark.parametrize(
    ("family", "gpus", "degree", "zero", "setup"),
    [
        # the experts' group of one GPU: no all-gather, each shard cast and copied; reduced through a temporary
        ("qwen3_moe", 2, 2, 3, TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, mixed_precision="bf16")),
        # 8 GPUs outnumber the 4 experts: Shard(1), with gpt-oss's biases; nothing resharded after forward
        ("gpt_oss", 8, 2, 2, SETUP),
        *(
            pytest.param(family, gpus, degree, zero, SETUP, marks=pytest.mark.slow)
            for family in ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next")
            for gpus, degree, zero in ((2, 2, 3), (4, 2, 2), (8, 2, 3))
        ),
        *(
            pytest.param("qwen3_moe", gpus, degree, zero, TrainingSetup(**SHAPE, **options), marks=pytest.mark.slow)
            for gpus, degree, zero, options in (
                (4, 2, 3, {"mixed_precision": "bf16"}),
                (8, 4, 2, {"mixed_precision": "bf16"}),
                (2, 2, 2, {"dtype": "bf16"}),
                (4, 4, 3, {"dtype": "bf16"}),
                (4, 2, 2, {"grad_checkpointing": "full"}),
                (8, 2, 3, {"grad_checkpointing": "full", "mixed_precision": "bf16"}),
            )
        ),
    ],
)
def test_expert_parallel_fsdp_matches_the_runtime(family, gpus, degree, zero, setup):
    _fsdp_check(family, gpus, degree, zero, setup)


@NEEDS_PER_PARAMETER_MESH
@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "gpus", "degree", "zero", "imbalance", "rank"),
    [
        ("qwen3_moe", 4, 2, 3, 2.0, 0),
        ("qwen3_moe", 8, 4, 2, 2.0, 0),
        ("qwen3_moe", 4, 2, 3, 1.5, 3),  # the second of its expert-parallel group, the last of the others
        ("gpt_oss", 8, 2, 3, 1.0, 7),  # its attention sinks' 4 rows leave the last ranks empty shards
    ],
)
def test_expert_parallel_fsdp_imbalanced_and_last_rank(family, gpus, degree, zero, imbalance, rank):
    _fsdp_check(family, gpus, degree, zero, imbalance=imbalance, rank=rank)


@NEEDS_PER_PARAMETER_MESH
def test_expert_parallel_records_the_runtimes_exchanges():
    """The all-to-all collectives recorded on the rank's step send, per phase, what the runtime's
    ``all_to_all_single`` calls were given (checkpointing runs the forward's again in backward)."""
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, grad_checkpointing="full")
    estimate, runtime = _fsdp_check("qwen3_moe", 4, 2, 3, setup, imbalance=1.5)
    exchanges = [c for c in estimate.collectives if c.kind == ALL_TO_ALL]
    assert {c.group for c in exchanges} == {EXPERT_PARALLEL} and len(exchanges) == 8
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        sent = [
            runtime.storages[op.inputs[0]].nbytes
            for op in runtime.ops
            if op.target == ALL_TO_ALL_SINGLE and op.phase is phase
        ]
        assert sum(c.nbytes for c in exchanges if c.phase is phase) == sum(sent) > 0


def test_routing_splits_add_up():
    """The busiest rank sends its tokens x top-k pairs and receives imbalance times as many; a forced routing of
    the reference gives that rank the same share."""
    routing = Routing(degree=4, experts=8, top_k=2, imbalance=1.5)
    send, receive = routing.splits(tokens=64)
    assert sum(send) == 128 and sum(receive) == 192 and send[0] == receive[0]
    ids = forced_routing(64, 2, 8, 4, 1.5)
    assert int((ids < 2).sum()) * 4 == sum(receive)
    assert all(len(set(row.tolist())) == 2 for row in ids)


@pytest.mark.parametrize(
    ("layout", "setup", "message"),
    [
        (Layout(gpus=4, ep=4, zero=1), SETUP, "with DDP \\(--zero 0\\) or torchtitan's FSDP2"),
        (Layout(gpus=4, ep=2), SETUP, "with DDP must equal --gpus 4"),
        (Layout(gpus=6, ep=4, zero=3), SETUP, "--ep 4 must divide --gpus 6"),
        (Layout(gpus=4, ep=2, zero=3), TrainingSetup(grad_accum=2), "--grad-accum"),
        (Layout(gpus=4, tp=2, ep=2), SETUP, "--tp or --pp in training"),
        (Layout(gpus=2, ep=2, routing_imbalance=3), SETUP, "from 1 \\(balanced\\) to 2"),
        (Layout(gpus=8, ep=8), SETUP, "--ep 8 must divide the 4 experts"),
        (Layout(gpus=2, ep=2), TrainingSetup(lora=LoraSetup()), "--lora-r"),
        (Layout(gpus=2, ep=2), TrainingSetup(grad_accum=2), "--grad-accum"),
    ],
)
def test_expert_parallel_training_refusals(layout, setup, message):
    with pytest.raises(UserError, match=message):
        prepare(layout, setup, deep_tiny_model("qwen3_moe", 4).config)


def test_expert_parallel_fsdp_refuses_tied_embeddings():
    """torchtitan groups tied embeddings with the final norm in one unit, which is not modelled."""
    config = deep_tiny_model("qwen3_moe", 4, tie_word_embeddings=True).config
    with pytest.raises(UserError, match="tied input and output embeddings"):
        prepare(Layout(gpus=4, ep=2, zero=3), SETUP, config)


def test_routing_imbalance_needs_expert_parallelism():
    with pytest.raises(UserError, match="add --ep 2"):
        Layout(gpus=2, routing_imbalance=2)
    inference = TrainingSetup(mode="inference", dtype="bf16")
    with pytest.raises(UserError, match="applies to --ep in training"):
        prepare(Layout(gpus=2, tp=2, ep=2, routing_imbalance=2), inference, deep_tiny_model("qwen3_moe", 4).config)


def test_command_line_reports_the_routing(tmp_path, capsys):
    """``--routing-imbalance`` reaches the trace and the report's assumptions; out of range, one error line."""
    config = tmp_path / "config.json"
    config.write_text(deep_tiny_model("qwen3_moe", 4, vocab_size=32).config.to_json_string())
    flags = ["analyze", str(config), "--target", "cpu", "--seq-len", "32", "--gpus", "2", "--ep", "2"]
    assert main([*flags, "--routing-imbalance", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"]["routing_imbalance"] == 2
    assert "receives 2 times its share" in report["setup"]["expert_routing"]
    assert main([*flags, "--routing-imbalance", "3"]) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --routing-imbalance must be from 1")
    many = [*flags[:-4], "--gpus", "256", "--ep", "2", "--zero", "2", "--quiet"]  # 128 GPUs share 2 experts
    assert main(many) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --ep 2 over --gpus 256: the 128 GPUs")
