"""The step at any batch size from the same step traced at two consecutive batch sizes.

The batch size changes no op and no lifetime of a step, only the sizes of what the batch flows through; each
such size is a product of dimensions one of which is the batch (or the batch times the sequence). So every
storage's bytes and every dimension of its shape, and every op's FLOPs and traffic, are affine in the batch
size (so are the bytes of host transfers and collectives), and two steps determine them all:
``BatchLine(step_2, step_3, 2).at(b)`` is the step at batch ``b``
without tracing it. tests/test_plan.py checks this against fresh traces at other batch sizes.

Batch 1 is not on the line: some code copies a tensor only when it is not contiguous, and a slice of a
batch of one often is (transformers' loss makes ``labels[..., 1:].contiguous()``), so batch 1 is traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from tracer.graph import StepGraph, StorageRow, replaced
from tracer.trace import Op


class BatchShapeError(ValueError):
    """The two steps differ in more than sizes, so neither is a resized copy of the other."""


@dataclass(frozen=True)
class BatchLine:
    one: StepGraph  # the step at batch size ``first``
    two: StepGraph  # the same step at batch size ``first + 1``
    first: int = 2

    def __post_init__(self) -> None:
        _check_same_structure(self.one, self.two)

    @cached_property
    def _scaled_storages(self) -> list[int]:
        return [storage_id for storage_id, row in self.one.storages.items() if row != self.two.storages[storage_id]]

    @cached_property
    def _scaled_ops(self) -> list[int]:
        return [
            op.index
            for op, two in zip(self.one.ops, self.two.ops, strict=True)
            if (op.flops, op.bytes_moved) != (two.flops, two.bytes_moved)
        ]

    def at(self, batch: int) -> StepGraph:
        if batch < self.first:
            raise ValueError(f"batch {batch} is below the line, which starts at batch {self.first}")
        steps = batch - self.first
        rows = dict(self.one.storages)
        for storage_id in self._scaled_storages:
            rows[storage_id] = _row_at(rows[storage_id], self.two.storages[storage_id], steps)
        ops = list(self.one.ops)
        for index in self._scaled_ops:
            ops[index] = _op_at(ops[index], self.two.ops[index], steps)
        transfers = [
            one if one == two else replaced(one, nbytes=_affine(one.nbytes, two.nbytes, steps))
            for one, two in zip(self.one.transfers, self.two.transfers, strict=True)
        ]
        collectives = [
            one if one == two else replaced(one, nbytes=_affine(one.nbytes, two.nbytes, steps))
            for one, two in zip(self.one.collectives, self.two.collectives, strict=True)
        ]
        return StepGraph(
            ops=ops, storages=rows, structure=self.one.structure, transfers=transfers, collectives=collectives
        )

    def slopes(self) -> dict[int, int]:
        """Bytes each storage that grows with the batch gains per sequence."""
        return {i: self.two.storages[i].nbytes - self.one.storages[i].nbytes for i in self._scaled_storages}

    def carries(self, derived: StepGraph) -> bool:
        """Whether :meth:`onto` applies: ``derived`` was rewritten from the line's first step, keeping the sizes of
        what the batch flows through and the step's own transfers and collectives."""
        if derived.rewritten_ops is None or len(derived.rewritten_ops) != len(self.one.ops):
            return False
        rows = derived.storages
        for storage_id in self._scaled_storages:
            one, row = self.one.storages[storage_id], rows.get(storage_id)
            if row is None or row.nbytes != one.nbytes or row.shape != one.shape:
                return False
        own = (self.one.transfers, self.one.collectives)
        return own == (derived.transfers[: len(own[0])], derived.collectives[: len(own[1])])

    def onto(self, derived: StepGraph, batch: int) -> StepGraph:
        """``derived``, a rewrite of this line's first step that leaves what the batch flows through as it is (a
        data-parallel runtime: its buffers and shards follow the parameters), at ``batch``: the line's sizes
        carried onto the rewritten step, whose lifetimes and added storages stay. The rewrite is then made once,
        not at every batch size."""
        if derived.rewritten_ops is None or len(derived.rewritten_ops) != len(self.one.ops):
            raise BatchShapeError("the step was not rewritten from the line's first step")
        steps = batch - self.first
        rows = dict(derived.storages)
        for storage_id in self._scaled_storages:
            one, row = self.one.storages[storage_id], rows.get(storage_id)
            if row is None or (row.nbytes, row.shape) != (one.nbytes, one.shape):
                raise BatchShapeError(f"the rewrite resized storage {storage_id} ({one.name or one.role.value})")
            scaled = _row_at(one, self.two.storages[storage_id], steps)
            rows[storage_id] = replaced(row, nbytes=scaled.nbytes, shape=scaled.shape)
        ops = list(derived.ops)
        for index in self._scaled_ops:
            at = derived.rewritten_ops[index]
            scaled = _op_at(self.one.ops[index], self.two.ops[index], steps)
            ops[at] = replaced(ops[at], flops=scaled.flops, bytes_moved=scaled.bytes_moved)
        return StepGraph(
            ops=ops,
            storages=rows,
            structure=derived.structure,
            transfers=_carried(self.one.transfers, self.two.transfers, derived.transfers, steps),
            collectives=_carried(self.one.collectives, self.two.collectives, derived.collectives, steps),
            rewritten_ops=derived.rewritten_ops,
        )


