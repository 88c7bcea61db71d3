"""The step of two accumulating micro-steps, derived from the traced step without accumulation.

``for _ in range(2): loss = model(...).loss / 2; loss.backward()``, then the optimizer step, records the plain
step's forward and backward twice, with differences at known places only:

- each micro-step divides its loss: ``aten.div`` after the forward, and the division's backward right after the
  loop's own backward ops (the root gradient's ``ones_like``, and GradScaler's ``mul`` by the scale and its
  backward around it); the undivided loss dies at the division, the divided one when the next micro-step's loss
  replaces it (the last one when the step returns, as the plain step's loss does);
- the first micro-step's gradients become the ``.grad`` they become in the plain step (``AccumulateGrad`` steals
  them: ``aten.detach``); the second's are temporaries that ``AccumulateGrad`` adds into them (``aten.add_``,
  ``variable_grad += new_grad``) and then drops;
- the second micro-step's storages are new ones, numbered as the recorder numbers them: in the order ops first
  see them.

So the derived trace is the trace of the accumulating loop, op for op and storage for storage
(tests/test_accumulation.py), for the cost of a copy instead of a second trace. A step without this shape (a
gradient cloned rather than stolen, a storage of the forward or backward living into the optimizer step, a loss
read again) raises :class:`NotDerivable`, and the accumulating loop is traced instead. A loop that keeps its
outputs (``outputs = model(...)``) holds each micro-step's until the next micro-step's forward returns, the last
one's past the step, as the plain step holds its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from tracer.graph import replaced
from tracer.modules import LOOP
from tracer.roles import Phase, Role
from tracer.trace import Op, Storage, Trace

MICRO_STEPS = 2  # two stand for any number (tracer/tracing.py: traced_micro_steps)
_DIVIDE = "aten.div.Tensor"
_SCALE = "aten.mul.Tensor"
_ONES = "aten.ones_like.default"
_STEAL = "aten.detach.default"
_ACCUMULATE = "aten.add_.Tensor"
_QUOTIENT, _SCALED_ROOT = "divided loss", "divided root gradient"


class NotDerivable(Exception):
    """The plain step does not have the shape the derivation relies on; the message says where."""


@dataclass(frozen=True)
class _Plain:
    """Where the parts of the plain step lie."""

    trace: Trace
    backward: int  # index of the first backward op: the loop's (GradScaler's scale, or the root's ones_like)
    head_end: int  # index of the loop's last backward op: the root gradient's ones_like, or the scale's backward
    optimizer: int  # index of the first optimizer op
    loss: int  # storage id of the loss
    root: int  # storage id of the gradient the loop's backward ops hand the model
    root_readers: frozenset[int]  # the backward ops after the loop's that read it
    steals: dict[int, int]  # gradient storage id -> the op at which AccumulateGrad makes it the .grad
    stolen: dict[int, int]  # the other way round
    # A loop that keeps its outputs (``outputs = model(...)``): the forward op after which the previous step's die,
    # replaced by this step's, which outlive it; None for a loop that drops them
    outputs_replaced: int | None

    @property
    def returns(self) -> int:
        """The plain step's last op, after which what the loop's locals hold dies."""
        return len(self.trace.ops) - 1

    @property
    def loss_kept(self) -> bool:
        """Whether the loss lives in the outputs the loop keeps."""
        return self.trace.storages[self.loss].freed_after is None

    def at(self, micro: int, index: int) -> int:
        """Where plain op ``index`` lands: in micro-step ``micro`` if it is a forward or backward op, else in the
        optimizer step after every micro-step. A micro-step's ops are the plain forward and backward and the two
        divisions."""
        if index >= self.optimizer:
            return MICRO_STEPS * 2 + index + (MICRO_STEPS - 1) * self.optimizer
        if index < self.backward:
            return micro * (self.optimizer + 2) + index
        return micro * (self.optimizer + 2) + index + (1 if index <= self.head_end else 2)

    def division(self, micro: int) -> int:
        """Where micro-step ``micro`` divides its loss."""
        return self.at(micro, self.backward) - 1

    def loss_death(self, micro: int) -> int:
        """Where micro-step ``micro``'s divided loss dies, with what its autograd graph still holds (a reentrant
        checkpoint's inputs): when the next micro-step's forward returns its loss, the last one's with the step."""
        if micro == MICRO_STEPS - 1:
            return self.at(0, self.returns)
        return self.division(micro + 1) - 1

    def existing(self, storage: Storage) -> Storage:
        """``storage``, which exists before the step: alive through it, replaced by the first micro-step's outputs
        (the previous step's, kept by the loop) or by the optimizer step (an Adafactor state)."""
        if storage.freed_after is None:
            return storage
        if storage.freed_after < self.optimizer and storage.freed_after != self.outputs_replaced:
            raise NotDerivable(f"{storage.name or storage.id}, which exists before the step, dies in its forward")
        return replaced(storage, freed_after=self.at(0, storage.freed_after))

    def placed(self, micro: int, storage: Storage) -> Storage:
        """``storage``, made by a plain op, as micro-step ``micro`` (or the optimizer step) makes it."""
        created, freed = storage.created_at, storage.freed_after
        if created >= self.optimizer or storage.id in self.steals:  # the optimizer step's; the .grad, in zero_grad
            death = None if freed is None else self.at(0, freed)
        elif freed is not None and freed < self.optimizer:
            death = self.at(micro, freed)
        elif freed is None and created < self.backward and self.outputs_replaced is not None:  # the kept outputs
            death = self.at(micro + 1, self.outputs_replaced) if micro < MICRO_STEPS - 1 else None
        elif freed == self.returns:
            death = self.loss_death(micro)
        else:
            raise NotDerivable(f"storage {storage.id} {storage.shape} of the forward or backward outlives them")
        return replaced(storage, created_at=self.at(micro, created), freed_after=death)


