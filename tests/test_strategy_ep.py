"""Expert parallelism in training (``--ep``): the busiest rank's step, traced with its experts and torchtitan's
all-to-all token dispatcher on an assumed routing, alone and under DDP, against that dispatcher run for real with
PyTorch's own ``all_to_all_single`` on a fake process group and the router forced to the same routing
(tests/ep_runtime.py). Four layers and a vocabulary of 32 put the peak in the MoE layers."""

from __future__ import annotations

import json

import pytest
import torch
from ep_runtime import expert_parallel_peak, forced_routing
from tiny_models import deep_tiny_model

from analysis.cli import EXIT_USER_ERROR, main
from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from tracer.errors import UserError
from tracer.expert_parallel import Routing
from tracer.graph import build_graph
from tracer.modules import count_parameters
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

TOLERANCE = 0.01
SETUP = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32)


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
        (Layout(gpus=4, ep=4, zero=3), SETUP, "modelled with DDP over the dense parameters"),
        (Layout(gpus=4, ep=2), SETUP, "must equal --gpus 4"),
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
