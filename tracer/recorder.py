"""A dispatch mode that records one training step as a :class:`~tracer.trace.Trace`.

It sees every aten op below autograd (forward, the autograd engine's backward, the optimizer) and attaches
a weak-reference finalizer to each storage, so a storage's death is recorded when its last reference goes,
exactly as eager execution frees it. The same recorder runs on fake tensors (the estimate) and on real ones
(the CPU measurement, as ``torch.distributed._tools.mem_tracker`` does).
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from tracer.modules import ModuleScope
from tracer.roles import Phase, Role
from tracer.trace import Op, Storage, Trace


class StorageListener(Protocol):
    """Told about each storage as it appears and as it dies, in event order."""

    def allocated(self, storage: Storage) -> None: ...

    def freed(self, storage: Storage) -> None: ...


class Placement(Protocol):
    """Which GPU a storage lives on, where a device map spreads the model over several."""

    def module_device(self, module: str) -> int:
        """The GPU the module runs on, and of what it reads that the recorder has not seen made."""
        ...

    def device_of_new(self, module: str, inputs: list[Storage]) -> int:
        """The GPU of what an op of ``module`` reading ``inputs`` makes."""
        ...


class StepRecorder(TorchDispatchMode):
    def __init__(
        self,
        scope: ModuleScope,
        device_type: str | None = None,
        listener: StorageListener | None = None,
        placement: Placement | None = None,
    ) -> None:
        """``device_type``: count only storages on that device; None counts every storage (the fake
        trace, where a later pass decides what stays on the host). ``placement``: which GPU each new storage is
        on (None: all on one)."""
        super().__init__()
        self.scope = scope
        self.device_type = device_type
        self.listener = listener
        self.placement = placement
        # The GPU of the storages the op being recorded makes; between ops, the GPU generate() keeps its own on
        self._main_device = 0 if placement is None else placement.module_device("")
        self._new_device = self._main_device
        self.phase = Phase.FORWARD
        scope.in_pass = True
        self.ops: list[Op] = []
        self.storages: dict[int, Storage] = {}
        self._live: dict[int, int] = {}  # StorageImpl address -> storage id, for storages alive now
        self._finalizers: dict[int, weakref.ref] = {}
        self._params: dict[str, torch.Tensor] = {}
        self._gradients: dict[int, str] = {}  # storage id of each existing .grad -> its parameter, in backward
        self._paused = False
        self.traffic: dict[int, dict[int, int]] = {}  # optimizer op index -> storage id -> bytes moved
        # The autograd node whose backward runs now (its sequence number), the op it began at, and what its ops read
        self._node: int | None = None
        self._node_start = 0
        self._read_in_node: set[int] = set()
        self._summed_in_node: set[int] = set()  # what the engine's sums under it made

    def track_existing(
        self, tensor: torch.Tensor, role: Role, name: str, param: str | None = None, on_device: bool = True
    ) -> None:
        """Register a storage that exists before the step (parameters, optimizer states, inputs).
        ``param`` names the parameter it belongs to; a parameter belongs to itself."""
        if role is Role.PARAMETER:
            self._params[name] = tensor
            param = name
        storage = self._storage_of(tensor, created_at=None)
        if storage.created_at is None and not storage.name:
            storage.role, storage.name, storage.param = role, name, param
            storage.on_device = storage.on_device and on_device

    def mark(self, tensor: torch.Tensor, role: Role) -> None:
        """Give a storage made during the step a role its producing op cannot tell (a KV cache)."""
        self._storage_of(tensor, created_at=len(self.ops) - 1).role = role

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run ops without recording them (storages they make are unknown until registered with
        ``track_created``; storages they free are freed at the last recorded op)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def restate(self, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Count an existing storage as ``shape`` of ``dtype``: a weight the step reads in 16 bits that the
        GPU holds in its checkpoint's quantized format (tracer/published.py)."""
        storage = self._storage_of(tensor, created_at=None)
        storage.nbytes = math.prod(shape) * dtype.itemsize
        storage.shape, storage.dtype = shape, str(dtype).removeprefix("torch.")

    def track_created(
        self, tensor: torch.Tensor, role: Role, name: str, device: int | None = None, on_device: bool = True
    ) -> None:
        """Register a storage made while paused, as made just before the next recorded op; ``device``: the GPU it
        is on where there are several; ``on_device`` False for host memory."""
        storage = self._storage_of(tensor, created_at=len(self.ops))
        storage.role, storage.name = role, name
        storage.on_device = storage.on_device and on_device
        if device is not None:
            storage.device = device

    def device_of(self, tensor: torch.Tensor) -> int:
        """The GPU a tensor's storage is on (the main one, for a storage the recorder has not seen)."""
        storage_id = self._live.get(tensor.untyped_storage()._cdata)
        return self._main_device if storage_id is None else self.storages[storage_id].device

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor's storage is in device memory (not an offloaded or host copy)."""
        storage_id = self._live.get(tensor.untyped_storage()._cdata)
        return storage_id is None or self.storages[storage_id].on_device

    def place(self, tensor: torch.Tensor, device: int | None = None, on_device: bool = True, name: str = "") -> None:
        """Put a tensor's storage on GPU ``device`` (a copy between GPUs, a parameter a device map places), or in
        host memory (``on_device`` False: an offloaded copy); ``name`` says what made it, for the report."""
        storage = self._storage_of(tensor, created_at=len(self.ops) - 1)
        if device is not None:
            storage.device = device
        storage.on_device = storage.on_device and on_device
        storage.name = name or storage.name

    def enter(self, phase: Phase) -> None:
        """Mark a phase boundary. Storages made in forward and still alive when it ends are saved
        activations; what the parameters hold in ``.grad`` when backward ends are their gradients."""
        if self.phase is Phase.FORWARD and phase is not Phase.FORWARD:
            for storage_id in self._live.values():
                storage = self.storages[storage_id]
                if storage.created_at is not None and storage.role is Role.TEMPORARY:
                    storage.role = Role.ACTIVATION
        if phase is Phase.BACKWARD:
            self._gradients = {
                self._storage_of(param.grad, created_at=len(self.ops) - 1).id: name
                for name, param in self._params.items()
                if param.grad is not None
            }
        if phase is Phase.OPTIMIZER:
            for name, param in self._params.items():
                if param.grad is not None:
                    storage = self._storage_of(param.grad, created_at=len(self.ops) - 1)
                    storage.role, storage.param = Role.GRADIENT, name
        self.phase = phase
        self.scope.in_pass = phase in (Phase.FORWARD, Phase.BACKWARD)

    @contextmanager
    def recording(self) -> Iterator[StepRecorder]:
        """Record the step. The garbage collector is paused so that lifetimes do not depend on its timing;
        storages that die after the step (with the model, once the caller drops it) are not the step's."""
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with self.scope, self:
                yield self
        finally:
            self._finalizers.clear()
            if gc_was_enabled:
                gc.enable()

    def trace(self) -> Trace:
        return Trace(ops=self.ops, storages=self.storages, optimizer_traffic=self.traffic)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except Exception as error:  # named for the user's one-line message (tracing.traced_errors)
            if not hasattr(error, "traced_op"):
                error.traced_op = f"op {func} in {self.scope.current() or 'the model'}"
            raise
        if func.namespace == "prim" or self._paused:  # metadata queries (prim.device, ...), or paused
            return out
        index = len(self.ops)
        read, written = tree_leaves((args, kwargs)), tree_leaves(out)
        if self.placement is not None:
            module = self.scope.current()
            self._new_device = self.placement.module_device(module)
        inputs = self._ids(read, index)
        if self.placement is not None:
            self._new_device = self.placement.device_of_new(module, [self.storages[i] for i in inputs])
        outputs = self._ids(written, index)
        self._new_device = self._main_device
        if self.phase is Phase.OPTIMIZER:
            self._inherit_lineage(func, args, out, index)
        elif self._gradients and func is torch.ops.aten.add_.Tensor and inputs[0] in self._gradients:
            self._mark_accumulated(inputs)
        recompute = self.phase is Phase.BACKWARD and self.scope.running_forward()
        sums = (
            self.phase is Phase.BACKWARD
            and not recompute
            and self._sums_gradients(func, args, out, inputs, outputs, index)
        )
        flops = _flops(func, args, kwargs or {}, out)
        moved = _moved(func, read, written, args)
        if self.phase is Phase.OPTIMIZER:
            self.traffic[index] = self._traffic(moved, index)
        self.ops.append(
            Op(
                index,
                str(func),
                self.scope.current(),
                self.phase,
                inputs,
                outputs,
                recompute,
                flops=flops,
                bytes_moved=sum(tensor.nbytes for tensor in moved),
                sums_gradients=sums,
            )
        )
        return out

    def _sums_gradients(self, func, args, out, inputs: tuple[int, ...], outputs: tuple[int, ...], index: int) -> bool:
        """Whether the op is the autograd engine adding a gradient into another gradient of the same tensor
        (``InputBuffer::accumulate``: ``old_var + var``) whose first operand a plain run would reuse for the sum.

        The engine adds after the node that made the new gradient has returned, under that node: so the first
        operand, the gradient held in the input buffer, was made before the node began (or by the node's previous sum
        into the same buffer, where two of its outputs flow there), and none of the node's ops read it. A plain run
        adds in place (``old_var.add_(var)``) when it holds the last reference to that gradient and its storage, and
        the gradient is dense and no view (a view holds its base's storage too): whether the reference is the last
        is the trace's to tell (tracer/gradient_sums.py)."""
        node = torch._C._current_autograd_node()
        key = None if node is None else node._sequence_nr()
        if key != self._node:
            self._node, self._node_start, self._read_in_node, self._summed_in_node = key, index, set(), set()
        engine_sum = (
            func is torch.ops.aten.add.Tensor
            and node is not None
            and len(inputs) == 2
            and len(args) == 2
            and isinstance(args[1], torch.Tensor)
            and args[0].shape == args[1].shape == out.shape
            and args[0].dtype == args[1].dtype
            and self._buffered(inputs[0])
        )
        self._read_in_node.update(inputs)
        if not engine_sum:
            return False
        self._summed_in_node.update(outputs)
        held = args[0]
        return not held._is_view() and _dense(held)

    def _buffered(self, storage_id: int) -> bool:
        """Whether the storage could be a gradient the engine holds in an input buffer for the running node's sum."""
        created_at = self.storages[storage_id].created_at
        made_before = created_at is None or created_at < self._node_start
        return (made_before or storage_id in self._summed_in_node) and storage_id not in self._read_in_node

    def _traffic(self, moved: list[torch.Tensor], index: int) -> dict[int, int]:
        by_storage: dict[int, int] = {}
        for tensor in moved:
            storage_id = self._storage_of(tensor, created_at=index).id
            by_storage[storage_id] = by_storage.get(storage_id, 0) + tensor.nbytes
        return by_storage

    def _mark_accumulated(self, inputs: tuple[int, ...]) -> None:
        """A later micro-step's gradient, which autograd adds into the existing ``.grad``
        (``AccumulateGrad``: ``variable_grad += new_grad``), belongs to that gradient's parameter: runtimes
        that take each micro-step's gradients away (FSDP's reduce-scatter) hold it instead."""
        if len(inputs) > 1 and self.storages[inputs[1]].param is None:
            self.storages[inputs[1]].param = self._gradients[inputs[0]]

    def _inherit_lineage(self, func, args, out, index: int) -> None:
        """Give storages an optimizer op creates the parameter of the input they derive from: element k of
        a ``_foreach_`` op's output list from element k of its first list argument, otherwise the first
        input that belongs to a parameter."""
        created = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func.__name__.startswith("_foreach_") and args and isinstance(args[0], list | tuple):
            sources = [[t] for t in args[0]]
        else:
            sources = [[t for t in tree_leaves((args,)) if isinstance(t, torch.Tensor)]] * len(created)
        for tensor, candidates in zip(created, sources, strict=False):
            storage = self._storage_of(tensor, created_at=index)
            if storage.created_at != index or storage.param is not None:
                continue
            parents = (self._storage_of(c, created_at=index).param for c in candidates)
            storage.param = next((p for p in parents if p is not None), None)

    def _ids(self, leaves: list, index: int) -> tuple[int, ...]:
        ids: list[int] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                storage_id = self._storage_of(leaf, created_at=index).id
                if storage_id not in ids:
                    ids.append(storage_id)
        return tuple(ids)

    def _storage_of(self, tensor: torch.Tensor, created_at: int | None) -> Storage:
        untyped = tensor.untyped_storage()
        address = untyped._cdata
        storage_id = self._live.get(address)
        if storage_id is not None:
            return self.storages[storage_id]
        storage_id = len(self.storages)
        storage = Storage(
            id=storage_id,
            nbytes=untyped.nbytes(),
            dtype=str(tensor.dtype).removeprefix("torch."),
            shape=tuple(tensor.shape),
            role=Role.TEMPORARY,
            created_at=created_at,
            freed_after=None,
            on_device=self.device_type is None or tensor.device.type == self.device_type,
            device=self._new_device,
        )
        self.storages[storage_id] = storage
        self._live[address] = storage_id
        self._finalizers[storage_id] = weakref.ref(untyped, self._freed(address, storage))
        if self.listener is not None:
            self.listener.allocated(storage)
        return storage

    def _freed(self, address: int, storage: Storage):
        def callback(_: weakref.ref) -> None:
            storage.freed_after = len(self.ops) - 1
            if self._live.get(address) == storage.id:
                del self._live[address]
            self._finalizers.pop(storage.id, None)
            if self.listener is not None:
                self.listener.freed(storage)

        return callback


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the tensor's elements fill its storage span without gaps or overlaps, in some order of its dimensions
    (``is_non_overlapping_and_dense``)."""
    expected = 1
    for stride, size in sorted(
        (stride, size) for size, stride in zip(tensor.shape, tensor.stride(), strict=True) if size != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _flops(func, args, kwargs, out) -> int:
    """The op's floating-point operations by torch's flop formulas. Before torch 2.13 the attention formulas
    asserted that key and value have the query's heads, which grouped-query attention's kernels (enable_gqa)
    do not: they are counted as the kernel broadcasts them, with the query's heads, as torch 2.13 counts them."""
    count = flop_registry.get(func._overloadpacket)
    if count is None:
        return 0
    try:
        return count(*args, **kwargs, out_val=out)
    except AssertionError:
        return count(*_with_query_heads(args), **kwargs, out_val=out)


def _with_query_heads(args: tuple) -> tuple:
    """Attention's arguments with every 4-D tensor of fewer heads than the first (the query, or in backward the
    output's gradient) replaced by a shape-only stand-in with the first's heads."""
    first = args[0]
    batch, heads = first.shape[:2]

    def broadcast(arg):
        if not isinstance(arg, torch.Tensor) or arg.dim() != 4 or arg.shape[0] != batch:
            return arg
        if arg.shape[1] >= heads or heads % arg.shape[1]:
            return arg
        return torch.empty((batch, heads, *arg.shape[2:]), device="meta")

    return tuple(broadcast(arg) for arg in args)


def _moved(func, read: list, written: list, args: tuple) -> list[torch.Tensor]:
    """The tensors an op reads and writes, whose bytes are its memory traffic: its tensor arguments, and its
    outputs or, for an in-place op that returns nothing (``_foreach_add_``), its first argument again.
    Views move nothing."""
    if func.is_view:
        return []
    if not any(isinstance(leaf, torch.Tensor) for leaf in written) and func._schema.is_mutable and args:
        written = tree_leaves(args[0])
    return [leaf for leaf in (*read, *written) if isinstance(leaf, torch.Tensor)]
