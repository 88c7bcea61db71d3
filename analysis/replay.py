"""The step's allocations and frees fed to the caching allocator model, as a user's loop feeds the real one.

A measurement runs a warm-up step, resets the peak statistics, and runs the step it reports; the allocator
keeps every segment the warm-up reserved. The replay does the same with the one recorded step:

* warm-up: parameters, buffers and inputs are allocated first (the model and batch exist before training);
  the optimizer states are allocated together just before the first op that reads any of them, parameter by
  parameter (``exp_avg`` then ``exp_avg_sq`` for each, the order of their rows), as torch's optimizers create
  them in their first step (``Adam._init_group``; SGD's momentum buffers at their first use, all in one place
  under foreach); every other storage that exists before the recorded step just before the first op that reads
  it; each cuBLAS workspace right after the first matmul its thread runs (see ``workspace_first_use``); then
  the step's own allocations and frees, op by op;
* measured step: the same ops again, on the allocator state the warm-up left.

Within an op, its new storages are allocated (in creation order) before the storages whose last use it was
are freed: the same moment the op-level timeline counts (analysis/peak.py). A gradient sum made in place
(tracer/gradient_sums.py) allocates and frees nothing: it takes over its buffered gradient's block, as ``add_``
writes into it.

A ``generate()`` whose decode steps run as CUDA graphs (``compiled``, analysis/cudagraphs.py) does, in the
warm-up only, what the process's first generate() did: ``empty_cache`` where the compiled call starts, the cuBLAS
workspace moved into the graphs' private pool for the call, the autotuner's buffers beside each op of it, and
``empty_cache`` again for the recording. The compiled call's storages are allocated in that pool in both passes
(a replay reuses the blocks its recording left; the measured step's graph replays allocate nothing more).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat

from analysis.allocator import AllocatorConfig, Block, CachingAllocator, Segment
from analysis.cudagraphs import CUDA_GRAPH_POOL, CompiledDecode, compiled_span, writes_in_place
from analysis.liveness import holds_memory
from tracer.gradient_sums import hands_over
from tracer.graph import StepGraph, StorageRow
from tracer.roles import Phase, Role

DEFAULT_CONFIG = AllocatorConfig()
EXISTS_BEFORE_TRAINING = (Role.PARAMETER, Role.BUFFER, Role.INPUT)
# Ops whose CUDA kernels are cuBLAS (or cuBLASLt) calls, which take the calling thread's workspace
# (aten/src/ATen/native/cuda/Blas.cpp: mm, addmm, bmm, baddbmm, addmv, dot, _scaled_mm, _int_mm).
CUBLAS_OPS = frozenset(
    f"aten.{name}"
    for name in [
        "mm",
        "addmm",
        "_addmm_activation",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_scaled_mm",
        "_int_mm",
    ]
)

# Called at every allocation and free of the measured step: (op index, storage id, block, allocated?); first
# with op index -1 for each block live when the measured step starts.
Observer = Callable[[int, int, Block, bool], None]


@dataclass(frozen=True)
class AllocatorReplay:
    allocated_at: list[int]  # allocated bytes at each op of the measured step, after its allocations
    peak_allocated: int  # max_memory_allocated of the measured step
    peak_allocated_op: int
    peak_reserved: int  # max_memory_reserved: the warm-up's segments stay reserved
    retries: int  # times the measured step's cudaMalloc failed, released the cached segments and retried
    segments: list[Segment]  # cudaMalloc'd segments (or expandable ones) at the end, with their blocks


def replay_step(
    step: StepGraph,
    config: AllocatorConfig = DEFAULT_CONFIG,
    observer: Observer | None = None,
    compiled: CompiledDecode | None = None,
) -> AllocatorReplay:
    """Replay a warm-up step and the measured step through the caching allocator model; ``compiled``: the decode
    step runs as CUDA graphs (analysis/cudagraphs.py)."""
    allocator = CachingAllocator(config)
    sizes = {
        row.id: row.nbytes for row in step.storages.values() if row.on_device and row.nbytes > 0 and holds_memory(row)
    }
    streams: dict[str, int] = {"": 0}  # the compute stream first, then side streams as they appear
    stream_of = {}
    for storage_id in sizes:
        stream_of[storage_id] = streams.setdefault(step.storages[storage_id].stream, len(streams))
    span = compiled_span(step) if compiled is not None else None
    graphs = CudaGraphWarmUp(step, span, compiled, streams.setdefault(CUDA_GRAPH_POOL, len(streams))) if span else None
    if graphs is not None:
        for storage_id in sizes:
            if step.storages[storage_id].producer in span:
                stream_of[storage_id] = graphs.pool
    created: dict[int, list[int]] = defaultdict(list)
    released: dict[int, list[int]] = defaultdict(list)
    first_use: dict[int, list[int]] = defaultdict(list)
    before: list[int] = []
    after_op = workspace_first_use(step, [s for s in sorted(sizes) if step.storages[s].role is Role.WORKSPACE])
    late = {storage_id for ids in after_op.values() for storage_id in ids}
    states_made_at = min(
        (min(row.users) for row in step.storages.values() if _made_in_first_step(row, sizes)), default=None
    )
    for storage_id in sorted(sizes):
        row = step.storages[storage_id]
        if storage_id in late:
            pass
        elif row.producer is None:
            if row.role in EXISTS_BEFORE_TRAINING or not row.users:
                before.append(storage_id)
            elif row.role is Role.OPTIMIZER_STATE:
                first_use[states_made_at].append(storage_id)
            else:
                first_use[min(row.users)].append(storage_id)
        else:
            created[row.producer].append(storage_id)
        if row.freed_after is not None:
            released[row.freed_after].append(storage_id)
    takes_over = _sums_in_place(step, sizes)
    for buffered in takes_over.values():
        released[step.storages[buffered].freed_after].remove(buffered)

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
    # Each op's allocations (first uses, creations, workspaces: those not live yet) and frees, in one table: the
    # replay visits only the ops that have any, or that a compiled call's warm-up runs.
    schedule = {
        index: (first_use.get(index, ()), created.get(index, ()), after_op.get(index, ()), released.get(index, ()))
        for index in sorted(first_use.keys() | created.keys() | after_op.keys() | released.keys())
    }
    visited = sorted(schedule.keys() | set(graphs.span)) if graphs is not None else list(schedule)
    nothing = ((), (), (), ())
    allocated_at: list[int] = []
    for measured in (False, True):
        if measured:
            # existed before the step, freed in the warm-up's (a workspace comes back at its first matmul)
            present = live.keys() | late
            for storage_id in [s for s in sizes if step.storages[s].producer is None and s not in present]:
                allocate(storage_id, 0, measured=False)
            allocator.reset_peak()
            if observer is not None:
                for storage_id, block in live.items():
                    observer(-1, storage_id, block, True)
        for index in visited:
            used, made, after, freed = schedule.get(index, nothing)
            if measured:  # the ops since the last visited one, which allocate and free nothing, held what it left
                allocated_at.extend(repeat(allocator.allocated, index - len(allocated_at)))
            warming_up = graphs is not None and not measured and index in graphs.span
            if warming_up and index == graphs.span.start:
                graphs.start(allocator, [s for s in live if step.storages[s].role is Role.WORKSPACE], release)
            for storage_id in used:
                if storage_id not in live:
                    allocate(storage_id, index, measured)
            for storage_id in made:
                if storage_id in takes_over:
                    live[storage_id] = live.pop(takes_over[storage_id])
                else:
                    allocate(storage_id, index, measured)
            for storage_id in after:
                if storage_id not in live:
                    allocate(storage_id, index, measured)
            if warming_up:
                graphs.launch(allocator, step.ops[index])
            if measured:
                allocated_at.append(allocator.allocated)
            for storage_id in freed:
                release(storage_id, index, measured)
            if warming_up and index == graphs.span.stop - 1:
                graphs.stop(allocator)
        if graphs is not None and not measured:  # the recording's torch.cuda.graph empties the cache again
            allocator.empty_cache(keep_streams=frozenset({graphs.pool}))
        if not measured:  # what the warm-up made that outlives it is replaced by the next step's
            for storage_id in [s for s in live if step.storages[s].producer is not None]:
                release(storage_id, len(step.ops), measured=False)
    allocated_at.extend(repeat(allocator.allocated, len(step.ops) - len(allocated_at)))
    peak_op = max(range(len(allocated_at)), key=allocated_at.__getitem__) if allocated_at else 0
    return AllocatorReplay(
        allocated_at=allocated_at,
        peak_allocated=allocator.peak_allocated,
        peak_allocated_op=peak_op,
        peak_reserved=allocator.peak_reserved,
        retries=allocator.retries,
        segments=list(allocator.segments),
    )


def _sums_in_place(step: StepGraph, sizes: dict[int, int]) -> dict[int, int]:
    """Each gradient sum made in place, by the storage it makes: the buffered gradient whose block it takes over."""
    return {
        op.outputs[0]: op.inputs[0]
        for op in step.ops
        if op.sums_gradients  # the cheap test first: this runs over every op of every replay
        and hands_over(op, step.storages)
        and sizes.get(op.outputs[0], 0) == sizes.get(op.inputs[0])
    }


def _made_in_first_step(row: StorageRow, sizes: dict[int, int]) -> bool:
    """An optimizer state the first step creates: on the device, read in the step, made by none of its ops."""
    return row.role is Role.OPTIMIZER_STATE and row.producer is None and bool(row.users) and row.id in sizes


class CudaGraphWarmUp:
    """The process's first compiled decode call, as cudagraph_trees.py runs it (analysis/cudagraphs.py)."""

    def __init__(self, step: StepGraph, span: range, compiled: CompiledDecode, pool: int) -> None:
        self.step, self.span, self.compiled, self.pool = step, span, compiled, pool
        self.workspace_bytes: list[int] = []
        self.workspaces: list[Block] = []

    def start(self, allocator: CachingAllocator, workspaces: list[int], release) -> None:
        """The tree manager's empty capture empties the cache; ``clear_cublas_manager`` frees the workspace."""
        allocator.empty_cache()
        for storage_id in workspaces:
            self.workspace_bytes.append(self.step.storages[storage_id].nbytes)
            release(storage_id, self.span.start, False)

    def launch(self, allocator: CachingAllocator, op) -> None:
        """The op's kernel: its first matmul takes a cuBLAS workspace in the pool (inductor calls cuBLAS for
        matmuls outside max-autotune, ``tuned_mm``); any other kernel may autotune, with a copy of what it writes in
        place and the L2 flush buffer live."""
        if op.target.rpartition(".")[0] in CUBLAS_OPS:  # an extern cuBLAS call: no autotuning without max-autotune
            if self.workspace_bytes:
                self.workspaces = [allocator.malloc(nbytes, self.pool) for nbytes in self.workspace_bytes]
                self.workspace_bytes = []
            return
        clones = []
        if writes_in_place(op.target):
            written = [s for s in op.outputs if s in op.inputs and self.step.storages[s].on_device]
            clones = [allocator.malloc(self.step.storages[s].nbytes, self.pool) for s in written]
        if self.compiled.l2_cache_bytes:
            allocator.free(allocator.malloc(self.compiled.l2_cache_bytes, self.pool))
        for block in clones:
            if block is not None:
                allocator.free(block)

    def stop(self, allocator: CachingAllocator) -> None:
        """``clear_cublas_manager`` frees the pool's workspace as the call returns; the eager code's next matmul
        (the next prefill) takes a new one."""
        for block in self.workspaces:
            if block is not None:
                allocator.free(block)
        self.workspaces = []


