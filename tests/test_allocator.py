"""The caching allocator model against cases worked out from CUDACachingAllocator.cpp's rules, and its
replay of recorded steps."""

from __future__ import annotations

import dataclasses

import pytest

from analysis.allocator import MIB, AllocatorConfig, CachingAllocator, OutOfMemory, block_size, segment_size
from analysis.estimate import analyze
from analysis.peak import find_peak, timeline
from analysis.replay import replay_step, workspace_first_use
from tests.tiny_models import tiny_model
from tracer.gradient_sums import in_place
from tracer.graph import build_graph
from tracer.roles import Phase, Role
from tracer.trace import Op, Storage, Trace
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup

KIB = 1024


def test_requests_round_to_512_bytes_and_zero_allocates_nothing():
    assert [block_size(n) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]
    allocator = CachingAllocator()
    assert allocator.malloc(0) is None
    block = allocator.malloc(1)
    assert (block.size, allocator.allocated, allocator.reserved) == (512, 512, 2 * MIB)


def test_segment_sizes_follow_get_allocation_size():
    assert segment_size(1 * MIB) == 2 * MIB  # small pool
    assert segment_size(1 * MIB + 512) == 20 * MIB  # 1-10 MiB share 20 MiB segments
    assert segment_size(10 * MIB - 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB  # own segment, rounded to 2 MiB
    assert segment_size(10 * MIB + 1) == 12 * MIB


def test_small_requests_pack_into_2_mib_segments():
    allocator = CachingAllocator()
    for _ in range(4):
        allocator.malloc(512 * KIB)
    assert allocator.reserved == 2 * MIB
    allocator.malloc(512 * KIB)
    assert (allocator.reserved, len(allocator.segments)) == (4 * MIB, 2)


def test_large_block_is_split_only_when_more_than_1_mib_remains():
    allocator = CachingAllocator()
    split = allocator.malloc(10 * MIB + 512 * KIB)  # 12 MiB segment, 1.5 MiB left: split
    assert (split.size, allocator.allocated) == (10 * MIB + 512 * KIB, 10 * MIB + 512 * KIB)
    whole = allocator.malloc(11 * MIB + 512 * KIB)  # 12 MiB segment, 0.5 MiB left: handed out whole
    assert whole.size == 12 * MIB
    assert allocator.allocated == 22 * MIB + 512 * KIB  # max_memory_allocated counts the whole block
    assert allocator.reserved == 24 * MIB


def test_freed_blocks_are_cached_reused_best_fit_and_merged():
    allocator = CachingAllocator()
    small_hole = allocator.malloc(12 * MIB)
    big_hole = allocator.malloc(16 * MIB)
    allocator.free(small_hole)
    allocator.free(big_hole)
    assert allocator.reserved == 28 * MIB  # nothing goes back to the driver
    reused = allocator.malloc(11 * MIB)
    assert reused.address == small_hole.address and reused.size == 12 * MIB  # best fit, unsplit (1 MiB left)
    assert allocator.reserved == 28 * MIB
    first = allocator.malloc(2 * MIB)  # the free 16 MiB block is the best fit: split
    assert first.address == big_hole.address and allocator.reserved == 28 * MIB


def test_freed_neighbours_merge_back_into_one_block():
    allocator = CachingAllocator()
    first, second = allocator.malloc(2 * MIB), allocator.malloc(3 * MIB)  # one 20 MiB segment, split twice
    assert allocator.reserved == 20 * MIB
    allocator.free(first)
    allocator.free(second)
    merged = allocator.malloc(19 * MIB)  # the segment is one free 20 MiB block again, which fits whole
    assert merged.address == first.address and merged.size == 20 * MIB
    assert allocator.reserved == 20 * MIB


def test_failed_cudamalloc_releases_cached_segments_then_raises():
    allocator = CachingAllocator(AllocatorConfig(capacity=40 * MIB))
    allocator.free(allocator.malloc(30 * MIB))
    allocator.malloc(32 * MIB)  # 30 + 32 > 40: the cached 30 MiB segment is released first
    assert (allocator.reserved, allocator.peak_reserved) == (32 * MIB, 32 * MIB)
    with pytest.raises(OutOfMemory):
        allocator.malloc(10 * MIB)


def test_a_step_that_fills_the_gpu_releases_the_cache_and_retries():
    """A step whose cached segments would outgrow what the GPU can reserve: PyTorch's allocator releases them when
    cudaMalloc fails and retries, so the step runs if what it allocates fits; where it does not, no release helps."""
    model = tiny_model("llama", hidden_size=256, intermediate_size=1024, vocab_size=8000)
    setup = TrainingSetup(target=Target.CUDA, batch_size=4, seq_len=512)
    free = analyze(model, setup)
    assert free.allocator_retries == 0 and free.reserved_bytes > free.peak_bytes + 16 * MIB
    capacity = free.reserved_bytes - 8 * MIB
    full = analyze(model, setup, capacity=capacity)
    assert full.allocator_retries > 0 and full.reserved_bytes <= capacity and full.peak_bytes == free.peak_bytes
    short = analyze(model, setup, capacity=free.peak_bytes - MIB)
    assert (short.reserved_bytes, short.allocator_retries) == (free.reserved_bytes, 0)


def test_empty_cache_releases_only_segments_with_nothing_in_use():
    allocator = CachingAllocator()
    kept = allocator.malloc(2 * MIB)  # a 20 MiB segment, split
    allocator.free(allocator.malloc(3 * MIB))  # from the same segment, which stays: a block of it is in use
    allocator.free(allocator.malloc(30 * MIB))  # a segment of its own, all free: released
    allocator.empty_cache()
    assert (allocator.reserved, allocator.peak_reserved) == (20 * MIB, 50 * MIB)
    assert [segment.address for segment in allocator.segments] == [kept.segment.address]


def test_equal_size_free_blocks_go_by_address_and_new_segments_go_below():
    allocator = CachingAllocator()
    older, newer = allocator.malloc(12 * MIB), allocator.malloc(12 * MIB)
    assert newer.address < older.address  # cudaMalloc's addresses, as the driver mostly gave them: top down
    allocator.free(older)
    allocator.free(newer)
    assert allocator.malloc(12 * MIB).address == newer.address  # the lower address wins the tie
    placed = CachingAllocator(addresses=lambda nbytes: 7 * 1024**3 if nbytes == 12 * MIB else None)
    assert placed.malloc(12 * MIB).address == 7 * 1024**3


def test_peak_statistics_reset_to_current_values():
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(30 * MIB))
    allocator.reset_peak()
    assert (allocator.peak_allocated, allocator.peak_reserved) == (0, 30 * MIB)


