"""A whole model's step from the step of a model cut to a few layers: the middle block of layers stamped out.

The trace of the cut model (tracer/layers.py) holds a block ``B`` of layers with a block of the same kinds
before it (``P``) and after it (``T``). Every op of a decoder layer, every storage it makes and every
lifetime is relative to its layer: a layer reads what the layer before it made, frees what it saved in its
own backward, passes gradients to the layer before. So the model's step is the traced one with ``B``
repeated: its ops again after ``B``'s in forward (and in the optimizer's per-parameter loops) and before
them in backward, each copy's storages created and freed at the matching ops of the matching layers, and
the ops over every parameter at once (``_foreach_``) given every copy's storages. Storage ids come out in
the order the recorder would give them, so the stamped trace is the trace of the whole model.

Anything that does not fit this picture (blocks that differ, a layer reaching further than one block, an op
between layers) raises :class:`NotStampable`, and the whole model is traced instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tracer.graph import replaced
from tracer.roles import Phase
from tracer.trace import Op, Storage, Trace


class NotStampable(Exception):
    """The traced layers do not repeat as stamping needs; the message says where."""


@dataclass(frozen=True)
class Blocks:
    """Decoder layers ``list_path.0`` ... of the traced model, and which of them are stamped."""

    list_path: str  # e.g. "model.layers"
    template: int  # first layer of the stamped block
    period: int  # layers in a block
    copies: int  # copies stamped after the template block

    def layer_of(self, text: str) -> int | None:
        """The layer a module path, parameter or storage name lies in, if any."""
        span = self._index_span(text)
        return None if span is None else int(text[span[0] : span[1]])

    def renamed(self, text: str, new_layer: int) -> str:
        """``text`` (which lies in a layer) with that layer's index replaced by ``new_layer``."""
        start, end = self._index_span(text)
        return text[:start] + str(new_layer) + text[end:]

    def _index_span(self, text: str) -> tuple[int, int] | None:
        at = text.find(self.list_path + ".")
        if at < 0 or (at > 0 and text[at - 1] != " "):
            return None
        start = end = at + len(self.list_path) + 1
        while end < len(text) and text[end].isdigit():
            end += 1
        if end == start or (end < len(text) and text[end] != "."):
            return None
        return start, end

    def stamped(self, layer: int) -> bool:
        return self.template <= layer < self.template + self.period

    def in_chain(self, layer: int) -> bool:
        """Whether ``layer`` is in the template block or the blocks on either side of it."""
        return self.template - self.period <= layer < self.template + 2 * self.period

    def new_layer(self, layer: int, copy: int) -> int:
        """Where copy ``copy`` of a traced layer lands in the whole model (copy 0 is the traced layer)."""
        if layer < self.template + self.period:
            return layer + copy * self.period
        return layer + self.copies * self.period

    def source(self, new_layer: int) -> tuple[int, int]:
        """(traced layer, copy) a layer of the whole model is."""
        end = self.template + self.period
        if new_layer < end:
            return new_layer, 0
        if new_layer < end + self.copies * self.period:
            copy = (new_layer - self.template) // self.period
            return new_layer - copy * self.period, copy
        return new_layer - self.copies * self.period, 0


def stamp(trace: Trace, blocks: Blocks) -> Trace:
    """The step of the model with ``blocks.copies`` more copies of the template block, as if traced whole."""
    if blocks.copies < 1:
        return trace
    return _Stamp(trace, blocks).trace()


Instance = tuple[int, int]  # (traced op or storage id, copy)


