"""PyTorch's ZeRO-1: ``DistributedDataParallel`` with the optimizer wrapped in
``torch.distributed.optim.ZeroRedundancyOptimizer``, for one rank.

Each rank's local optimizer gets the parameters ``_partition_parameters`` assigns it, largest first, each to
the rank holding the fewest elements so far; only their optimizer states and update temporaries exist on
that rank. After the local step each owner broadcasts its parameters in place, which allocates nothing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from strategies.collectives import recorded, updated_parameters_gather
from strategies.ddp import Ddp, ddp, gradient_all_reduce
from strategies.rewrite import Rewrite
from tracer.graph import StepGraph
from tracer.roles import Phase, Role
from tracer.training import TrainingSetup


def partition(sizes: list[tuple[str, int]], world: int) -> list[list[str]]:
    """The parameters of each rank, for parameters given as (name, elements) in registration order."""
    owned: list[list[str]] = [[] for _ in range(world)]
    loads = [0] * world
    for name, numel in sorted(sizes, key=lambda item: item[1], reverse=True):
        rank = loads.index(min(loads))
        owned[rank].append(name)
        loads[rank] += numel
    return owned


def parameter_sizes(step: StepGraph) -> list[tuple[str, int]]:
    """The optimizer's parameters as (name, elements) in registration order: the trained ones, which the
    optimizer is given (frozen weights, such as a LoRA base, are not, and would skew the partition)."""
    trained = {row.param for row in step.storages.values() if row.role is Role.GRADIENT and row.param}
    rows = sorted((row for row in step.storages.values() if row.role is Role.PARAMETER and row.param), key=_id)
    return [(row.param, row.numel) for row in rows if row.param in trained]


def zero_redundancy(step: StepGraph, world: int, rank: int) -> StepGraph:
    """The step of rank ``rank``: the optimizer states and temporaries of other ranks' parameters are gone.
    Apply it to a step that already has DDP's buckets."""
    owned = set(partition(parameter_sizes(step), world)[rank])
    rw = Rewrite(step)
    for row in step.storages.values():
        if row.param is None or row.param in owned:
            continue
        made_by_optimizer = row.producer is not None and step.ops[row.producer].phase is Phase.OPTIMIZER
        if row.role is Role.OPTIMIZER_STATE or made_by_optimizer:
            rw.resize(row.id, 0)
    return rw.build()


def _id(row) -> int:
    return row.id


@dataclass(frozen=True)
class ZeroRedundancy(Ddp):
    """The runtime of PyTorch's ``--zero 1``: DDP, each rank stepping the optimizer on its own parameters."""

    world: int = 1
    name = "DDP with ZeroRedundancyOptimizer"
    note = (
        "DistributedDataParallel defaults with torch.distributed.optim.ZeroRedundancyOptimizer: each rank "
        "keeps the optimizer states of the whole parameters assigned to it, largest first"
    )

    def distinct_ranks(self, step: StepGraph) -> list[int]:
        """Rank 0 and the rank whose optimizer states take the most memory."""
        state_bytes: dict[str, int] = defaultdict(int)
        for row in step.storages.values():
            if row.role is Role.OPTIMIZER_STATE and row.on_device and row.param:
                state_bytes[row.param] += row.nbytes
        loads = [sum(state_bytes[name] for name in names) for names in partition(parameter_sizes(step), self.world)]
        return sorted({0, loads.index(max(loads))})

    def apply(self, step: StepGraph, setup: TrainingSetup, rank: int) -> StepGraph:
        broadcast = updated_parameters_gather(
            step, "each rank's updated parameters, broadcast after the optimizer step"
        )
        return recorded(zero_redundancy(ddp(step), self.world, rank), gradient_all_reduce(step), broadcast)