def test_expandable_segments_map_pages_and_split_finely():
    allocator = CachingAllocator(AllocatorConfig(expandable_segments=True))
    first = allocator.malloc(11 * MIB + 512 * KIB)
    assert first.size == 11 * MIB + 512 * KIB  # split: 512 bytes or more remain
    allocator.malloc(3 * MIB)
    assert allocator.reserved == 20 * MIB  # one 20 MiB page holds both
    allocator.malloc(8 * MIB)
    assert (allocator.reserved, len(allocator.segments)) == (40 * MIB, 1)  # the segment grows by a page
    allocator.free(first)
    assert allocator.malloc(11 * MIB).address == first.address


def _storage(id, nbytes, role, created_at, freed_after):
    return Storage(id, nbytes, "float32", (nbytes // 4,), role, created_at, freed_after)


def test_replay_warms_up_creates_optimizer_state_lazily_and_reports_the_measured_step():
    storages = [
        _storage(0, 12 * MIB, Role.PARAMETER, None, None),
        _storage(1, 12 * MIB, Role.OPTIMIZER_STATE, None, None),  # created at its first use in the warm-up
        _storage(2, 16 * MIB, Role.ACTIVATION, 0, 1),
        _storage(3, 12 * MIB, Role.GRADIENT, 1, 2),
        _storage(4, 12 * MIB, Role.TEMPORARY, 2, 2),
    ]
    ops = [
        Op(0, "aten.mm.default", "layer", Phase.FORWARD, (0,), (2,)),
        Op(1, "aten.mm.default", "layer", Phase.BACKWARD, (2,), (3,)),
        Op(2, "aten._foreach_sqrt.default", "", Phase.OPTIMIZER, (1, 3), (4,)),
    ]
    step = build_graph(Trace(ops=ops, storages={s.id: s for s in storages}))
    replay = replay_step(step)
    # Warm-up: segments for the parameter (12 MiB), activation (16), gradient (12); the state, created in the
    # optimizer, splits the freed activation's block (4 MiB remain); the temporary needs a segment (12).
    # Measured step: the activation finds no free 16 MiB block (4, 12, 12 are free) and needs a segment of
    # its own; the gradient and the temporary reuse the cached 12 MiB ones.
    assert replay.allocated_at == [40 * MIB, 52 * MIB, 48 * MIB]
    assert replay.peak_allocated == 52 * MIB
    assert replay.peak_reserved == 3 * 12 * MIB + 2 * 16 * MIB
    line = timeline(step).with_allocator_slack(replay.allocated_at)
    assert [line.total(i) for i in range(3)] == replay.allocated_at


def test_a_gradient_sum_made_in_place_takes_over_its_buffered_gradients_block():
    """The engine's ``old.add_(new)`` allocates and frees nothing: replayed from the trace with its sum handed over
    (tracer/gradient_sums.py), the allocator ends as if the trace had recorded that ``add_``. Freeing the buffered
    gradient and then allocating the sum would not: the freed block merges with its free neighbour into 24 MiB, the
    sum takes another cached 12 MiB block, and the last op's 24 MiB fits where, after an ``add_``, it needs a new
    segment."""
    storages = [
        _storage(0, 24 * MIB, Role.TEMPORARY, 0, 0),  # leaves a 24 MiB segment cached
        _storage(1, 12 * MIB, Role.TEMPORARY, 1, 3),  # the buffered gradient, half of it
        _storage(2, 12 * MIB, Role.TEMPORARY, 1, 2),  # its neighbour, the other half
        _storage(3, 12 * MIB, Role.TEMPORARY, 2, 2),  # a 12 MiB segment, cached after op 2
        _storage(4, 12 * MIB, Role.TEMPORARY, 2, 3),  # the new gradient
        _storage(5, 12 * MIB, Role.TEMPORARY, 3, 4),  # the sum
        _storage(6, 24 * MIB, Role.TEMPORARY, 4, 4),
    ]
    ops = [
        Op(0, "aten.mm.default", "layer", Phase.BACKWARD, (), (0,)),
        Op(1, "aten.mm.default", "layer", Phase.BACKWARD, (), (1, 2)),
        Op(2, "aten.mm.default", "layer", Phase.BACKWARD, (), (3, 4)),
        Op(3, "aten.add.Tensor", "layer", Phase.BACKWARD, (1, 4), (5,), sums_gradients=True),
        Op(4, "aten.mm.default", "layer", Phase.BACKWARD, (5,), (6,)),
    ]
    handed_over = build_graph(in_place(Trace(ops=ops, storages={s.id: s for s in storages})))
    add_ = [
        *ops[:3],
        Op(3, "aten.add_.Tensor", "layer", Phase.BACKWARD, (1, 4), (1,)),
        Op(4, "aten.mm.default", "layer", Phase.BACKWARD, (1,), (6,)),
    ]
    kept = [*storages[:1], dataclasses.replace(storages[1], freed_after=4), *storages[2:5], storages[6]]
    recorded_add_ = build_graph(Trace(ops=add_, storages={s.id: s for s in kept}))
    ours, theirs = replay_step(handed_over), replay_step(recorded_add_)
    assert (ours.allocated_at, ours.peak_reserved) == (theirs.allocated_at, theirs.peak_reserved)
    assert ours.peak_reserved == 24 * MIB + 2 * 12 * MIB + 24 * MIB  # freed and allocated again: 48 MiB


def test_workspace_first_use_is_its_threads_first_cublas_op():
    storages = [_storage(1, 32 * MIB, Role.WORKSPACE, None, None), _storage(2, 32 * MIB, Role.WORKSPACE, None, None)]
    ops = [
        Op(0, "aten.embedding.default", "embed", Phase.FORWARD, (), ()),
        Op(1, "aten.addmm.default", "layer", Phase.FORWARD, (), ()),
        Op(2, "aten.mm.default", "layer", Phase.FORWARD, (), ()),
        Op(3, "aten.embedding_dense_backward.default", "embed", Phase.BACKWARD, (), ()),
        Op(4, "aten.mm.default", "layer", Phase.BACKWARD, (), ()),
    ]
    step = build_graph(Trace(ops=ops, storages={s.id: s for s in storages}))
    assert workspace_first_use(step, [1, 2]) == {1: [1], 4: [2]}
    inference = build_graph(Trace(ops=ops[:3], storages={1: storages[0]}))
    assert workspace_first_use(inference, [1]) == {1: [1]}


def test_optimizer_states_are_made_together_parameter_by_parameter(monkeypatch):
    """Adam's first step makes every state in ``_init_group`` before its math: exp_avg then exp_avg_sq of each
    parameter in turn, as the H100's recorded traces show, not each list at the op that first reads it."""
    setup = TrainingSetup(target=Target.CUDA, batch_size=2, seq_len=64)
    step = build_graph(trace_step(tiny_model("llama"), setup))
    states = sorted(
        (row for row in step.storages.values() if row.role is Role.OPTIMIZER_STATE and row.on_device),
        key=lambda row: row.id,
    )
    assert [row.name.rsplit(".", 1)[1] for row in states[:4]] == ["exp_avg", "exp_avg_sq"] * 2
    requested = []
    malloc = CachingAllocator.malloc
    monkeypatch.setattr(CachingAllocator, "malloc", lambda self, n, *a: requested.append(n) or malloc(self, n, *a))
    replay_step(step)
    made = [row.nbytes for row in states]
    assert any(requested[i : i + len(made)] == made for i in range(len(requested)))


@pytest.mark.parametrize("expandable", [False, True])
def test_replay_of_a_traced_step_only_adds_slack_to_the_timeline(expandable):
    setup = TrainingSetup(batch_size=2, seq_len=64)
    step = build_graph(trace_step(tiny_model("llama"), setup))
    line = timeline(step)
    replay = replay_step(step, AllocatorConfig(expandable_segments=expandable))
    slack = [allocated - line.total(i) for i, allocated in enumerate(replay.allocated_at)]
    assert min(slack) >= 0
    assert replay.peak_allocated == max(replay.allocated_at) >= find_peak(line).bytes
    assert replay.peak_reserved >= replay.peak_allocated
    if expandable:  # blocks split whenever 512 bytes remain, so nothing is handed out whole
        assert max(slack) == 0
