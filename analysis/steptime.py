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

from dataclasses import dataclass

from strategies.layout import Layout
from tracer.gpus import PCIE_4_X16_GBPS, Gpu
from tracer.graph import StepGraph
from tracer.roles import Phase, Role
from tracer.trace import element_size

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

    def to_json(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def step_time(
    single: StepGraph, rank_step: StepGraph, layout: Layout, cluster: Cluster, compute_dtype: str, micro_steps: int
) -> StepTime:
    """``single``: the traced single-GPU step at the micro-batch (for the parameter, gradient and activation
    sizes the collectives move); ``rank_step``: the busiest rank's step (its ops and host transfers)."""
    gpu = cluster.gpu
    passes = rank_step.micro_steps()
    phases = _phase_seconds(rank_step, passes, gpu, compute_dtype, micro_steps)
    forward = phases[Phase.FORWARD] / layout.tp / micro_steps
    backward = phases[Phase.BACKWARD] / layout.tp / micro_steps
    optimizer = phases[Phase.OPTIMIZER] / layout.tp / (layout.dp if layout.zero else 1)
    if layout.offload:
        optimizer = _optimizer_bytes(rank_step) / layout.tp / layout.dp / (cluster.host_optimizer_gbps * 1e9)

    volumes = _volumes(single, layout)
    data = cluster.group_bytes_per_second(layout.dp, layout.tp)
    ring = (layout.dp - 1) / layout.dp
    gather = ring * volumes.parameters / data  # all-gather of the parameters
    reduce_scatter = ring * volumes.gradients / data
    all_reduce = 2 * reduce_scatter
    units = max(len(single.structure.blocks), 1)

    tensor = 0.0
    if layout.tp > 1:
        tp_ring = 2 * (layout.tp - 1) / layout.tp  # all-reduce, or all-gather + reduce-scatter with SP
        tensor = tp_ring * volumes.tensor_parallel / cluster.group_bytes_per_second(layout.tp, 1)

    micro_forward, micro_backward, once, communication = forward, backward, 0.0, tensor * micro_steps
    if layout.dp > 1:
        if layout.zero == 0 or (layout.zero == 1 and layout.engine == "fsdp"):
            # DDP buckets all-reduce during the backward of the last micro-step (no_sync before it);
            # ZeroRedundancyOptimizer then broadcasts each rank's updated shard.
            last_backward = _overlapped(backward, all_reduce, units)
            once = last_backward - backward + (gather if layout.zero == 1 else 0.0)
            communication += all_reduce + (gather if layout.zero == 1 else 0.0)
        elif layout.engine == "fsdp" or layout.zero == 3:
            # FSDP2 and DeepSpeed ZeRO-3 (overlap_comm on by default for stage 3) prefetch the gathers and
            # reduce-scatter during backward, every micro-step.
            backward_comm = reduce_scatter + (gather if layout.zero == 3 else 0.0)
            micro_forward = _overlapped(forward, gather, units)
            micro_backward = _overlapped(backward, backward_comm, units)
            communication += (gather + backward_comm) * micro_steps
        else:
            # DeepSpeed ZeRO-1/2: overlap_comm defaults to off below stage 3; gradients are reduced on the
            # compute stream (every micro-step for stage 2, at the boundary for stage 1) and the updated 16-bit
            # partitions all-gathered after the step.
            reductions = micro_steps if layout.zero == 2 else 1
            once = reduce_scatter * reductions + gather
            communication += once

    phase_seconds = {Phase.FORWARD: forward, Phase.BACKWARD: backward}
    host_micro, host_once = _exposed_transfers(rank_step, cluster, phase_seconds, len(passes))
    host = micro_steps * host_micro + host_once
    total = micro_steps * (micro_forward + micro_backward + tensor) + optimizer + once + host
    compute = micro_steps * (forward + backward) + optimizer
    exposed = total - compute - host
    return StepTime(forward, backward, optimizer, communication, exposed, host, micro_steps, total)


@dataclass(frozen=True)
class _Volumes:
    parameters: int  # bytes a data-parallel rank gathers (full size, before the ring factor)
    gradients: int  # bytes a data-parallel rank reduces
    tensor_parallel: int  # bytes of activations all-reduced by a tensor-parallel rank per micro-step


def _volumes(single: StepGraph, layout: Layout) -> _Volumes:
    parameters = sum(row.nbytes for row in single.storages.values() if row.role is Role.PARAMETER and row.on_device)
    gradient_elements = sum(row.numel for row in single.storages.values() if row.role is Role.GRADIENT)
    gradient_dtype = next((row.dtype for row in single.storages.values() if row.role is Role.GRADIENT), "float32")
    # FSDP2's MixedPrecisionPolicy reduces in fp32 (strategies/fsdp.py Fsdp2.traced_setup); everyone else in the
    # gradients' dtype.
    sharded_fsdp = layout.engine == "fsdp" and layout.zero >= 2
    reduce_size = 4 if sharded_fsdp else element_size(gradient_dtype)
    return _Volumes(
        parameters=parameters // layout.tp,
        gradients=gradient_elements * reduce_size // layout.tp,
        tensor_parallel=_tensor_parallel_bytes(single, layout),
    )


def _tensor_parallel_bytes(single: StepGraph, layout: Layout) -> int:
    """Megatron's pattern: each layer all-reduces its attention and MLP outputs in forward and their input
    gradients in backward (again in forward when recomputed), plus the embedding's output and the lm_head's
    input gradient: one activation-sized (batch x sequence x hidden) tensor each."""
    if layout.tp == 1:
        return 0
    layers = len(single.structure.blocks)
    recomputed = any(op.recompute for op in single.ops)
    activation = _hidden_state_bytes(single)
    return ((6 if recomputed else 4) * layers + 2) * activation


def _hidden_state_bytes(single: StepGraph) -> int:
    """Bytes of one hidden-state tensor: the output of the token embedding, as traced."""
    embedding = single.structure.input_embedding
    produced = (row for row in single.storages.values() if row.producer is not None and row.module == embedding)
    return max((row.nbytes for row in produced), default=0)


def _phase_seconds(
    step: StepGraph, passes: list[range], gpu: Gpu, compute_dtype: str, micro_steps: int
) -> dict[Phase, float]:
    """Seconds of each phase over ``micro_steps`` forward and backward passes and one optimizer step. Each
    traced pass (``passes``, the step's micro-steps) counts once, and the last one also stands for every pass
    not traced (a later micro-step also adds its gradients into the existing ones)."""
    flops_per_second = gpu.peak_flops(compute_dtype) * COMPUTE_EFFICIENCY
    bytes_per_second = gpu.memory_gbps * 1e9 * MEMORY_EFFICIENCY
    seconds = dict.fromkeys(Phase, 0.0)
    for position, ops in enumerate(passes):
        repeats = max(micro_steps - len(passes) + 1, 1) if position == len(passes) - 1 else 1
        for op in step.ops[ops.start : ops.stop]:
            op_seconds = max(op.flops / flops_per_second, op.bytes_moved / bytes_per_second)
            seconds[op.phase] += op_seconds * (1 if op.phase is Phase.OPTIMIZER else repeats)
    return seconds


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