def accumulating_trace(plain: Trace, step_assumption: str) -> Trace:
    """The trace of two accumulating micro-steps and one optimizer step, from ``plain``, the same step's trace
    without accumulation at the same batch size; ``step_assumption`` describes the accumulating step."""
    parts = _parts(plain)
    made: dict[Hashable, Storage] = {}  # storage key -> the storage, placed in the derived step (its id to come)
    ops = [op for micro in range(MICRO_STEPS) for op in _micro_step(parts, micro, made)]
    key = _optimizer_key(parts)
    for index in range(parts.optimizer, len(plain.ops)):
        op = plain.ops[index]
        at = parts.at(0, index)
        ops.append(replaced(op, index=at, inputs=tuple(map(key, op.inputs)), outputs=tuple(map(key, op.outputs))))
        for storage_id in (*op.inputs, *op.outputs):
            if plain.storages[storage_id].created_at == index:
                made[key(storage_id)] = parts.placed(0, plain.storages[storage_id])
    made |= {("existing", s.id): parts.existing(s) for s in plain.storages.values() if s.created_at is None}
    ids = _numbering(plain, ops)
    storages = {ids[k]: replaced(storage, id=ids[k]) for k, storage in made.items()}
    return Trace(
        ops=[
            replaced(op, inputs=tuple(ids[k] for k in op.inputs), outputs=tuple(ids[k] for k in op.outputs))
            for op in ops
        ],
        storages=dict(sorted(storages.items())),
        assumptions=plain.assumptions | {"step": step_assumption},
        parameter_count=plain.parameter_count,
        trainable_parameter_count=plain.trainable_parameter_count,
        structure=plain.structure,
        optimizer_traffic={
            parts.at(0, index): {ids[key(s)]: moved for s, moved in by_storage.items()}
            for index, by_storage in plain.optimizer_traffic.items()
        },
    )


