"""What a data- or tensor-parallel runtime moves between GPUs, recorded on the rank's step (``StepGraph.collectives``)
so that the step time sums what each runtime issues instead of re-deriving it."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Container

from tracer.expert_parallel import ALL_TO_ALL_SINGLE
from tracer.graph import (
    ALL_GATHER,
    ALL_TO_ALL,
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    EXPERT_PARALLEL,
    REDUCE_SCATTER,
    RING_PASS,
    Collective,
    StepGraph,
)
from tracer.roles import Phase, Role
from tracer.trace import element_size as element_size_of

# The all_to_all_single exchanges of one MoE layer's token dispatcher (tracer/expert_parallel.py), in the order
# they run: in its forward (again where checkpointing recomputes it) and in its backward.
FORWARD_EXCHANGES = (
    "token counts per expert (dispatch)",
    "routed tokens to their experts' GPUs (dispatch)",
    "expert outputs back to their tokens' GPUs (combine)",
)
BACKWARD_EXCHANGES = (
    "gradients of the expert outputs back to the experts' GPUs (combine's backward)",
    "gradients of the routed tokens back to their GPUs (dispatch's backward)",
)


def parameter_bytes(step: StepGraph, names: Container[str] | None = None) -> int:
    """Bytes of the parameters a rank holds on the device (the shards of tensor parallelism, if any), of all or
    of those ``names``."""
    return sum(
        row.nbytes
        for row in step.storages.values()
        if row.role is Role.PARAMETER and row.on_device and (names is None or row.param in names)
    )


def gradient_bytes(step: StepGraph, element_size: int | None = None, names: Container[str] | None = None) -> int:
    """Bytes of the gradients a rank reduces: one per trained parameter (of all, or of those ``names``), the size
    of the rank's parameter (its tensor-parallel shard: DTensor's full-size embedding gradient is redistributed to
    a shard before the optimizer sees it), in the gradient's dtype or in ``element_size`` bytes per element where a
    runtime reduces in another dtype (FSDP2's ``reduce_dtype=float32``)."""
    parameters = {row.param: row for row in step.storages.values() if row.role is Role.PARAMETER and row.param}
    total = 0
    for row in step.storages.values():
        if row.role is Role.GRADIENT and (names is None or row.param in names):
            numel = parameters[row.param].numel if row.param in parameters else row.numel
            total += numel * (element_size or element_size_of(row.dtype))
    return total


def updated_parameters_gather(step: StepGraph, what: str) -> Collective:
    """The all-gather a runtime that shards the optimizer step waits for after it: each rank's updated
    parameters sent to every other (ZeroRedundancyOptimizer's broadcast, DeepSpeed ZeRO-1/2's partitions)."""
    return Collective(ALL_GATHER, DATA_PARALLEL, parameter_bytes(step), Phase.OPTIMIZER, False, False, what)


def recorded(step: StepGraph, *collectives: Collective) -> StepGraph:
    """``step`` with ``collectives`` added to what it already issues."""
    return dataclasses.replace(step, collectives=[*step.collectives, *collectives])


def sharded_data_parallel(step: StepGraph, reshard_after_forward: bool, reduce_bytes: int | None) -> list[Collective]:
    """FSDP2 and DeepSpeed ZeRO-3 every micro-step: all-gather each unit's parameters before its forward (and
    again before its backward when resharded after forward), reduce-scatter its gradients after its backward,
    each prefetched or issued on a side stream alongside the compute of the next unit. ``reduce_bytes``: the
    element size of the reduction, None for the gradients' own."""
    parameters = parameter_bytes(step)
    gathers = [Phase.FORWARD, Phase.BACKWARD] if reshard_after_forward else [Phase.FORWARD]
    return [
        *(
            Collective(
                ALL_GATHER, DATA_PARALLEL, parameters, phase, True, True, f"parameters before each {phase.value}"
            )
            for phase in gathers
        ),
        Collective(
            REDUCE_SCATTER,
            DATA_PARALLEL,
            gradient_bytes(step, reduce_bytes),
            Phase.BACKWARD,
            True,
            True,
            "gradients after each unit's backward",
        ),
    ]


def token_exchanges(step: StepGraph) -> list[Collective]:
    """Expert parallelism's all-to-all exchanges in a traced step, each the bytes this rank sends (the first input
    of the traced ``all_to_all_single``), summed over the MoE layers per exchange and phase. Each blocks the
    compute that needs its rows (torchtitan's dispatcher runs them on the compute stream, the counts' read back
    to the host), so none is overlapped."""
    sent: dict[tuple[str, Phase], int] = {}
    runs: dict[tuple[str, bool], int] = defaultdict(int)  # exchanges seen per MoE layer, forward and backward
    for op in step.ops:
        if op.target != ALL_TO_ALL_SINGLE:
            continue
        names = FORWARD_EXCHANGES if op.runs_forward else BACKWARD_EXCHANGES
        name = names[runs[op.module, op.runs_forward] % len(names)]
        runs[op.module, op.runs_forward] += 1
        key = (f"{name}, recomputed" if op.recompute else name, op.phase)
        sent[key] = sent.get(key, 0) + step.storages[op.inputs[0]].nbytes
    return [
        Collective(ALL_TO_ALL, EXPERT_PARALLEL, nbytes, phase, True, False, what)
        for (what, phase), nbytes in sent.items()
    ]


RING_GATHER = "_c10d_functional.all_gather_into_tensor.default"  # tracer/context_parallel.py's key/value gather
RING_PERMUTE = "_c10d_functional.all_to_all_single.default"  # its key/value gradients passed to the next rank


def ring_exchanges(step: StepGraph, ops: range | None = None) -> list[Collective]:
    """Context parallelism's exchanges in a traced step (or among its ``ops``), per phase summed over the layers:
    the keys and values all-gathered once per attention (forward, recomputation and backward: the gathered
    tensor), and in backward their gradients passed around the ring once per block (the bytes each rank sends).
    torch issues them on the compute stream and waits for each before the blocks that read it, so none is
    overlapped."""
    gathered: dict[Phase, int] = defaultdict(int)
    passed: dict[Phase, int] = defaultdict(int)
    for op in step.ops if ops is None else step.ops[ops.start : ops.stop]:
        if op.target == RING_GATHER:
            gathered[op.phase] += step.storages[op.outputs[0]].nbytes
        elif op.target == RING_PERMUTE:
            passed[op.phase] += step.storages[op.inputs[0]].nbytes
    return [
        *(
            Collective(ALL_GATHER, CONTEXT_PARALLEL, nbytes, phase, True, False, "keys and values of every attention")
            for phase, nbytes in gathered.items()
        ),
        *(
            Collective(RING_PASS, CONTEXT_PARALLEL, nbytes, phase, True, False, "key and value gradients, every block")
            for phase, nbytes in passed.items()
        ),
    ]
