"""DeepSpeed ZeRO as a transform of the single-GPU trace. DeepSpeed cannot run here, so the model states it
keeps are checked against DeepSpeed's own estimators, for the same parameter counts."""

from __future__ import annotations

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from tiny_models import tiny_model

import strategies.deepspeed as zero
from strategies.deepspeed import DeepSpeedPlan, deepspeed
from tracer.graph import StepGraph, build_graph
from tracer.roles import Role
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup

# The estimators assume 16-bit training with fp32 master weights (DeepSpeed's bf16 or fp16 mode).
SETUP = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, dtype="bf16")
# Parameters that split evenly, so that DeepSpeed's alignment padding is zero as the estimators assume.
EVEN = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256}


def _trace(family: str) -> tuple[StepGraph, int]:
    trace = trace_step(tiny_model(family, **EVEN), SETUP)
    return build_graph(trace), trace.parameter_count


def _model_states(step: StepGraph) -> int:
    """Bytes of what ZeRO keeps of the model: parameters as held between steps, the gradient partitions,
    fp32 master weights and optimizer states (not the 0-dim step counters)."""
    kept = (Role.PARAMETER, Role.OPTIMIZER_STATE)
    states = sum(row.nbytes for row in step.storages.values() if row.role in kept and row.producer is None)
    gradients = sum(
        row.nbytes for row in step.storages.values() if row.role is Role.GRADIENT and "partition" in row.name
    )
    counters = sum(row.nbytes for row in step.storages.values() if row.name.endswith(".step"))
    return states + gradients - counters


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_zero2_model_states_match_deepspeeds_estimator(family, world):
    step, params = _trace(family)
    _, expected = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=False)
    assert _model_states(deepspeed(step, DeepSpeedPlan(2, world))) == expected


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_zero3_model_states_match_deepspeeds_estimator(family, world, monkeypatch):
    """The estimator partitions every parameter: persistence is turned off to compare."""
    monkeypatch.setattr(zero, "PARAM_PERSISTENCE_THRESHOLD", 0)
    step, params = _trace(family)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in _modules(family))
    _, expected, largest_layer_memory = estimate_zero3_model_states_mem_needs(
        params, largest, num_gpus_per_node=world, cpu_offload=False, cpu_offload_params=False
    )
    sharded = deepspeed(step, DeepSpeedPlan(3, world))
    assert _model_states(sharded) == expected - largest_layer_memory
    gathered = max(row.nbytes for row in sharded.storages.values() if row.name.endswith("(gathered)"))
    assert 2 * gathered == largest_layer_memory  # 16-bit parameters and gradients of the largest layer


def _modules(family: str):
    import torch

    from tracer.step import build_model

    with torch.device("meta"):
        return list(build_model(tiny_model(family, **EVEN).config, SETUP).modules())