def _parts(plain: Trace) -> _Plain:
    phases = [op.phase for op in plain.ops]
    backward, optimizer = plain.phase_start(Phase.BACKWARD), plain.phase_start(Phase.OPTIMIZER)
    if backward is None or optimizer is None:
        raise NotDerivable("the step has no backward or no optimizer step")
    expected = [Phase.FORWARD] * backward + [Phase.BACKWARD] * (optimizer - backward)
    if phases != expected + [Phase.OPTIMIZER] * (len(phases) - optimizer):
        raise NotDerivable("the step is not one forward, one backward and one optimizer step")
    scaled = plain.ops[backward].target == _SCALE  # GradScaler.scale(loss): loss * scale, then its backward
    head_end = backward + (2 if scaled else 0)
    head = plain.ops[backward : head_end + 1]
    if [op.target for op in head] != ([_SCALE, _ONES, _SCALE] if scaled else [_ONES]):
        raise NotDerivable(f"backward starts with {head[0].target}, not the loop's ones_like or GradScaler's scale")
    if any(op.module != LOOP or len(op.outputs) != 1 for op in head):
        raise NotDerivable("the root gradient is not made by the loop")
    loss, root = head[0].inputs[0], head[-1].outputs[0]
    later = plain.ops[head_end + 1 :]
    if any(loss in op.inputs or loss in op.outputs for op in later):
        raise NotDerivable("the loss is read after backward starts")
    replaced_at = {s.freed_after for s in plain.storages.values() if s.created_at is None and s.freed_after is not None}
    outputs_replaced = next((i for i in replaced_at if i < backward), None)
    if any(i < optimizer for i in replaced_at - {outputs_replaced}):
        raise NotDerivable("storages existing before the step die in its forward at more than one op")
    loss_death = plain.storages[loss].freed_after
    if loss_death != len(plain.ops) - 1 and not (loss_death is None and outputs_replaced is not None):
        raise NotDerivable("the loss does not live until the step returns, nor in outputs the loop keeps")
    last_writer = {storage_id: op for op in plain.ops[backward:optimizer] for storage_id in op.outputs}
    steals = {}
    for storage in plain.storages.values():
        if storage.role is not Role.GRADIENT or storage.created_at is None:
            continue
        steal = last_writer.get(storage.id)
        if steal is None or steal.target != _STEAL or steal.inputs != (storage.id,):
            raise NotDerivable(f"the gradient of {storage.param} is not stolen by AccumulateGrad")
        if storage.freed_after is None or storage.freed_after < optimizer:
            raise NotDerivable(f"the gradient of {storage.param} is not freed by zero_grad")
        steals[storage.id] = steal.index
    readers = frozenset(op.index for op in later if root in op.inputs and op.phase is Phase.BACKWARD)
    if not readers:
        raise NotDerivable("nothing reads the root gradient")
    stolen = {index: storage_id for storage_id, index in steals.items()}
    return _Plain(plain, backward, head_end, optimizer, loss, root, readers, steals, stolen, outputs_replaced)


