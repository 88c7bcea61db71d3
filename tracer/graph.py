"""The recorded step as a graph: ops in execution order joined by the storages they pass, plus the
storage table the memory passes read (exact bytes, role, producer, users, module).

Sizes are what the tensors need, as observed; how an allocator would round them is the passes' business
(``analysis/liveness.py``), not the graph's."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import networkx as nx

from tracer.roles import Phase, Role
from tracer.trace import ModelStructure, Op, Trace


@dataclass(frozen=True)
class StorageRow:
    id: int
    nbytes: int  # what the tensors in it need
    dtype: str
    shape: tuple[int, ...]
    role: Role
    producer: int | None  # op index that allocated it; None if it existed before the step
    freed_after: int | None  # op index after which it died; None if it outlives the step
    users: tuple[int, ...]  # op indices that read it
    module: str  # module of the producer
    on_device: bool
    name: str
    param: str | None = None  # the parameter this is, or is the gradient, state or optimizer temporary of
    # The CUDA stream a runtime allocates it on ("": the compute stream). The caching allocator keeps a freed
    # block for allocations on the stream it was allocated on, so each stream's blocks form a pool of their own.
    stream: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def replaced(frozen, **changes):
    """``dataclasses.replace`` for rows and ops, without re-running ``__init__``: transforms copy every row and
    op of a step, and ``replace`` was most of the time spent evaluating a layout."""
    copy = object.__new__(type(frozen))
    object.__setattr__(copy, "__dict__", frozen.__dict__ | changes)  # a third faster than updating ``__dict__``
    return copy


HOST_TO_DEVICE = "host to device"
DEVICE_TO_HOST = "device to host"


@dataclass(frozen=True)
class Transfer:
    """Bytes a strategy moves between host and device memory in one step (offloading)."""

    phase: Phase
    direction: str  # HOST_TO_DEVICE or DEVICE_TO_HOST
    nbytes: int
    what: str
    overlaps: str  # what the copy can run alongside, or "" if the step waits for it


ALL_REDUCE = "all-reduce"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_TO_ALL = "all-to-all"
RING_PASS = "ring pass"  # each rank sends its buffer to the next: context parallelism's key/value gradients
DATA_PARALLEL = "data parallel"
TENSOR_PARALLEL = "tensor parallel"
EXPERT_PARALLEL = "expert parallel"
CONTEXT_PARALLEL = "context parallel"


@dataclass(frozen=True)
class Collective:
    """A collective a strategy's runtime issues in one step. ``nbytes`` is the whole tensor the group reduces
    or gathers (each rank moves a ring fraction of it); for ALL_TO_ALL, the rows this rank sends, its share for
    itself included (the rank receives as many from the others where the routing is balanced). The step time sums
    these records."""

    kind: str  # ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL or RING_PASS
    group: str  # DATA_PARALLEL, TENSOR_PARALLEL, EXPERT_PARALLEL or CONTEXT_PARALLEL
    nbytes: int
    phase: Phase
    every_micro_step: bool  # False: once per optimizer step (DDP reduces only in the last micro-step's backward)
    overlapped: bool  # runs alongside its phase's compute (bucketed or prefetched), else the step waits for it
    what: str


class PipelinePass(NamedTuple):
    stage: int
    microbatch: int
    phase: Phase  # FORWARD or BACKWARD
    ops: range


@dataclass
class StepGraph:
    """One recorded step, the unit every layer passes on: its ops in execution order, the storages they make,
    read and free (exact bytes, role, lifetime), the model's structure (decoder blocks, embeddings), and the
    host transfers and collectives a strategy adds. Strategies return the StepGraph of one rank; analysis
    passes read it."""

    ops: list[Op]
    storages: dict[int, StorageRow]
    structure: ModelStructure = field(default_factory=ModelStructure)
    transfers: list[Transfer] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    # For a step a rewrite made (strategies/rewrite.py): the index here of each op of the step it was rewritten
    # from, whose storages keep their ids; None for any other step.
    rewritten_ops: tuple[int, ...] | None = None

    def made_in(self, row: StorageRow, phase: Phase) -> bool:
        """Whether the storage was created by an op of ``phase`` (False if it existed before the step)."""
        return row.producer is not None and self.ops[row.producer].phase is phase

    def micro_steps(self) -> list[range]:
        """The ops of each forward and backward pass (one per micro-step of gradient accumulation; the
        optimizer's ops are in the last range): a micro-step begins where a forward op follows a backward one."""
        starts = [0] + [
            op.index
            for previous, op in zip(self.ops, self.ops[1:], strict=False)
            if previous.phase is Phase.BACKWARD and op.phase is Phase.FORWARD
        ]
        ends = [*starts[1:], len(self.ops)]
        return [range(start, end) for start, end in zip(starts, ends, strict=True)]

    def pipeline_passes(self) -> list[PipelinePass]:
        """The forward and backward passes of a pipeline stage's step, in the order they run (empty for any
        other step). Ops a later transform inserts into a pass belong to it."""
        passes: list[PipelinePass] = []
        for op in self.ops:
            if op.pipeline_pass is None:
                continue
            stage, microbatch = op.pipeline_pass
            last = passes[-1] if passes else None
            if last is not None and (last.stage, last.microbatch, last.phase) == (stage, microbatch, op.phase):
                passes[-1] = last._replace(ops=range(last.ops.start, op.index + 1))
            else:
                passes.append(PipelinePass(stage, microbatch, op.phase, range(op.index, op.index + 1)))
        return passes

    @cached_property
    def graph(self) -> nx.DiGraph:
        """Node = op index; edge producer -> consumer, with the storage ids it passes. Built when first asked
        for: the memory passes read the storage table, and transforms would otherwise rebuild it each time."""
        graph = nx.DiGraph()
        for op in self.ops:
            graph.add_node(op.index, target=op.target, module=op.module, phase=op.phase.value)
        for row in self.storages.values():
            for user in row.users:
                if row.producer is None or row.producer == user:
                    continue
                if graph.has_edge(row.producer, user):
                    graph.edges[row.producer, user]["storages"].append(row.id)
                else:
                    graph.add_edge(row.producer, user, storages=[row.id])
        return graph


def build_graph(trace: Trace) -> StepGraph:
    users: dict[int, list[int]] = defaultdict(list)
    for op in trace.ops:
        for storage_id in op.inputs:
            users[storage_id].append(op.index)
    rows = {}
    for storage in trace.storages.values():
        producer = storage.created_at
        rows[storage.id] = StorageRow(
            id=storage.id,
            nbytes=storage.nbytes,
            dtype=storage.dtype,
            shape=storage.shape,
            role=storage.role,
            producer=producer,
            freed_after=storage.freed_after,
            users=tuple(users.get(storage.id, ())),
            module=trace.ops[producer].module if producer is not None else "",
            on_device=storage.on_device,
            name=storage.name,
            param=storage.param,
        )
    return StepGraph(ops=trace.ops, storages=rows, structure=trace.structure)
