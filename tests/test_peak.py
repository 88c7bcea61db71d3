"""Liveness and peak on hand-built traces with known answers."""

from __future__ import annotations

from analysis.liveness import lifetimes
from analysis.peak import find_peak, timeline
from tracer.graph import build_graph
from tracer.roles import Phase, Role
from tracer.trace import Op, Storage, Trace


def _storage(id, nbytes, role, created_at, freed_after, on_device=True):
    return Storage(id, nbytes, "float32", (nbytes // 4,), role, created_at, freed_after, on_device)


def _trace() -> Trace:
    storages = [
        _storage(0, 1000, Role.PARAMETER, None, None),  # 1024 bytes, all step long
        _storage(1, 600, Role.ACTIVATION, 0, 1),  # 1024 bytes at ops 0-1
        _storage(2, 100, Role.TEMPORARY, 1, 1),  # 512 bytes at op 1 only
        _storage(3, 0, Role.TEMPORARY, 2, 2),  # nothing
        _storage(4, 4096, Role.OPTIMIZER_STATE, 2, None, on_device=False),  # host: nothing on the GPU
        _storage(5, 2048, Role.GRADIENT, 1, 2),  # 2048 bytes at ops 1-2
    ]
    ops = [
        Op(0, "aten.mm.default", "layer", Phase.FORWARD, (0,), (1,)),
        Op(1, "aten.mul.Tensor", "layer", Phase.BACKWARD, (1,), (2, 5)),
        Op(2, "aten.add_.Tensor", "", Phase.OPTIMIZER, (0, 5), (0, 3, 4)),
    ]
    return Trace(ops=ops, storages={s.id: s for s in storages})


def test_lifetimes_round_to_blocks_and_skip_host_and_empty_storages():
    spans = {span.storage_id: span for span in lifetimes(build_graph(_trace()))}
    assert set(spans) == {0, 1, 2, 5}
    assert (spans[0].first, spans[0].last, spans[0].bytes) == (0, 2, 1024)
    assert (spans[1].first, spans[1].last, spans[1].bytes) == (0, 1, 1024)
    assert (spans[2].first, spans[2].last, spans[2].bytes) == (1, 1, 512)


def test_timeline_and_peak():
    line = timeline(build_graph(_trace()))
    assert [line.total(i) for i in range(3)] == [2048, 4608, 3072]
    peak = find_peak(line)
    assert peak.index == 1 and peak.bytes == 4608
    assert peak.breakdown[Role.PARAMETER] == 1024
    assert peak.breakdown[Role.ACTIVATION] == 1024
    assert peak.breakdown[Role.TEMPORARY] == 512
    assert peak.breakdown[Role.GRADIENT] == 2048


def test_graph_edges_and_storage_table():
    step = build_graph(_trace())
    assert set(step.graph.edges) == {(0, 1), (1, 2)}
    assert step.graph.edges[1, 2]["storages"] == [5]
    assert step.storages[5].producer == 1 and step.storages[5].users == (2,)
    assert step.storages[1].module == "layer" and step.storages[0].producer is None