def _micro_step(parts: _Plain, micro: int, made: dict[Hashable, Storage]) -> list[Op]:
    """The ops of micro-step ``micro``, storages named by keys, recording in ``made`` the storages it makes."""
    plain = parts.trace

    def key(storage_id: int) -> Hashable:
        return ("existing", storage_id) if plain.storages[storage_id].created_at is None else (micro, storage_id)

    loss, root = plain.storages[parts.loss], plain.storages[parts.root]
    quotient, scaled = (micro, _QUOTIENT), (micro, _SCALED_ROOT)
    ops = []
    for index in range(parts.optimizer):
        op = plain.ops[index]
        at = parts.at(micro, index)
        if index == parts.backward:  # loss / micro_steps, which the loop's backward ops read
            ops.append(_division(at - 1, Phase.FORWARD, key(parts.loss), quotient, loss.nbytes))
            made[quotient] = replaced(
                loss, role=Role.ACTIVATION, created_at=at - 1, freed_after=parts.loss_death(micro)
            )
        if index == parts.head_end:  # the division's backward, between the loop's backward ops and the model's
            inputs = tuple(quotient if i == parts.loss else key(i) for i in op.inputs)
            ops.append(replaced(op, index=at, inputs=inputs, outputs=(key(parts.root),)))
            ops.append(_division(at + 1, Phase.BACKWARD, key(parts.root), scaled, root.nbytes))
            last_read = max(parts.at(micro, reader) for reader in parts.root_readers)
            held = root.freed_after > max(parts.root_readers)  # the engine holds ones_like's root to the end
            made[key(parts.root)] = (
                parts.placed(micro, root) if held else replaced(root, created_at=at, freed_after=at + 1)
            )
            made[scaled] = replaced(root, role=Role.TEMPORARY, created_at=at + 1, freed_after=last_read)
            continue
        gradient = parts.stolen.get(index) if micro > 0 else None
        if gradient is not None:  # AccumulateGrad: .grad += the micro-step's gradient
            added = ((0, gradient), key(gradient))
            moved = 3 * plain.storages[gradient].nbytes
            ops.append(replaced(op, index=at, target=_ACCUMULATE, inputs=added, outputs=added[:1], bytes_moved=moved))
            continue
        divided = index in parts.root_readers
        inputs = tuple(
            scaled if divided and i == parts.root else quotient if i == parts.loss else key(i) for i in op.inputs
        )
        ops.append(replaced(op, index=at, inputs=inputs, outputs=tuple(map(key, op.outputs))))
        for storage_id in (*op.inputs, *op.outputs):
            source = plain.storages[storage_id]
            if source.created_at != index:
                continue
            if storage_id == parts.loss and not parts.loss_kept:  # dies at the division
                made[key(storage_id)] = replaced(
                    source, role=Role.TEMPORARY, created_at=at, freed_after=parts.division(micro)
                )
            elif storage_id in parts.steals and micro > 0:  # a temporary AccumulateGrad adds and drops
                death = parts.at(micro, parts.steals[storage_id])
                made[key(storage_id)] = replaced(source, role=Role.TEMPORARY, created_at=at, freed_after=death)
            else:
                made[key(storage_id)] = parts.placed(micro, source)
    return ops


def _optimizer_key(parts: _Plain) -> Callable[[int], Hashable]:
    storages = parts.trace.storages

    def key(storage_id: int) -> Hashable:
        created = storages[storage_id].created_at
        if created is None:
            return ("existing", storage_id)
        if created < parts.optimizer:
            if storage_id not in parts.steals:
                raise NotDerivable(f"the optimizer step reads storage {storage_id}, made before it")
            return (0, storage_id)
        return ("optimizer", storage_id)

    return key


def _division(index: int, phase: Phase, read: Hashable, written: Hashable, nbytes: int) -> Op:
    """The loop's ``loss / micro_steps`` (forward) or its backward, on a scalar of ``nbytes``."""
    return Op(index, _DIVIDE, LOOP, phase, (read,), (written,), bytes_moved=2 * nbytes)


def _numbering(plain: Trace, ops: list[Op]) -> dict[Hashable, int]:
    """Storage ids as the recorder gives them: those existing before the step keep theirs; the rest are
    numbered in the order ops first see them (inputs, then outputs). Checked on the plain trace first."""
    made = [s.id for s in plain.storages.values() if s.created_at is not None]
    first = min(made, default=len(plain.storages))
    if any(s.created_at is None and s.id > first for s in plain.storages.values()):
        raise NotDerivable("a storage existing before the step was registered during it")
    seen = list(dict.fromkeys(i for op in plain.ops for i in (*op.inputs, *op.outputs) if i >= first))
    if seen != list(range(first, first + len(seen))) or len(seen) != len(made):
        raise NotDerivable("the step's storages are not numbered in the order its ops see them")
    ids: dict[Hashable, int] = {("existing", s.id): s.id for s in plain.storages.values() if s.created_at is None}
    following = first
    for op in ops:
        for key in (*op.inputs, *op.outputs):
            if key not in ids:
                ids[key], following = following, following + 1
    return ids
