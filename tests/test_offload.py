"""Offloading: what stays on the GPU against DeepSpeed's own estimators, and the bytes that cross the host link
against the buffers DeepSpeed and FSDP2 copy (their source is cited in strategies/deepspeed.py and fsdp.py)."""

from __future__ import annotations

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from tiny_models import tiny_model

from analysis.peak import host_peak
from strategies.deepspeed import ZeroConfig, partition_numel
from strategies.layout import Layout, Rank, prepare
from tracer.graph import DEVICE_TO_HOST, HOST_TO_DEVICE, StepGraph, build_graph
from tracer.roles import Role
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup

SETUP = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, dtype="bf16")
EVEN = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256}


EVERY_PARAMETER = ZeroConfig(stage3_param_persistence_threshold=0)  # DeepSpeed's estimator partitions all


def _step(layout: Layout, family: str = "llama") -> tuple[StepGraph, int]:
    model = tiny_model(family, **EVEN)
    trace = trace_step(model, SETUP)
    return prepare(layout, SETUP, model.config).rank_step(build_graph(trace), Rank()), trace.parameter_count


def _device_model_states(step: StepGraph) -> int:
    """Parameters, gradients and optimizer states the GPU keeps between steps (not the step counters)."""
    kept = (Role.PARAMETER, Role.GRADIENT, Role.OPTIMIZER_STATE)
    return sum(
        row.nbytes
        for row in step.storages.values()
        if row.on_device and row.role in kept and row.producer is None and not row.name.endswith(".step")
    )


def _moved(step: StepGraph, direction: str) -> int:
    return sum(transfer.nbytes for transfer in step.transfers if transfer.direction == direction)


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_zero2_offload_leaves_the_16_bit_parameters_on_the_gpu(gpus):
    step, params = _step(Layout(gpus=gpus, zero=2, engine="deepspeed", offload="optimizer"))
    _, expected = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=gpus, cpu_offload=True)
    assert _device_model_states(step) == expected  # 2 bytes per parameter
    part = partition_numel(params, gpus) * 2
    assert _moved(step, DEVICE_TO_HOST) == _moved(step, HOST_TO_DEVICE) == part
    assert host_peak(step) >= 16 * partition_numel(params, gpus)  # fp32 master, two states, fp32 gradients


@pytest.mark.parametrize("gpus", [2, 4])
def test_zero3_offload_of_the_optimizer_keeps_the_16_bit_partitions(gpus):
    layout = Layout(gpus=gpus, zero=3, engine="deepspeed", offload="optimizer", zero_config=EVERY_PARAMETER)
    step, params = _step(layout)
    _, expected, largest = estimate_zero3_model_states_mem_needs(
        params, 0, num_gpus_per_node=gpus, cpu_offload=True, cpu_offload_params=False
    )
    assert _device_model_states(step) == expected - largest  # 2 bytes per parameter over N


@pytest.mark.parametrize("gpus", [2, 4])
def test_zero3_offload_of_the_parameters_keeps_nothing_between_steps(gpus):
    layout = Layout(gpus=gpus, zero=3, engine="deepspeed", offload="optimizer,params", zero_config=EVERY_PARAMETER)
    step, params = _step(layout)
    _, expected, largest = estimate_zero3_model_states_mem_needs(
        params, 0, num_gpus_per_node=gpus, cpu_offload=True, cpu_offload_params=True
    )
    assert _device_model_states(step) == expected - largest == 0
    # every partition crosses once per fetch: at least once in forward
    fetched = sum(t.nbytes for t in step.transfers if t.phase.value == "forward")
    assert fetched >= sum(
        -(-row.nbytes // 1) for row in step.storages.values() if row.role is Role.PARAMETER and not row.on_device
    )


def test_fsdp2_cpu_offload_moves_shards_and_gradients():
    step, _ = _step(Layout(gpus=4, zero=3, offload="optimizer,params"), "gpt2")
    shards = sum(row.nbytes for row in step.storages.values() if row.role is Role.PARAMETER and not row.on_device)
    assert _device_model_states(step) == 0
    gathered_twice = _moved(step, HOST_TO_DEVICE)
    assert shards < gathered_twice <= 2 * shards  # every unit in forward, and again in backward (not the root)
    assert _moved(step, DEVICE_TO_HOST) == shards  # fp32 gradients of the fp32 shards


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"gpus": 4, "zero": 2, "offload": "optimizer"}, "CPUOffloadPolicy"),
        ({"gpus": 4, "zero": 2, "engine": "deepspeed", "offload": "optimizer,params"}, "ZeRO-3 only"),
        ({"gpus": 4, "engine": "deepspeed", "offload": "optimizer"}, "add --zero 1, 2 or 3"),
    ],
)
def test_impossible_offloads(layout, message):
    from tracer.errors import UserError

    with pytest.raises(UserError, match=message):
        Layout(**layout)
