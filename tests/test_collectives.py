"""Each runtime records the collectives it issues on the rank's step, and the step time is their sum."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from analysis.steptime import BUS_FACTORS, Cluster, step_time
from strategies.layout import Layout, Rank, prepare
from tracer.gpus import find_gpu
from tracer.graph import ALL_GATHER, ALL_REDUCE, DATA_PARALLEL, REDUCE_SCATTER, TENSOR_PARALLEL, build_graph
from tracer.roles import Phase, Role
from tracer.tracing import trace_step
from tracer.training import TrainingSetup

SETUP = TrainingSetup(batch_size=2, seq_len=32, mixed_precision="bf16")

# (kind, group, phase, every micro-step, overlapped) of what each runtime issues, as its docstring cites it.
EXPECTED = {
    "DDP": [(ALL_REDUCE, DATA_PARALLEL, Phase.BACKWARD, False, True)],
    "ZeRO-1": [
        (ALL_REDUCE, DATA_PARALLEL, Phase.BACKWARD, False, True),
        (ALL_GATHER, DATA_PARALLEL, Phase.OPTIMIZER, False, False),
    ],
    "FSDP2": [
        (ALL_GATHER, DATA_PARALLEL, Phase.FORWARD, True, True),
        (ALL_GATHER, DATA_PARALLEL, Phase.BACKWARD, True, True),
        (REDUCE_SCATTER, DATA_PARALLEL, Phase.BACKWARD, True, True),
    ],
    "DeepSpeed ZeRO-2": [
        (REDUCE_SCATTER, DATA_PARALLEL, Phase.BACKWARD, True, False),
        (ALL_GATHER, DATA_PARALLEL, Phase.OPTIMIZER, False, False),
    ],
    "TP": [(ALL_REDUCE, TENSOR_PARALLEL, Phase.FORWARD, True, False)],
}
LAYOUTS = {
    "DDP": Layout(gpus=4),
    "ZeRO-1": Layout(gpus=4, zero=1),
    "FSDP2": Layout(gpus=4, zero=3),
    "DeepSpeed ZeRO-2": Layout(gpus=4, zero=2, engine="deepspeed"),
    "TP": Layout(gpus=2, tp=2),
}


def _rank_step(layout: Layout):
    prepared = prepare(layout, SETUP, tiny_model("llama").config)
    single = build_graph(trace_step(tiny_model("llama"), prepared.traced))
    return single, prepared.rank_step(single, Rank())


@pytest.mark.parametrize("runtime", list(LAYOUTS))
def test_each_runtime_records_what_it_issues(runtime):
    single, step = _rank_step(LAYOUTS[runtime])
    recorded = [(c.kind, c.group, c.phase, c.every_micro_step, c.overlapped) for c in step.collectives]
    assert recorded == EXPECTED[runtime]
    gradients = sum(row.nbytes for row in single.storages.values() if row.role is Role.GRADIENT)
    parameters = sum(row.nbytes for row in single.storages.values() if row.role is Role.PARAMETER)
    for collective in step.collectives:
        if collective.group == DATA_PARALLEL:
            expected = gradients if collective.kind != ALL_GATHER else parameters
            if runtime == "FSDP2" and collective.kind == REDUCE_SCATTER:  # reduce_dtype=float32
                expected = sum(4 * row.numel for row in single.storages.values() if row.role is Role.GRADIENT)
            assert collective.nbytes == expected, collective


@pytest.mark.parametrize("runtime", list(LAYOUTS))
def test_step_time_communication_is_the_sum_of_the_records(runtime):
    layout = LAYOUTS[runtime]
    cluster = Cluster(find_gpu("h100"))
    _, step = _rank_step(layout)
    time = step_time(step, layout, cluster, "bfloat16", micro_steps=3)
    expected = 0.0
    for c in step.collectives:
        size, stride = (layout.tp, 1) if c.group == TENSOR_PARALLEL else (layout.dp, layout.tp)
        seconds = BUS_FACTORS[c.kind](size) * c.nbytes / cluster.group_bytes_per_second(size, stride)
        expected += seconds * (3 if c.every_micro_step else 1)
    assert time.communication_s == pytest.approx(expected, rel=1e-12) and expected > 0
