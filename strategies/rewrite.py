"""Edit a step graph: insert ops between recorded ops, resize and retime storages, add buffers.

Positions are expressed against the original ops (``before(i)``, ``after(i)``); ops inserted at the same
position keep the order in which they were inserted. ``build`` renumbers everything.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import count
from typing import NamedTuple

from tracer.graph import StepGraph, StorageRow, replaced
from tracer.modules import LOOP
from tracer.roles import Phase, Role
from tracer.trace import Op


class Point(NamedTuple):
    """An op of the rewritten step: an original op, or one inserted before or after one."""

    original: int
    slot: int  # 0 for the original op itself; negative before it, positive after it, in insertion order


class Rewrite:
    """The edits a strategy makes to one step, collected and applied at once by ``build``: inserted ops
    (collectives, copies, frees) at points relative to the recorded ops, storages resized, retimed, moved to
    the host or added. The recorded step itself is never changed."""

    def __init__(self, step: StepGraph) -> None:
        self.step = step
        self._inserted: dict[Point, Op] = {}
        self._order = count(1)
        # The rows edited or added, with where they are allocated and freed; every other row is the step's own.
        self._rows: dict[int, tuple[StorageRow, Point | None, Point | None]] = {}
        self._next_id = max(step.storages, default=-1) + 1
        self.transfers = list(step.transfers)

    @property
    def last(self) -> Point:
        return Point(len(self.step.ops) - 1, 0)

    def before(self, index: int, target: str, module: str, phase: Phase) -> Point:
        """Insert an op before original op ``index`` (after anything already inserted there)."""
        point = Point(index, -1_000_000 + next(self._order))
        self._inserted[point] = Op(-1, target, module, phase, (), ())
        return point

    def after(self, index: int, target: str, module: str, phase: Phase) -> Point:
        """Insert an op after original op ``index`` (after anything already inserted there)."""
        point = Point(index, next(self._order))
        self._inserted[point] = Op(-1, target, module, phase, (), ())
        return point

    def _edited(self, storage_id: int) -> tuple[StorageRow, Point | None, Point | None]:
        if storage_id in self._rows:
            return self._rows[storage_id]
        row = self.step.storages[storage_id]
        return row, _point(row.producer), _point(row.freed_after)

    def resize(
        self, storage_id: int, nbytes: int, dtype: str | None = None, shape: tuple[int, ...] | None = None
    ) -> None:
        row, first, last = self._edited(storage_id)
        row = replaced(row, nbytes=nbytes, dtype=dtype or row.dtype, shape=shape or row.shape)
        self._rows[storage_id] = (row, first, last)

    def to_host(self, storage_id: int) -> None:
        """The storage lives in host memory instead (offloaded)."""
        row, first, last = self._edited(storage_id)
        self._rows[storage_id] = (replaced(row, on_device=False), first, last)

    def set_role(self, storage_id: int, role: Role) -> None:
        row, first, last = self._edited(storage_id)
        self._rows[storage_id] = (replaced(row, role=role), first, last)

    def lifetime(self, storage_id: int) -> tuple[Point | None, Point | None]:
        """Where the storage is allocated and freed now (None: before / after the step)."""
        _, first, last = self._edited(storage_id)
        return first, last

    def retime(self, storage_id: int, first: Point | object | None = ..., last: Point | object | None = ...) -> None:
        """Move where a storage is allocated (``first``) or freed (``last``); None means before/after the step."""
        row, old_first, old_last = self._edited(storage_id)
        self._rows[storage_id] = (
            row,
            old_first if first is ... else first,
            old_last if last is ... else last,
        )

    def add(
        self,
        nbytes: int,
        role: Role,
        first: Point | None,
        last: Point | None,
        name: str,
        dtype: str,
        param: str | None = None,
        on_device: bool = True,
        stream: str = "",
    ) -> int:
        """A new storage live from ``first`` to ``last`` (None: from before the step / past its end); in
        host memory if not ``on_device``; allocated on a side ``stream`` of the runtime's ("": the compute one)."""
        storage_id = self._next_id
        self._next_id += 1
        row = StorageRow(
            id=storage_id,
            nbytes=nbytes,
            dtype=dtype,
            shape=(nbytes,),
            role=role,
            producer=None,
            freed_after=None,
            users=(),
            module="",
            on_device=on_device,
            name=name,
            param=param,
            stream=stream,
        )
        self._rows[storage_id] = (row, first, last)
        return storage_id

    def row(self, storage_id: int) -> StorageRow:
        return self._rows[storage_id][0] if storage_id in self._rows else self.step.storages[storage_id]

    def build(self) -> StepGraph:
        """The rewritten step: the inserted ops merged into the original ones, everything renumbered. One pass over
        the original ops, which outnumber the inserted ones by far."""
        original_ops = self.step.ops
        inserted = sorted(self._inserted.items())
        index_of: dict[Point, int] = {}  # inserted points only: an original op's new index is in ``renumbered``
        renumbered: list[int] = []
        ops: list[Op] = []
        next_inserted = 0
        for position, op in enumerate(original_ops):
            while next_inserted < len(inserted) and inserted[next_inserted][0] < (position, 0):
                point, new = inserted[next_inserted]
                index_of[point] = len(ops)
                ops.append(replaced(new, index=len(ops)))
                next_inserted += 1
            renumbered.append(len(ops))
            ops.append(op if op.index == len(ops) else replaced(op, index=len(ops)))
        for point, new in inserted[next_inserted:]:
            index_of[point] = len(ops)
            ops.append(replaced(new, index=len(ops)))

        def at(point: Point | None) -> int | None:
            if point is None:
                return None
            return renumbered[point.original] if point.slot == 0 else index_of[point]

        moved = renumbered.__getitem__
        edited = self._rows
        rows = {}
        for storage_id, row in self.step.storages.items():  # in the step's order: the allocator replays ties in it
            if storage_id in edited:
                row, first, last = edited[storage_id]
                rows[storage_id] = replaced(
                    row, producer=at(first), freed_after=at(last), users=tuple(map(moved, row.users))
                )
            else:
                rows[storage_id] = replaced(
                    row,
                    producer=None if row.producer is None else renumbered[row.producer],
                    freed_after=None if row.freed_after is None else renumbered[row.freed_after],
                    users=tuple(map(moved, row.users)),
                )
        for storage_id, (row, first, last) in edited.items():
            if storage_id not in rows:  # added by the rewrite
                rows[storage_id] = replaced(row, producer=at(first), freed_after=at(last))
        return StepGraph(
            ops=ops,
            storages=rows,
            structure=self.step.structure,
            transfers=self.transfers,
            collectives=list(self.step.collectives),
            rewritten_ops=tuple(renumbered),
        )


