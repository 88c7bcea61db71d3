"""The CUDA emulation (``analyze --target cuda`` on this CPU-only machine) against traces recorded with
FakeTensorMode on a real CUDA device (benchmarks/ground_truth/record_fixtures.py): op by op and in peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.peak import find_peak, timeline
from tests.tiny_models import TINY_CONFIGS, tiny_model
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import TrainingSetup

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "cuda").glob("*.json"))
TOLERANCE = 0.001


def _created_bytes(trace, op) -> int:
    return sum(
        trace.storages[s].nbytes
        for s in op.outputs
        if trace.storages[s].created_at == op.index and trace.storages[s].on_device
    )


NO_FIXTURES = "no CUDA fixtures recorded yet: run benchmarks.ground_truth.record_fixtures on a GPU"


@pytest.mark.skipif(not FIXTURES, reason=NO_FIXTURES)
@pytest.mark.parametrize("path", FIXTURES, ids=lambda path: path.stem)
def test_emulation_matches_a_trace_recorded_on_cuda(path):
    fixture = json.loads(path.read_text())
    if fixture["config"] != TINY_CONFIGS[fixture["family"]]:
        pytest.skip(f"{path.name} was recorded for another tiny config: record the fixtures again")
    setup = TrainingSetup(batch_size=fixture["batch_size"], seq_len=fixture["seq_len"], **fixture["setup"])
    trace = trace_step(tiny_model(fixture["family"]), setup)
    assert [op.target for op in trace.ops] == [op["target"] for op in fixture["ops"]]
    for op, recorded in zip(trace.ops, fixture["ops"], strict=True):
        expected = sum(nbytes for nbytes, _, _ in recorded["outputs"])
        assert _created_bytes(trace, op) == pytest.approx(expected, rel=TOLERANCE), op.target
    cublas_workspace = sum(s.nbytes for s in trace.storages.values() if s.name == "cuBLAS workspace")
    peak = find_peak(timeline(build_graph(trace))).bytes - cublas_workspace
    assert peak == pytest.approx(fixture["peak_bytes"], rel=TOLERANCE)
