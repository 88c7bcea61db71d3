"""From one traced single-GPU step to the step of each rank of a layout."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from transformers import PretrainedConfig

from strategies.ddp import ddp
from strategies.deepspeed import (
    MAX_LIVE_PARAMETERS,
    MAX_REUSE_DISTANCE,
    PARAM_PERSISTENCE_THRESHOLD,
    PREFETCH_BUCKET_SIZE,
    REDUCE_BUCKET_SIZE,
    DeepSpeedPlan,
    deepspeed,
)
from strategies.fsdp import FsdpPlan, fsdp
from strategies.layout import Layout
from strategies.tensor_parallel import megatron_plan, tensor_parallel
from strategies.zero_redundancy import parameter_sizes, partition, zero_redundancy
from tracer.errors import UserError
from tracer.graph import StepGraph
from tracer.roles import Role
from tracer.training import TrainingSetup


@dataclass(frozen=True)
class Rank:
    """A rank of the layout, by its coordinates in the data- and tensor-parallel groups."""

    dp: int = 0
    tp: int = 0

    def global_rank(self, layout: Layout) -> int:
        return self.dp * layout.tp + self.tp


def check_layout(layout: Layout, setup: TrainingSetup, config: PretrainedConfig) -> None:
    """Refuse, before any tracing, a layout this model or step cannot be split into."""
    if setup.mode == "inference" and (not layout.plain or layout.offload):
        raise UserError(
            "--mode inference is modelled on one GPU: drop --gpus, --tp, --zero and --offload (a data-parallel "
            "replica serving its own requests needs what one GPU needs)."
        )
    layout.check_model(config)
    sharded = layout.tp > 1 or layout.zero >= 2 or (layout.engine == "deepspeed" and layout.zero > 0)
    if setup.grad_accum > 1 and sharded:
        raise UserError(
            "--grad-accum with FSDP, DeepSpeed or tensor parallelism is not modelled yet (only one GPU, DDP and "
            "--zero 1); estimate one micro-step with --grad-accum 1."
        )
    if setup.quantize and sharded:
        raise UserError(
            "Quantized base weights (--qlora, --load-in-8bit) are modelled on one GPU and with DDP only; FSDP, "
            "DeepSpeed and tensor parallelism store them differently."
        )
    if setup.lora and layout.tp > 1:
        raise UserError("LoRA with tensor parallelism is not modelled: use --tp 1.")
    if layout.sequence_parallel and setup.seq_len % layout.tp:
        raise UserError(
            f"--sequence-parallel splits the sequence over the {layout.tp} tensor-parallel GPUs: --seq-len "
            f"{setup.seq_len} must be a multiple of --tp {layout.tp}."
        )


def traced_setup(setup: TrainingSetup, layout: Layout) -> tuple[TrainingSetup, str | None]:
    """The single-GPU step to trace for this layout, and what that choice assumes.

    Sharded data parallelism with mixed precision computes in the low-precision dtype and keeps fp32 master
    weights in the shards (FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``), so its step
    is the one with low-precision parameters, not autocast over fp32 ones.
    """
    if not setup.mixed_precision or not (layout.dp > 1 or layout.zero):
        return setup, None
    low = setup.mixed_precision
    if layout.engine == "deepspeed":
        note = f"DeepSpeed {low}: the model in {low}, fp32 master weights in the ZeRO optimizer, no autocast"
        return dataclasses.replace(setup, dtype=low, mixed_precision=None), note
    if layout.zero in (2, 3):
        note = f"FSDP2 MixedPrecisionPolicy(param_dtype={low}, reduce_dtype=float32) instead of autocast"
        return dataclasses.replace(setup, dtype=low, mixed_precision=None), note
    return setup, None


def runtime_assumptions(layout: Layout) -> dict[str, str]:
    """What the estimate assumes about each runtime the layout uses, for the report."""
    if layout.plain:
        return {}
    notes = {"layout": layout.describe()}
    if layout.tp > 1:
        loss = (
            "lm_head output all-gathered to the full vocabulary on every GPU"
            if layout.tp_output == "gathered"
            else "lm_head output kept sliced over the vocabulary, loss_parallel() cross-entropy"
        )
        notes["tensor_parallel"] = (
            "PyTorch DTensor parallelize_module: the model's transformers TP plan for the decoder layers "
            f"(colwise/rowwise), vocabulary-parallel embedding (DTensor computes its gradient at full size); {loss}"
            + ("; sequence parallel as torchtitan lays it out" if layout.sequence_parallel else "")
        )
    if layout.dp > 1 and layout.zero == 0 and layout.engine == "fsdp":
        notes["data_parallel"] = (
            "DistributedDataParallel defaults: gradient buckets of 25 MiB (the first 1 MiB) kept for the "
            "module's life, gradient_as_bucket_view=False"
        )
    if layout.dp > 1 and layout.zero == 1 and layout.engine == "fsdp":
        notes["data_parallel"] = (
            "DistributedDataParallel defaults with torch.distributed.optim.ZeroRedundancyOptimizer: each rank "
            "keeps the optimizer states of the whole parameters assigned to it, largest first"
        )
    if layout.dp > 1 and layout.zero in (2, 3) and layout.engine == "fsdp":
        notes["data_parallel"] = (
            f"fully_shard on each decoder layer and on the root, reshard_after_forward={layout.zero == 3}, "
            "one unit prefetched in backward, one reduce-scatter input held"
        )
    if layout.zero and layout.engine == "deepspeed":
        notes["data_parallel"] = (
            f"DeepSpeed ZeRO-{layout.zero} defaults: reduce_bucket_size {REDUCE_BUCKET_SIZE:.0e}"
            + (
                f", stage3_prefetch_bucket_size {PREFETCH_BUCKET_SIZE:.0e}, stage3_max_live_parameters "
                f"{MAX_LIVE_PARAMETERS:.0e}, stage3_max_reuse_distance {MAX_REUSE_DISTANCE:.0e}, "
                f"stage3_param_persistence_threshold {PARAM_PERSISTENCE_THRESHOLD:.0e}"
                if layout.zero == 3
                else ""
            )
            + "; fp32 master weights and optimizer states of the rank's partition"
        )
    return notes


def ranks(layout: Layout, step: StepGraph) -> list[Rank]:
    """Ranks whose memory can differ. Splitting a dimension that does not divide evenly leaves the last
    tensor-parallel rank a shorter slice (``torch.chunk``), and FSDP pads the last data-parallel rank's
    shards; DeepSpeed pads every partition to one size; PyTorch's ZeRO-1 gives each rank whole parameters,
    so the rank whose optimizer states take the most memory."""
    shapes = [row.shape for row in step.storages.values() if row.role is Role.PARAMETER]
    tensor = [0]
    if layout.tp > 1 and any(size % layout.tp for shape in shapes for size in shape[:2]):
        tensor.append(layout.tp - 1)
    data = [0]
    if layout.dp > 1 and layout.zero == 1 and layout.engine == "fsdp":
        state_bytes: dict[str, int] = defaultdict(int)
        for row in step.storages.values():
            if row.role is Role.OPTIMIZER_STATE and row.on_device and row.param:
                state_bytes[row.param] += row.nbytes
        loads = [sum(state_bytes[name] for name in names) for names in partition(parameter_sizes(step), layout.dp)]
        data = sorted({0, loads.index(max(loads))})
    elif layout.dp > 1 and layout.zero in (2, 3) and layout.engine == "fsdp":
        uneven = any(shape and shape[0] % (layout.tp * layout.dp) for shape in shapes)
        data += [layout.dp - 1] if uneven else []
    return [Rank(dp=d, tp=t) for d in data for t in tensor]


def apply(step: StepGraph, layout: Layout, setup: TrainingSetup, rank: Rank) -> StepGraph:
    """The step of ``rank``: the traced step transformed by the layout, tensor parallelism first."""
    if layout.tp > 1:
        sequence = setup.seq_len if layout.sequence_parallel else None
        gathered = layout.tp_output == "gathered"
        plan = megatron_plan(step.structure, layout.tp, rank.tp, gathered, sequence_length=sequence)
        step = tensor_parallel(step, plan)
    offload_params = layout.offload == "optimizer,params"
    if layout.engine == "deepspeed" and layout.zero:
        plan = DeepSpeedPlan(layout.zero, layout.dp, rank.dp, layout.offload is not None, offload_params)
        return deepspeed(step, plan)
    if layout.dp == 1:
        return step
    if layout.zero == 0:
        return ddp(step)
    if layout.zero == 1:
        return zero_redundancy(ddp(step), layout.dp, rank.dp)
    plan = FsdpPlan(
        world=layout.dp,
        rank=rank.dp,
        reshard_after_forward=layout.zero == 3,
        mixed_precision=setup.mixed_precision is not None,
        offload=offload_params,
    )
    return fsdp(step, plan)
