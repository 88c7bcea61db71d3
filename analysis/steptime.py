"""How long one optimizer step takes on a layout: a roofline per op of the traced step, plus the layout's
collectives over its links, overlapped where its runtime overlaps them.

Compute: every op takes ``max(flops / (peak x COMPUTE_EFFICIENCY), bytes / (bandwidth x MEMORY_EFFICIENCY))``
with its FLOPs and bytes read and written as the trace recorded them; tensor parallelism divides forward and
backward by its degree, a ZeRO stage divides the optimizer by the data-parallel degree.

Communication, in NCCL's bus-bandwidth terms (nccl-tests' PERFORMANCE.md): an all-reduce of S bytes over n
GPUs moves 2(n-1)/n x S through each GPU's link, an all-gather or reduce-scatter (n-1)/n x S; a link carries
NETWORK_EFFICIENCY of its datasheet bandwidth. A group inside one node uses the GPU's interconnect, one that
spans nodes the per-GPU network (``internode_gbps``). Overlapped communication costs
``max(compute, comm) + comm / units``: the first gather or the last reduction of ``units`` layers waits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from strategies.collectives import ring_exchanges
from strategies.layout import Layout, Rank
from strategies.pipeline import BACKWARD, FORWARD, RECEIVE_BUFFER, schedule_actions
from tracer.gpus import PCIE_4_X16_GBPS, Gpu
from tracer.graph import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    EXPERT_PARALLEL,
    REDUCE_SCATTER,
    RING_PASS,
    TENSOR_PARALLEL,
    Collective,
    StepGraph,
)
from tracer.modules import enclosing_block
from tracer.roles import Phase
from tracer.trace import Op

# Share of peak tensor-core FLOP/s that large matmuls and flash attention reach in training. Llama 3 trained
# at 38-43% model FLOPs utilisation end to end on H100 in BF16, communication and everything else included
# ("The Llama 3 Herd of Models", arXiv 2407.21783, Table 4); the matmuls alone run faster than that.
COMPUTE_EFFICIENCY = 0.6
# Share of peak memory bandwidth that elementwise kernels, norms and the optimizer reach (streaming kernels
# typically sustain 80-90% of HBM bandwidth).
MEMORY_EFFICIENCY = 0.8
# Share of a link's datasheet bandwidth that NCCL's bus bandwidth reaches on large messages (nccl-tests on
# NVLink and InfiniBand systems report 75-90%).
NETWORK_EFFICIENCY = 0.8
# Per-GPU network between nodes, one direction, GB/s: one 400 Gb/s InfiniBand NDR or Ethernet NIC per GPU,
# as in DGX H100 and HGX systems.
INTERNODE_GBPS = 50.0
GPUS_PER_NODE = 8
# Host memory bandwidth an offloaded optimizer step (DeepSpeed's CPUAdam) streams its states at, GB/s. An
# assumption, not a measurement: a two-socket server has 300-600 GB/s of DRAM bandwidth, and a vectorised
# Adam step reaches a fraction of it.
HOST_OPTIMIZER_GBPS = 100.0


@dataclass(frozen=True)
class Cluster:
    """The machines a plan runs on."""

    gpu: Gpu
    gpus_per_node: int = GPUS_PER_NODE
    internode_gbps: float = INTERNODE_GBPS
    pcie_gbps: float = PCIE_4_X16_GBPS
    host_optimizer_gbps: float = HOST_OPTIMIZER_GBPS

    def group_bytes_per_second(self, size: int, stride: int) -> float:
        """Bus bandwidth of a group of ``size`` ranks ``stride`` apart (tensor-parallel groups are adjacent)."""
        within_node = size * stride <= self.gpus_per_node
        gbps = self.gpu.interconnect_gbps if within_node else min(self.gpu.interconnect_gbps, self.internode_gbps)
        return gbps * 1e9 * NETWORK_EFFICIENCY


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step of ``micro_steps`` micro-batches, and where they go."""

    forward_s: float  # per micro-step
    backward_s: float  # per micro-step, recomputation included
    optimizer_s: float
    communication_s: float  # all collectives of the step
    exposed_communication_s: float  # what compute does not hide
    host_transfer_s: float  # offloading's copies the step waits for
    micro_steps: int
    total_s: float
    pipeline_bubble_s: float = 0.0  # the busiest stage idle, waiting on the others (pipeline parallelism)

    def to_json(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def step_time(step: StepGraph, layout: Layout, cluster: Cluster, compute_dtype: str, micro_steps: int) -> StepTime:
    """``step``: the busiest rank's step (its ops, the collectives its runtimes issue, its host transfers)."""
    gpu = cluster.gpu
    passes = step.micro_steps()
    phases = _phase_seconds(step, passes, gpu, compute_dtype, micro_steps)
    forward = phases[Phase.FORWARD] / layout.tp / micro_steps
    backward = phases[Phase.BACKWARD] / layout.tp / micro_steps
    optimizer = phases[Phase.OPTIMIZER] / layout.tp / (layout.replicas if layout.zero else 1)
    if layout.offload:
        optimizer = _optimizer_bytes(step) / layout.tp / layout.replicas / (cluster.host_optimizer_gbps * 1e9)

    # Seconds of the collectives that overlap forward or backward, every micro-step or only the last one's
    # (DDP reduces under no_sync until then), and of those the step waits for.
    hidden = {(phase, every): 0.0 for phase in (Phase.FORWARD, Phase.BACKWARD) for every in (True, False)}
    waited = {True: 0.0, False: 0.0}
    communication = 0.0
    for collective in step.collectives:
        seconds = _collective_seconds(collective, layout, cluster)
        communication += seconds * (micro_steps if collective.every_micro_step else 1)
        if collective.overlapped and collective.phase in (Phase.FORWARD, Phase.BACKWARD):
            hidden[collective.phase, collective.every_micro_step] += seconds
        else:
            waited[collective.every_micro_step] += seconds

    units = max(len(step.structure.blocks), 1)
    micro_forward = _overlapped(forward, hidden[Phase.FORWARD, True], units)
    micro_backward = _overlapped(backward, hidden[Phase.BACKWARD, True], units)
    once = waited[False]
    for phase, compute in ((Phase.FORWARD, micro_forward), (Phase.BACKWARD, micro_backward)):
        if hidden[phase, False]:
            once += _overlapped(compute, hidden[phase, False], units) - compute

    phase_seconds = {Phase.FORWARD: forward, Phase.BACKWARD: backward}
    host_micro, host_once = _exposed_transfers(step, cluster, phase_seconds, len(passes))
    host = micro_steps * host_micro + host_once
    total = micro_steps * (micro_forward + micro_backward + waited[True]) + optimizer + once + host
    compute = micro_steps * (forward + backward) + optimizer
    exposed = total - compute - host
    return StepTime(forward, backward, optimizer, communication, exposed, host, micro_steps, total)


def pipeline_step_time(stages: list[StepGraph], layout: Layout, cluster: Cluster, compute_dtype: str) -> StepTime:
    """One step of a pipeline (``stages``: each pipeline rank's step, data- and tensor-parallel rank 0): every
    forward and backward of a microbatch through a stage takes its pass's roofline time (tensor parallelism
    dividing it, its all-reduces and context parallelism's ring exchanges waited for), in the order the rank's
    schedule runs them, each starting once the
    previous stage's activations (or the next stage's gradients) have arrived over the pipeline's link; the bubble
    is the idle time this leaves. The optimizer steps and the data-parallel reductions follow the last backward
    (FSDP2 and DDP reduce a pipeline rank's gradients once per step), the busiest rank's counting."""
    gpu = cluster.gpu
    link = cluster.group_bytes_per_second(layout.pp, layout.replicas * layout.tp)
    durations: list[dict[tuple[str, int, int], float]] = []
    sends: list[float] = []
    passes_per_microbatch = 2 * layout.stages_per_rank  # each stage's forward and backward share the all-reduces
    for rank, step in enumerate(stages):
        tp_all_reduce = sum(
            _collective_seconds(c, layout, cluster) for c in step.collectives if c.group == TENSOR_PARALLEL
        )
        step_passes = step.pipeline_passes()
        # the rank's own stages, in the order of the step's (a rank's step may stand in for another's)
        own = dict(zip(sorted({p.stage for p in step_passes}), layout.rank_stages(Rank(pp=rank)), strict=True))
        passes = {}
        for stage_pass in step_passes:
            compute = _ops_seconds(step.ops[stage_pass.ops.start : stage_pass.ops.stop], gpu, compute_dtype)
            kind = FORWARD if stage_pass.phase is Phase.FORWARD else BACKWARD
            key = (kind, own[stage_pass.stage], stage_pass.microbatch)
            ring = sum(_collective_seconds(c, layout, cluster) for c in ring_exchanges(step, stage_pass.ops))
            passes[key] = compute / layout.tp + tp_all_reduce / passes_per_microbatch + ring
        durations.append(passes)
        received = [row.nbytes for row in step.storages.values() if row.name.startswith(RECEIVE_BUFFER)]
        sends.append(max(received, default=0) / link)
    microbatches = layout.stage_microbatches
    makespan = schedule_makespan(layout, durations, sends)
    optimizer = max(
        _ops_seconds([op for op in step.ops if op.phase is Phase.OPTIMIZER], gpu, compute_dtype) for step in stages
    )
    optimizer /= layout.tp * (layout.replicas if layout.zero else 1)
    data_parallel = max(
        sum(_collective_seconds(c, layout, cluster) for c in step.collectives if c.group == DATA_PARALLEL)
        for step in stages
    )
    busiest = max(range(len(stages)), key=lambda s: sum(durations[s].values()))
    forward = sum(t for (kind, *_), t in durations[busiest].items() if kind == FORWARD) / microbatches
    backward = sum(t for (kind, *_), t in durations[busiest].items() if kind == BACKWARD) / microbatches
    bubble = makespan - sum(durations[busiest].values())
    communication = data_parallel + 2 * microbatches * layout.stages_per_rank * sum(sends)
    total = makespan + optimizer + data_parallel
    return StepTime(
        forward, backward, optimizer, communication, data_parallel, 0.0, microbatches, total, pipeline_bubble_s=bubble
    )


def schedule_makespan(layout: Layout, durations: list[dict[tuple[str, int, int], float]], sends: list[float]) -> float:
    """When the last rank's last action ends: each rank runs its schedule's actions in order
    (strategies/pipeline.py ``schedule_actions``), a forward after the previous stage's forward of the same
    microbatch has arrived, a backward after the next stage's backward of it (``durations``: each rank's actions'
    seconds; ``sends``: each rank's seconds to receive a tensor)."""
    ranks, stage_count = layout.pp, layout.pp * layout.stages_per_rank
    actions = [
        schedule_actions(layout.pp_schedule, ranks, rank, layout.stage_microbatches, layout.stages_per_rank)
        for rank in range(ranks)
    ]
    done: dict[tuple[str, int, int], float] = {}
    clock, next_action = [0.0] * ranks, [0] * ranks
    while any(next_action[r] < len(actions[r]) for r in range(ranks)):
        progressed = False
        for rank in range(ranks):
            while next_action[rank] < len(actions[rank]):
                kind, stage, microbatch = actions[rank][next_action[rank]]
                source = stage - 1 if kind == FORWARD else stage + 1
                ready = 0.0
                if 0 <= source < stage_count:
                    if (kind, source, microbatch) not in done:
                        break
                    ready = done[kind, source, microbatch] + sends[rank]
                clock[rank] = max(clock[rank], ready) + durations[rank][kind, stage, microbatch]
                done[kind, stage, microbatch] = clock[rank]
                next_action[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError("the pipeline schedule waits on itself")
    return max(clock)


# Share of a collective's tensor that each rank sends through its link in a ring of n ranks (bus bandwidth).
BUS_FACTORS = {
    ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    ALL_GATHER: lambda n: (n - 1) / n,
    REDUCE_SCATTER: lambda n: (n - 1) / n,
    ALL_TO_ALL: lambda n: (n - 1) / n,  # of the bytes a rank sends, its own share stays
    RING_PASS: lambda n: 1.0,  # all of them, to the next rank
}


def _collective_seconds(collective: Collective, layout: Layout, cluster: Cluster) -> float:
    """Each group as torchtitan's device mesh lays it out (pp, dp, cp, tp from the outermost): tensor parallelism
    adjacent GPUs, context and expert parallelism next, the data-parallel replicas (with the context-parallel
    ranks, which reduce their gradients together) outermost."""
    size, stride = {
        TENSOR_PARALLEL: (layout.tp, 1),
        CONTEXT_PARALLEL: (layout.cp, layout.tp),
        EXPERT_PARALLEL: (layout.ep, layout.tp),
    }.get(collective.group, (layout.replicas, layout.tp))
    return BUS_FACTORS[collective.kind](size) * collective.nbytes / cluster.group_bytes_per_second(size, stride)


def _phase_seconds(
    step: StepGraph, passes: list[range], gpu: Gpu, compute_dtype: str, micro_steps: int
) -> dict[Phase, float]:
    """Seconds of each phase over ``micro_steps`` forward and backward passes and one optimizer step. Each
    traced pass (``passes``, the step's micro-steps) counts once, and the last one also stands for every pass
    not traced (a later micro-step also adds its gradients into the existing ones)."""
    roofline = _roofline(gpu, compute_dtype)
    seconds = dict.fromkeys(Phase, 0.0)
    for position, ops in enumerate(passes):
        repeats = max(micro_steps - len(passes) + 1, 1) if position == len(passes) - 1 else 1
        for op in step.ops[ops.start : ops.stop]:
            op_seconds = roofline(op.flops, op.bytes_moved)
            seconds[op.phase] += op_seconds * (1 if op.phase is Phase.OPTIMIZER else repeats)
    return seconds


def _ops_seconds(ops: list[Op], gpu: Gpu, compute_dtype: str) -> float:
    roofline = _roofline(gpu, compute_dtype)
    return sum(roofline(op.flops, op.bytes_moved) for op in ops)


def _roofline(gpu: Gpu, compute_dtype: str) -> Callable[[float, float], float]:
    """Seconds an op of ``flops`` FLOPs that reads and writes ``bytes_moved`` bytes takes: the slower of its compute
    and its memory traffic. The step times and the ceilings' floor (:func:`roofline_seconds_per_sequence`) share
    it, so that the floor stays under the times."""
    flops_per_second = gpu.peak_flops(compute_dtype) * COMPUTE_EFFICIENCY
    bytes_per_second = gpu.memory_gbps * 1e9 * MEMORY_EFFICIENCY
    return lambda flops, bytes_moved: max(flops / flops_per_second, bytes_moved / bytes_per_second)


def roofline_seconds_per_sequence(one: StepGraph, two: StepGraph, gpu: Gpu, compute_dtype: str) -> float:
    """A floor under the compute seconds per sequence of any layout whose ranks run this step, at any micro-batch
    and accumulation: the forward and backward ops' roofline, each op at what it gains per sequence (``one`` and
    ``two``: the step at consecutive batch sizes), of its cheapest micro-step where it traces several; tensor
    parallelism divides it, a pipeline's stages share it out.

    Each op's FLOPs and bytes are a part every micro-step repeats (the weights it reads), at least 0, plus a part
    per sequence; a layout's rewrite of the step adds ops and changes none (strategies/rewrite.py), and each
    accumulated micro-step or microbatch runs the same ops again. So :func:`step_time` and
    :func:`pipeline_step_time`, whose compute is those ops' roofline over every micro-step, are at least this times
    the sequences per GPU (tests/test_plan.py checks both claims)."""
    seconds = _per_sequence_seconds(one, two, gpu, compute_dtype)
    # a step of accumulating micro-steps (whose passes a pipeline's microbatches run) traces each: the cheapest counts
    return min(sum(seconds[ops.start : ops.stop]) for ops in one.micro_steps())


def block_roofline_seconds_per_sequence(
    one: StepGraph, two: StepGraph, gpu: Gpu, compute_dtype: str
) -> dict[str, float]:
    """:func:`roofline_seconds_per_sequence` of each decoder block's ops (``structure.blocks``): what a pipeline
    stage's pass over its layers takes at least, per sequence."""
    seconds = _per_sequence_seconds(one, two, gpu, compute_dtype)
    blocks = set(one.structure.blocks)
    owner = {module: enclosing_block(module, blocks) for module in {op.module for op in one.ops}}
    per_block: dict[str, float] = {}
    for ops in one.micro_steps():
        summed: dict[str, float] = dict.fromkeys(blocks, 0.0)
        for op in one.ops[ops.start : ops.stop]:
            if owner[op.module] is not None:
                summed[owner[op.module]] += seconds[op.index]
        per_block = {b: min(t, per_block.get(b, t)) for b, t in summed.items()}
    return per_block


def _per_sequence_seconds(one: StepGraph, two: StepGraph, gpu: Gpu, compute_dtype: str) -> list[float]:
    """Each op's roofline seconds per sequence: what it gains from ``one`` to ``two`` (0 outside forward and
    backward)."""
    roofline = _roofline(gpu, compute_dtype)
    passes = (Phase.FORWARD, Phase.BACKWARD)
    return [
        roofline(b.flops - a.flops, b.bytes_moved - a.bytes_moved) if a.phase in passes else 0.0
        for a, b in zip(one.ops, two.ops, strict=True)
    ]


def _optimizer_bytes(step: StepGraph) -> int:
    return sum(op.bytes_moved for op in step.ops if op.phase is Phase.OPTIMIZER)


def _overlapped(compute: float, communication: float, units: int) -> float:
    return max(compute, communication) + communication / units


def _exposed_transfers(
    step: StepGraph, cluster: Cluster, phase_seconds: dict[Phase, float], traced_passes: int
) -> tuple[float, float]:
    """Seconds of host copies the GPU waits for, per micro-step (forward and backward; the traced passes'
    mean) and once per step (the optimizer's): copies that overlap nothing, and what of the prefetched ones
    their phase does not cover."""
    link = cluster.pcie_gbps * 1e9
    per_micro_step, once = 0.0, 0.0
    overlapped: dict[Phase, float] = {}
    for transfer in step.transfers:
        seconds = transfer.nbytes / link
        if transfer.phase not in phase_seconds:
            once += seconds
        elif transfer.overlaps:
            overlapped[transfer.phase] = overlapped.get(transfer.phase, 0.0) + seconds / traced_passes
        else:
            per_micro_step += seconds / traced_passes
    hidden_not = sum(max(0.0, seconds - phase_seconds[phase]) for phase, seconds in overlapped.items())
    return per_micro_step + hidden_not, once
