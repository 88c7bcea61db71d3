"""When each device storage is alive, in op indices, and how many bytes the allocator gives it."""

from __future__ import annotations

from dataclasses import dataclass

from analysis.allocator import block_size
from tracer.roles import Role
from tracer.trace import Trace


@dataclass(frozen=True)
class Lifetime:
    storage_id: int
    first: int  # first op index at which the storage is allocated
    last: int  # last op index at which it is still allocated (it is freed right after)
    bytes: int  # allocator block size
    role: Role


def lifetimes(trace: Trace) -> list[Lifetime]:
    """Lifetimes of the storages that occupy device memory during the step.

    A storage that existed before the step is live from op 0; one that outlives the step is live to the
    last op. Host storages and zero-byte storages occupy no device memory and are left out.
    """
    last_op = len(trace.ops) - 1
    result = []
    for storage in trace.storages.values():
        nbytes = block_size(storage.nbytes)
        if not storage.on_device or nbytes == 0:
            continue
        first = 0 if storage.created_at is None else storage.created_at
        last = last_op if storage.freed_after is None else storage.freed_after
        if last >= first:
            result.append(Lifetime(storage.id, first, last, nbytes, storage.role))
    return result