def _point(index: int | None) -> Point | None:
    return None if index is None else Point(index, 0)


def unit_windows(
    step: StepGraph, units: dict[str, tuple[str, ...]], ops: range | None = None
) -> dict[str, dict[Phase, tuple[int, int]]]:
    """For each unit (a name and the module paths it owns), the first and last op of its forward and of
    its backward, among ``ops`` (all of the step's by default). Ops of a module belong to the unit owning
    its longest matching path."""
    owner: dict[str, str | None] = {}
    prefixes: dict[str, str] = {}  # module path -> the first unit that owns it
    for unit, paths in units.items():
        for path in paths:
            prefixes.setdefault(path, unit)
    windows: dict[str, dict[Phase, list[int]]] = defaultdict(dict)
    for op in step.ops if ops is None else step.ops[ops.start : ops.stop]:
        if op.phase is Phase.OPTIMIZER:
            continue
        if op.module not in owner:
            owner[op.module] = _owning_unit(op.module, prefixes)
        unit = owner[op.module]
        if unit is None:
            continue
        span = windows[unit].setdefault(op.phase, [op.index, op.index])
        span[1] = op.index
    return {unit: {phase: tuple(span) for phase, span in spans.items()} for unit, spans in windows.items()}


def _owning_unit(module: str, prefixes: dict[str, str]) -> str | None:
    """The unit of the longest module path that is ``module`` or contains it."""
    if module == LOOP:  # outside the model: no unit's, not even the root's
        return None
    path = module
    while True:
        if path in prefixes:
            return prefixes[path]
        if not path:
            return None
        path = path.rpartition(".")[0]