class _Stamp:
    def __init__(self, trace: Trace, blocks: Blocks) -> None:
        self.source, self.blocks = trace, blocks
        self._ref_cache: dict[Instance, tuple[list[Instance], list[Instance]]] = {}
        self._renamed_cache: dict[tuple[str, int, int], str | None] = {}
        self.op_layer = self._op_layers()
        self.owner = {s.id: self._owner(s) for s in trace.storages.values()}
        self._place_optimizer_ops()
        self.layer_ops = _group({op.index: self.op_layer[op.index] for op in trace.ops})
        self.layer_storages = _group(self.owner)
        self.op_position = _positions(self.layer_ops)
        self.storage_position = _positions(self.layer_storages)
        self._check_blocks_alike()
        self._check_nothing_between_layers()

    # Which layer each op and storage belongs to.

    def _op_layers(self) -> dict[int, int | None]:
        layers = {
            op.index: None if op.phase is Phase.OPTIMIZER else self.blocks.layer_of(op.module) for op in self.source.ops
        }
        self._place_empty_markers(layers)
        return layers

    def _place_empty_markers(self, layers: dict[int, int | None]) -> None:
        """A forward op of no layer that makes only empty tensors belongs to the layer that runs next: torch 2.11's
        non-reentrant checkpoint makes two (its ``dummy`` and ``_NoopSaveInputs``' output, ``torch.empty((0,))``, in
        ``_checkpoint_without_reentrant_generator``) before the checkpointed layer's module is entered."""
        pending: list[int] = []
        for op in self.source.ops:
            layer = layers[op.index]
            if layer is not None:
                for index in pending:
                    layers[index] = layer
                pending = []
            elif self._makes_only_empty_tensors(op):
                pending.append(op.index)
            else:
                pending = []

    def _makes_only_empty_tensors(self, op: Op) -> bool:
        storages = self.source.storages
        return op.phase is Phase.FORWARD and bool(op.outputs) and all(storages[s].nbytes == 0 for s in op.outputs)

    def _owner(self, storage: Storage) -> int | None:
        """The layer a storage belongs to: the layer of the op that made it, else of the parameter it
        belongs to, else of its name (parameters, optimizer states, a kept cache)."""
        if storage.created_at is not None:
            layer = self.op_layer[storage.created_at]
            if layer is not None:
                return layer
        for text in (storage.param, storage.name):
            if text:
                layer = self.blocks.layer_of(text)
                if layer is not None:
                    return layer
        return None

    def _place_optimizer_ops(self) -> None:
        """An optimizer op on one layer's parameters alone (a per-parameter loop) belongs to that layer; one
        over several layers' (``_foreach_``) to none, and is given every copy's storages."""
        for op in self.source.ops:
            if op.phase is Phase.OPTIMIZER:
                layers = {self.owner[s] for s in (*op.inputs, *op.outputs)} - {None}
                if len(layers) == 1:
                    self.op_layer[op.index] = layers.pop()
        for storage in self.source.storages.values():  # what such an op makes is its layer's
            if self.owner[storage.id] is None and storage.created_at is not None:
                self.owner[storage.id] = self.op_layer[storage.created_at]

    # What must hold for the template block to stand for every copy.

    def _check_blocks_alike(self) -> None:
        b = self.blocks
        for offset in range(b.period):
            layer = b.template + offset
            for other in (layer - b.period, layer + b.period):
                self._check_layers_alike(layer, other)

    def _check_layers_alike(self, layer: int, other: int) -> None:
        ops, other_ops = self.layer_ops.get(layer, []), self.layer_ops.get(other, [])
        if len(ops) != len(other_ops):
            raise NotStampable(f"layers {layer} and {other} run {len(ops)} and {len(other_ops)} ops")
        for index, other_index in zip(ops, other_ops, strict=True):
            op, twin = self.source.ops[index], self.source.ops[other_index]
            if _op_key(op) != _op_key(twin) or self._renamed(op.module, layer, other) != twin.module:
                raise NotStampable(f"layers {layer} and {other} differ at {op.target} in {op.module}")
        ids, other_ids = self.layer_storages.get(layer, []), self.layer_storages.get(other, [])
        if len(ids) != len(other_ids):
            raise NotStampable(f"layers {layer} and {other} hold {len(ids)} and {len(other_ids)} storages")
        for storage_id, other_id in zip(ids, other_ids, strict=True):
            s, twin = self.source.storages[storage_id], self.source.storages[other_id]
            if (
                _storage_key(s) != _storage_key(twin)
                or self._renamed(s.name, layer, other) != twin.name
                or self._renamed(s.param, layer, other) != twin.param
                or self._event_position(s.created_at) != self._event_position(twin.created_at)
            ):
                raise NotStampable(f"layers {layer} and {other} differ in storage {s.name or s.shape}")

    def _event_position(self, index: int | None) -> tuple:
        if index is None:
            return ()
        layer = self.op_layer[index]
        return ("global", index) if layer is None else ("layer", self.op_position[index])

    def _check_nothing_between_layers(self) -> None:
        """An op of no layer next to the template block, inside it or between it and a neighbour, would have to
        run beside every copy."""
        previous: int | None = None
        between = False
        for op in self.source.ops:
            layer = self.op_layer[op.index]
            if layer is None:
                between = previous is not None
                continue
            if between and self._next_to_template(previous, layer):
                raise NotStampable(f"an op of no layer runs between layers {previous} and {layer}")
            previous, between = layer, False

    def _next_to_template(self, layer: int, other: int) -> bool:
        b = self.blocks
        return (b.stamped(layer) or b.stamped(other)) and b.in_chain(layer) and b.in_chain(other)

    def _renamed(self, text: str | None, layer: int, new_layer: int) -> str | None:
        """``text`` as it reads in layer ``new_layer`` when it reads so in ``layer``."""
        if not text or layer == new_layer:
            return text
        key = (text, layer, new_layer)
        if key not in self._renamed_cache:
            at = self.blocks.layer_of(text)
            self._renamed_cache[key] = text if at is None else self.blocks.renamed(text, at + new_layer - layer)
        return self._renamed_cache[key]

    # The stamped step.

    def trace(self) -> Trace:
        order = list(self._op_order())
        self.new_index = {instance: position for position, instance in enumerate(order)}
        storage_order = self._storage_order(order)
        self.new_id = {instance: position for position, instance in enumerate(storage_order)}
        ops = [self._op(instance) for instance in order]
        storages = {self.new_id[i]: self._storage(i) for i in storage_order}
        traffic = {
            self.new_index[(index, 0)]: self._expanded_traffic(moved)
            for index, moved in self.source.optimizer_traffic.items()
            if self.op_layer[index] is None
        }
        for (index, copy), position in self.new_index.items():
            moved = self.source.optimizer_traffic.get(index)
            if moved is not None and self.op_layer[index] is not None:
                refs = self._layer_refs(index, copy, tuple(moved))
                traffic[position] = {self.new_id[ref]: n for ref, n in zip(refs, moved.values(), strict=True)}
        return Trace(
            ops=ops,
            storages=storages,
            assumptions=dict(self.source.assumptions),
            parameter_count=self.source.parameter_count,
            trainable_parameter_count=self.source.trainable_parameter_count,
            structure=self.source.structure,
            optimizer_traffic=traffic,
        )

    def _op_order(self) -> Iterator[Instance]:
        """Traced ops in order, each run of template-block ops followed by its copies (forward, per-parameter
        loops) or preceded by them, last copy first (backward: layers run in reverse)."""
        ops = self.source.ops
        copies = self.blocks.copies
        index, last_other_layer = 0, None
        while index < len(ops):
            layer = self.op_layer[index]
            if layer is None or not self.blocks.stamped(layer):
                if layer is not None:
                    last_other_layer = layer
                yield index, 0
                index += 1
                continue
            end = index
            while end < len(ops) and self.op_layer[end] is not None and self.blocks.stamped(self.op_layer[end]):
                end += 1
            run = range(index, end)
            if last_other_layer is not None and last_other_layer > layer:  # backward
                for copy in range(copies, 0, -1):
                    yield from ((i, copy) for i in run)
                yield from ((i, 0) for i in run)
            else:
                yield from ((i, 0) for i in run)
                for copy in range(1, copies + 1):
                    yield from ((i, copy) for i in run)
            index = end

    def _storage_order(self, order: list[Instance]) -> list[Instance]:
        """Ids as the recorder gives them: storages that existed before the step in the traced order with the
        copies of each run of template-block storages after it, then each storage as an op first names it."""
        existing = [s.id for s in self.source.storages.values() if s.created_at is None]
        result: list[Instance] = []
        run: list[int] = []
        for storage_id in [*existing, None]:
            layer = None if storage_id is None else self.owner[storage_id]
            if layer is not None and self.blocks.stamped(layer):
                run.append(storage_id)
                continue
            result += [(s, 0) for s in run] + [(s, c) for c in range(1, self.blocks.copies + 1) for s in run]
            run = []
            if storage_id is not None:
                result.append((storage_id, 0))
        seen = set(result)
        for instance in order:
            for storage in (*self._refs(instance, inputs=True), *self._refs(instance, inputs=False)):
                if storage not in seen:
                    seen.add(storage)
                    result.append(storage)
        return result

    def _refs(self, instance: Instance, inputs: bool) -> list[Instance]:
        refs = self._ref_cache.get(instance)
        if refs is None:
            refs = self._ref_cache[instance] = (self._resolve_refs(instance, True), self._resolve_refs(instance, False))
        return refs[0] if inputs else refs[1]

    def _resolve_refs(self, instance: Instance, inputs: bool) -> list[Instance]:
        index, copy = instance
        op = self.source.ops[index]
        ids = op.inputs if inputs else op.outputs
        if self.op_layer[index] is not None:
            return self._layer_refs(index, copy, ids)
        if op.phase is not Phase.OPTIMIZER:
            if any(self._stamped_storage(s) for s in ids):
                raise NotStampable(f"{op.target} in {op.module or 'the model'} reads a layer's storage")
            return [(s, 0) for s in ids]
        return list(self._expanded(ids))

    def _expanded(self, ids: tuple[int, ...]) -> Iterator[Instance]:
        """An op over every layer's storages: each run of template-block storages followed by its copies."""
        run: list[int] = []
        for storage_id in [*ids, None]:
            if storage_id is not None and self._stamped_storage(storage_id):
                run.append(storage_id)
                continue
            yield from ((s, 0) for s in run)
            yield from ((s, c) for c in range(1, self.blocks.copies + 1) for s in run)
            run = []
            if storage_id is not None:
                yield storage_id, 0

    def _expanded_traffic(self, moved: dict[int, int]) -> dict[int, int]:
        return {
            self.new_id[(s, c)]: n
            for s, n in moved.items()
            for c in (range(self.blocks.copies + 1) if self._stamped_storage(s) else (0,))
        }

    def _stamped_storage(self, storage_id: int) -> bool:
        layer = self.owner[storage_id]
        return layer is not None and self.blocks.stamped(layer)

    def _layer_refs(self, index: int, copy: int, ids: tuple[int, ...]) -> list[Instance]:
        """The storages copy ``copy`` of a layer op means by the traced ones: each the same distance of layers
        away from the copy as the traced storage is from the traced op. The common case (a storage within a
        block, of the layer the copy reads it from) comes first: this is the stamping's inner loop."""
        b, owner_of = self.blocks, self.owner
        layer = self.op_layer[index]
        shift = b.new_layer(layer, copy) - layer
        refs = []
        for storage_id in ids:
            owner = owner_of[storage_id]
            if owner is None:
                refs.append((storage_id, 0))
                continue
            source_layer, source_copy = b.source(owner + shift)
            if source_layer == owner and abs(owner - layer) <= b.period:
                refs.append((storage_id, source_copy))
            else:
                refs.append(self._at(storage_id, owner, owner + shift, layer, copy))
        return refs

    def _at(self, storage_id: int, owner: int, new_layer: int, layer: int, copy: int) -> Instance:
        return self._twin(storage_id, owner, new_layer, layer, copy, self.layer_storages, self.storage_position)

    def _op_at(self, index: int, new_layer: int, layer: int, copy: int) -> Instance:
        op_layer = self.op_layer[index]
        return self._twin(index, op_layer, new_layer, layer, copy, self.layer_ops, self.op_position)

    def _twin(
        self,
        key: int,
        key_layer: int,
        new_layer: int,
        layer: int,
        copy: int,
        members: dict[int, list[int]],
        positions: dict[int, int],
    ) -> Instance:
        """The op or storage (``key``, of traced layer ``key_layer``) that stands at ``new_layer`` of the whole
        model, as seen from copy ``copy`` of traced layer ``layer``: the one at the same place in the traced layer
        that ``new_layer`` is a copy of."""
        self._check_reach(key_layer, layer, copy)
        source_layer, source_copy = self.blocks.source(new_layer)
        if source_layer == key_layer:
            return key, source_copy
        twins = members.get(source_layer, [])
        position = positions[key]
        if not self.blocks.in_chain(source_layer) or not self.blocks.in_chain(key_layer) or position >= len(twins):
            raise NotStampable(f"layer {layer} reaches layer {key_layer}")
        return twins[position], source_copy

    def _check_reach(self, other: int, layer: int, copy: int) -> None:
        """Layers may reach one block away; further, the copies would reach different layers."""
        b = self.blocks
        if abs(other - layer) > b.period and (copy or b.stamped(layer) or b.stamped(other)):
            raise NotStampable(f"layer {layer} reaches layer {other}")

    def _op(self, instance: Instance) -> Op:
        index, copy = instance
        op = self.source.ops[index]
        layer = self.op_layer[index]
        new_id = self.new_id.__getitem__
        inputs = tuple(map(new_id, self._refs(instance, inputs=True)))
        outputs = tuple(map(new_id, self._refs(instance, inputs=False)))
        changes: dict = {"index": self.new_index[instance], "inputs": inputs, "outputs": outputs}
        if layer is not None:
            changes["module"] = self._renamed(op.module, layer, self.blocks.new_layer(layer, copy))
        elif len(inputs) + len(outputs) > len(op.inputs) + len(op.outputs):  # an op over every layer
            if op.flops:
                raise NotStampable(f"{op.target} counts FLOPs over every layer")
            extra = sum(n for s, n in self.source.optimizer_traffic[op.index].items() if self._stamped_storage(s))
            changes["bytes_moved"] = op.bytes_moved + extra * self.blocks.copies
        return replaced(op, **changes)

    def _storage(self, instance: Instance) -> Storage:
        storage_id, copy = instance
        s = self.source.storages[storage_id]
        owner = self.owner[storage_id]
        if owner is None:
            created, freed = self._global_event(s.created_at), self._global_event(s.freed_after)
            return replaced(s, id=self.new_id[instance], created_at=created, freed_after=freed)
        new_layer = self.blocks.new_layer(owner, copy)
        return replaced(
            s,
            id=self.new_id[instance],
            name=self._renamed(s.name, owner, new_layer),
            param=self._renamed(s.param, owner, new_layer),
            created_at=self._event(s.created_at, owner, new_layer, copy),
            freed_after=self._event(s.freed_after, owner, new_layer, copy),
        )

    def _event(self, index: int | None, owner: int, new_layer: int, copy: int) -> int | None:
        """Where a storage of layer ``owner`` (copy ``copy``, now layer ``new_layer``) is made or freed."""
        if index is None:
            return None
        layer = self.op_layer[index]
        if layer is None:
            return self.new_index[(index, 0)]
        return self.new_index[self._op_at(index, new_layer + layer - owner, owner, copy)]

    def _global_event(self, index: int | None) -> int | None:
        if index is None:
            return None
        layer = self.op_layer[index]
        if layer is not None and self.blocks.stamped(layer):
            raise NotStampable(f"a storage of no layer is made or freed in layer {layer}")
        return self.new_index[(index, 0)]


def _group(owner: dict[int, int | None]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for key, layer in owner.items():
        if layer is not None:
            groups.setdefault(layer, []).append(key)
    return groups


def _positions(groups: dict[int, list[int]]) -> dict[int, int]:
    return {key: position for keys in groups.values() for position, key in enumerate(keys)}


def _op_key(op: Op) -> tuple:
    return (op.target, op.phase, op.recompute, op.flops, op.bytes_moved, len(op.inputs), len(op.outputs))


def _storage_key(s: Storage) -> tuple:
    """What a storage is, apart from how long it lives: the last layer's output lives as the final norm needs it,
    the others' as the next layer does."""
    return (s.nbytes, s.dtype, s.shape, s.on_device)
