"""The step's allocations and frees fed to the caching allocator model, as a user's loop feeds the real one.

A measurement runs a warm-up step, resets the peak statistics, and runs the step it reports; the allocator
keeps every segment the warm-up reserved. The replay does the same with the one recorded step:

* warm-up: parameters, buffers and inputs are allocated first (the model and batch exist before training);
  every other storage that exists before the recorded step (optimizer states) is allocated just before the
  first op that reads it, as optimizers create their state lazily in their first step; then the step's own
  allocations and frees, op by op;
* measured step: the same ops again, on the allocator state the warm-up left.

Within an op, its new storages are allocated (in creation order) before the storages whose last use it was
are freed: the same moment the op-level timeline counts (analysis/peak.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from analysis.allocator import AllocatorConfig, Block, CachingAllocator, Segment
from analysis.liveness import holds_memory
from tracer.graph import StepGraph
from tracer.roles import Role

DEFAULT_CONFIG = AllocatorConfig()
EXISTS_BEFORE_TRAINING = (Role.PARAMETER, Role.BUFFER, Role.INPUT)

# Called at every allocation and free of the measured step: (op index, storage id, block, allocated?); first
# with op index -1 for each block live when the measured step starts.
Observer = Callable[[int, int, Block, bool], None]


@dataclass(frozen=True)
class AllocatorReplay:
    allocated_at: list[int]  # allocated bytes at each op of the measured step, after its allocations
    peak_allocated: int  # max_memory_allocated of the measured step
    peak_allocated_op: int
    peak_reserved: int  # max_memory_reserved: the warm-up's segments stay reserved
    segments: list[Segment]  # cudaMalloc'd segments (or expandable ones) at the end, with their blocks


def replay_step(
    step: StepGraph,
    config: AllocatorConfig = DEFAULT_CONFIG,
    observer: Observer | None = None,
) -> AllocatorReplay:
    """Replay a warm-up step and the measured step through the caching allocator model."""
    allocator = CachingAllocator(config)
    sizes = {
        row.id: row.nbytes for row in step.storages.values() if row.on_device and row.nbytes > 0 and holds_memory(row)
    }
    streams: dict[str, int] = {"": 0}  # the compute stream first, then side streams as they appear
    stream_of = {}
    for storage_id in sizes:
        stream_of[storage_id] = streams.setdefault(step.storages[storage_id].stream, len(streams))
    created: dict[int, list[int]] = defaultdict(list)
    released: dict[int, list[int]] = defaultdict(list)
    first_use: dict[int, list[int]] = defaultdict(list)
    before: list[int] = []
    for storage_id in sorted(sizes):
        row = step.storages[storage_id]
        if row.producer is None:
            if row.role in EXISTS_BEFORE_TRAINING or not row.users:
                before.append(storage_id)
            else:
                first_use[min(row.users)].append(storage_id)
        else:
            created[row.producer].append(storage_id)
        if row.freed_after is not None:
            released[row.freed_after].append(storage_id)

    live: dict[int, Block] = {}

    def allocate(storage_id: int, index: int, measured: bool) -> None:
        block = allocator.malloc(sizes[storage_id], stream_of[storage_id])
        live[storage_id] = block
        if measured and observer is not None:
            observer(index, storage_id, block, True)

    def release(storage_id: int, index: int, measured: bool) -> None:
        block = live.pop(storage_id)
        if measured and observer is not None:  # before the free merges the block with its free neighbours
            observer(index, storage_id, block, False)
        allocator.free(block)

    for storage_id in before:
        allocate(storage_id, 0, measured=False)
    allocated_at: list[int] = []
    for measured in (False, True):
        if measured:
            for storage_id in [s for s in sizes if step.storages[s].producer is None and s not in live]:
                allocate(storage_id, 0, measured=False)  # existed before the step, freed in the warm-up's
            allocator.reset_peak()
            if observer is not None:
                for storage_id, block in live.items():
                    observer(-1, storage_id, block, True)
        for op in step.ops:
            for storage_id in first_use.get(op.index, ()):
                if storage_id not in live:
                    allocate(storage_id, op.index, measured)
            for storage_id in created.get(op.index, ()):
                allocate(storage_id, op.index, measured)
            if measured:
                allocated_at.append(allocator.allocated)
            for storage_id in released.get(op.index, ()):
                release(storage_id, op.index, measured)
        if not measured:  # what the warm-up made that outlives it is replaced by the next step's
            for storage_id in [s for s in live if step.storages[s].producer is not None]:
                release(storage_id, len(step.ops), measured=False)
    peak_op = max(range(len(allocated_at)), key=allocated_at.__getitem__) if allocated_at else 0
    return AllocatorReplay(
        allocated_at=allocated_at,
        peak_allocated=allocator.peak_allocated,
        peak_allocated_op=peak_op,
        peak_reserved=allocator.peak_reserved,
        segments=list(allocator.segments),
    )