def workspace_first_use(step: StepGraph, workspaces: list[int]) -> dict[int, list[int]]:
    """The op after whose outputs each cuBLAS workspace is allocated: the first cuBLAS op its thread runs.

    A cuBLAS handle is per thread and gets its workspace from the caching allocator the first time a matmul on
    that thread asks for it (``getCurrentCUDABlasHandle`` and ``getCUDABlasLtWorkspace`` in
    aten/src/ATen/cuda/CublasHandlePool.cpp), inside the kernel call, after the op allocated its output. The
    tracer tracks a training step's two (tracer/tracing.py: per GPU, the caller's thread, then the autograd
    engine's, which runs the backward) and one for inference. So in a process that starts with the model, the
    caller's workspace is allocated by the warm-up's first forward matmul and the autograd thread's by its first
    backward matmul, not before the step: on an H200 (benchmarks/ground_truth/data/nvidia-h200) the LoRA steps'
    reserved peaks were 4 to 12 % under the measured ones with both allocated up front, as the activations
    then packed into other segments. A workspace whose thread runs no cuBLAS op here (or a device map's, whose
    ops the step does not tell apart by GPU) stays allocated before the step."""
    if not workspaces:
        return {}
    backward = any(op.phase is Phase.BACKWARD for op in step.ops)
    threads = 2 if backward and len(workspaces) == 2 else 1
    if len(workspaces) != threads:
        return {}
    first: dict[int, list[int]] = defaultdict(list)
    for thread, storage_id in enumerate(workspaces):
        index = next(
            (
                op.index
                for op in step.ops
                if op.target.rpartition(".")[0] in CUBLAS_OPS and (op.phase is Phase.BACKWARD) == (thread == 1)
            ),
            None,
        )
        if index is not None:
            first[index].append(storage_id)
    return first