def _carried(one: list, two: list, derived: list, steps: int) -> list:
    """A rewrite's transfers or collectives: the line's own first (at the batch), then those the rewrite added."""
    if derived[: len(one)] != one:
        raise BatchShapeError("the rewrite changed the step's own transfers or collectives")
    own = [
        a if a == b else replaced(a, nbytes=_affine(a.nbytes, b.nbytes, steps)) for a, b in zip(one, two, strict=True)
    ]
    return own + derived[len(one) :]


def _affine(one: int, two: int, steps: int) -> int:
    return one + (two - one) * steps


def _row_at(one: StorageRow, two: StorageRow, steps: int) -> StorageRow:
    nbytes = _affine(one.nbytes, two.nbytes, steps)
    shape = tuple(_affine(a, b, steps) for a, b in zip(one.shape, two.shape, strict=True))
    return replaced(one, nbytes=nbytes, shape=shape)


def _op_at(one: Op, two: Op, steps: int) -> Op:
    return replaced(
        one, flops=_affine(one.flops, two.flops, steps), bytes_moved=_affine(one.bytes_moved, two.bytes_moved, steps)
    )


_SIZES = {"nbytes", "shape"}


def _check_same_structure(one: StepGraph, two: StepGraph) -> None:
    if len(one.ops) != len(two.ops) or one.storages.keys() != two.storages.keys():
        raise BatchShapeError(
            f"{len(one.ops)} ops and {len(one.storages)} storages at one batch size, "
            f"{len(two.ops)} and {len(two.storages)} at the next"
        )
    for a, b in zip(one.ops, two.ops, strict=True):
        if (a.target, a.module, a.phase, a.inputs, a.outputs, a.recompute) != (
            b.target,
            b.module,
            b.phase,
            b.inputs,
            b.outputs,
            b.recompute,
        ):
            raise BatchShapeError(f"op {a.index} is {a.target} at one batch size and {b.target} at the next")
    for storage_id, a in one.storages.items():
        b = two.storages[storage_id]
        if a == b:
            continue
        differing = {name for name, value in a.__dict__.items() if b.__dict__[name] != value}
        if not differing <= _SIZES or len(a.shape) != len(b.shape):
            raise BatchShapeError(f"storage {storage_id} ({a.name or a.role.value}) differs in {sorted(differing)}")
    if [(t.phase, t.direction, t.what, t.overlaps) for t in one.transfers] != [
        (t.phase, t.direction, t.what, t.overlaps) for t in two.transfers
    ]:
        raise BatchShapeError("the host transfers differ")
    if [replaced(c, nbytes=0) for c in one.collectives] != [replaced(c, nbytes=0) for c in two.collectives]:
        raise BatchShapeError("the collectives differ")
