"""When each device storage is alive, in op indices."""

from __future__ import annotations

from typing import NamedTuple

from analysis.allocator import block_size
from tracer.graph import StepGraph, StorageRow
from tracer.roles import Role


def holds_memory(row: StorageRow) -> bool:
    """False for a storage a transform made and released at once (freed before the op that made it)."""
    return row.producer is None or row.freed_after is None or row.freed_after >= row.producer


class Lifetime(NamedTuple):  # a tuple: the passes make one per storage, each time they read a step
    storage_id: int
    first: int  # first op index at which the storage is allocated
    last: int  # last op index at which it is still allocated (it is freed right after)
    bytes: int  # allocator block size
    role: Role


def lifetimes(step: StepGraph, rounded: bool = True, on_device: bool = True, nonzero: bool = True) -> list[Lifetime]:
    """Lifetimes of the storages that occupy device memory during the step (host memory if not
    ``on_device``).

    A storage that existed before the step is live from op 0; one that outlives the step is live to the
    last op. Zero-byte storages occupy nothing and are left out. ``rounded`` counts allocator blocks;
    otherwise the bytes the tensors need (as memory trackers on CPU count). ``nonzero=False`` keeps the zero-byte
    ones too (a line's sizes may grow from zero).
    """
    last_op = len(step.ops) - 1
    result = []
    for row in step.storages.values():
        size = block_size(row.nbytes) if rounded else row.nbytes
        if row.on_device != on_device or (size == 0 and nonzero):
            continue
        first = 0 if row.producer is None else row.producer
        last = last_op if row.freed_after is None else row.freed_after
        if last >= first:
            result.append(Lifetime(row.id, first, last, size, row.role))
    return result
