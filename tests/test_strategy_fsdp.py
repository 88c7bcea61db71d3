"""FSDP2 as a transform of the single-GPU trace, against FSDP2 itself run for one rank of N."""

from __future__ import annotations

import dataclasses

import pytest
from runtimes import fsdp2_peak, fully_shard_takes_integer_parameters
from tiny_models import tiny_model

from analysis.peak import find_peak, timeline
from strategies.fsdp import INTEGER_PARAMETERS_TORCH, FsdpPlan, fsdp
from strategies.layout import Layout, prepare
from tracer.errors import UserError
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup
from tracer.versions import installed_torch_version

TOLERANCE = 0.01


def _estimate(family: str, setup: TrainingSetup, plan: FsdpPlan) -> int:
    traced = dataclasses.replace(setup, dtype="bf16") if plan.mixed_precision else setup
    step = fsdp(build_graph(trace_step(tiny_model(family), traced)), plan)
    return find_peak(timeline(step, rounded=False)).bytes  # the tracker counts tensor bytes on CPU


def _check(
    family: str, world: int, rank: int = 0, mixed_precision: bool = False, reshard: bool = True, **shape
) -> None:
    setup = TrainingSetup(target=Target.CPU, **({"batch_size": 2, "seq_len": 32} | shape))
    runtime = fsdp2_peak(tiny_model(family), setup, world, rank, mixed_precision, reshard_after_forward=reshard)
    estimate = _estimate(family, setup, FsdpPlan(world, rank, reshard, mixed_precision))
    assert abs(estimate - runtime) / runtime <= TOLERANCE, (estimate, runtime)


@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon"])
def test_fsdp_matches_the_runtime(family, world):
    _check(family, world)


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon"])
def test_fsdp_mixed_precision_matches_the_runtime(family):
    _check(family, 4, mixed_precision=True)


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon"])
def test_fsdp_without_resharding_after_forward_matches_the_runtime(family):
    """ZeRO-2: parameters stay unsharded from forward to their post-backward; nothing is gathered in backward."""
    _check(family, 4, reshard=False)


def test_fsdp_last_rank_with_uneven_shards():
    _check("gpt2", 8, rank=7, batch_size=3, seq_len=17)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family", ["mistral", "qwen2", "gemma2", "phi3", "opt", "bloom", "codegen", "gpt_neo", "gpt_neox", "gpt_bigcode"]
)
def test_fsdp_other_families(family):
    _check(family, 4)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_gradient_accumulation_frees_each_micro_steps_reduce_scatter_input(reshard):
    """Every micro-step's backward ends in the root's final callback, which drops the held reduce-scatter input
    (``is_last_backward`` is True by default); held into the next micro-step's forward it was the root unit's
    whole unsharded size (1 GiB for Llama-2-7B in fp32), under 1% here. Eight layers and a vocabulary of 32 put
    the peak in backward, so the bytes must be equal."""
    shape = {"num_hidden_layers": 8, "vocab_size": 32, "num_attention_heads": 8, "num_key_value_heads": 8}
    model = tiny_model("llama", **shape)
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, grad_accum=2)
    runtime = fsdp2_peak(model, setup, 4, reshard_after_forward=reshard)
    step = fsdp(build_graph(trace_step(model, setup)), FsdpPlan(4, 0, reshard))
    assert find_peak(timeline(step, rounded=False)).bytes == runtime


def test_llm_int8_weights_are_refused_where_fully_shard_cannot_shard_them(monkeypatch):
    """The version rule agrees with the installed torch's own ``fully_shard`` (tried on an integer parameter), and
    below that version FSDP2 over LLM.int8() weights is refused, not estimated."""
    assert (installed_torch_version() >= INTEGER_PARAMETERS_TORCH) == fully_shard_takes_integer_parameters()
    config = tiny_model("llama").config
    setup = TrainingSetup(target=Target.CPU, dtype="bf16", quantize="int8", lora=LoraSetup(r=4))
    monkeypatch.setattr("strategies.layout.installed_torch_version", lambda: (2, 11))
    for zero in (2, 3):
        with pytest.raises(UserError, match=r"--load-in-8bit under FSDP2 does not run on torch 2\.11"):
            prepare(Layout(gpus=4, zero=zero), setup, config)
    prepare(Layout(gpus=4, zero=1), setup, config)
    monkeypatch.setattr("strategies.layout.installed_torch_version", lambda: INTEGER_PARAMETERS_TORCH)
    prepare(Layout(gpus=4, zero=3), setup, config)
