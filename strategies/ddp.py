"""PyTorch DDP (``torch.nn.parallel.DistributedDataParallel`` with its defaults), for one rank.

With ``gradient_as_bucket_view=False`` the reducer keeps one flat buffer per gradient bucket for the life of
the module: gradients are copied in as they become ready, all-reduced in place, and copied back to
``.grad`` (torch/csrc/distributed/c10d/reducer.cpp). Buckets follow ``compute_bucket_assignment_by_size``:
parameters in the order their gradients became ready in the first iteration (``_rebuild_buckets``),
grouped by dtype, each bucket closed once it reaches its size limit: 1 MiB for the first
(``dist._DEFAULT_FIRST_BUCKET_BYTES``), 25 MiB after (``bucket_cap_mb``).
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.collectives import gradient_bytes, recorded
from strategies.rewrite import Rewrite
from tracer.expert_parallel import expert_weight
from tracer.graph import ALL_REDUCE, DATA_PARALLEL, Collective, StepGraph, StorageRow
from tracer.roles import Phase, Role
from tracer.trace import element_size
from tracer.training import TrainingSetup

FIRST_BUCKET_BYTES = 1024**2
BUCKET_CAP_BYTES = 25 * 1024**2


def bucket_sizes(gradients: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """(dtype, bytes) of each bucket, for gradients given as (dtype, bytes) in the order they become ready."""
    open_buckets: dict[str, int] = {}
    limits: dict[str, int] = {}
    buckets = []
    for dtype, nbytes in gradients:
        size = open_buckets.get(dtype, 0) + nbytes
        limit = limits.setdefault(dtype, FIRST_BUCKET_BYTES)
        if size >= limit:
            buckets.append((dtype, size))
            open_buckets.pop(dtype, None)
            limits[dtype] = BUCKET_CAP_BYTES
        else:
            open_buckets[dtype] = size
    buckets += [(dtype, size) for dtype, size in open_buckets.items()]
    return buckets


def ddp(step: StepGraph, experts_left_out: bool = False) -> StepGraph:
    """The step of one rank under DDP: the single-GPU step plus the reducer's persistent buckets, of every
    gradient or, with ``experts_left_out``, of the gradients of all but the expert weights."""
    grads = sorted(
        reduced_gradients(step, experts_left_out), key=lambda row: row.producer if row.producer is not None else -1
    )
    rw = Rewrite(step)
    for index, (dtype, nbytes) in enumerate(bucket_sizes([(row.dtype, row.nbytes) for row in grads])):
        rw.add(nbytes, Role.COMMUNICATION, None, None, f"DDP bucket {index}", dtype)
    return rw.build()


def reduced_gradients(step: StepGraph, experts_left_out: bool = False) -> list[StorageRow]:
    """The gradients DDP reduces: all, or all but the expert weights' (``ep_plan``), which expert parallelism over
    the whole data-parallel group gives one GPU each, where the combine's backward completes their gradients;
    DDP is told to leave them out (``_set_params_and_buffers_to_ignore_for_model``)."""
    return [
        row
        for row in step.storages.values()
        if row.role is Role.GRADIENT and not (experts_left_out and expert_weight(step.structure.ep_plan, row.param))
    ]


@dataclass(frozen=True)
class Ddp:
    """The runtime of ``--zero 0``: every rank is alike, but for the routed tokens each receives under expert
    parallelism (``experts_left_out``)."""

    experts_left_out: bool = False
    name = "DDP"

    @property
    def note(self) -> str:
        experts = "; the experts' weights left out of the buckets" if self.experts_left_out else ""
        return (
            "DistributedDataParallel defaults: gradient buckets of 25 MiB (the first 1 MiB) kept for the "
            f"module's life, gradient_as_bucket_view=False{experts}"
        )

    def traced_setup(self, setup: TrainingSetup) -> tuple[TrainingSetup, str | None]:
        return setup, None

    def distinct_ranks(self, step: StepGraph) -> list[int]:
        return [0]

    def apply(self, step: StepGraph, setup: TrainingSetup, rank: int) -> StepGraph:
        return recorded(ddp(step, self.experts_left_out), gradient_all_reduce(step, self.experts_left_out))


def gradient_all_reduce(step: StepGraph, experts_left_out: bool = False) -> Collective:
    """DDP all-reduces each bucket as its gradients become ready, in the backward of the last micro-step (the
    loop runs the others under ``no_sync``)."""
    volume = gradient_bytes(step)
    if experts_left_out:
        volume = sum(row.numel * element_size(row.dtype) for row in reduced_gradients(step, experts_left_out))
    return Collective(
        ALL_REDUCE,
        DATA_PARALLEL,
        volume,
        Phase.BACKWARD,
        every_micro_step=False,
        overlapped=True,
        what="gradient buckets, during the last micro-step's backward",
    )
