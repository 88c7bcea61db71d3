"""A parallel layout: how many GPUs, how they split the model (tensor parallel) and the data (data parallel,
with a ZeRO stage), and whose runtime is modelled.

:func:`prepare` is the one place a layout meets a model and a step: it refuses what cannot be split, picks the
runtimes (the only place ``--zero`` and ``--engine`` are read), and says which single-GPU step to trace.
Each rank's step is then that traced step transformed by the runtimes, tensor parallelism first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from strategies.collectives import recorded, ring_exchanges, token_exchanges
from strategies.ddp import Ddp
from strategies.deepspeed import DeepSpeedZero, ZeroConfig
from strategies.fsdp import INTEGER_PARAMETERS_TORCH, Fsdp2
from strategies.pipeline import (
    LOOPED,
    SCHEDULES,
    PipelineParallel,
    interleaved_rounds,
    rank_stages,
    schedule_takes,
)
from strategies.tensor_parallel import TensorParallel
from strategies.zero_redundancy import ZeroRedundancy
from tracer.context_parallel import local_length
from tracer.errors import UserError
from tracer.expert_parallel import Routing, routing_of
from tracer.graph import StepGraph
from tracer.published import refuse_with_tensor_parallelism
from tracer.training import TrainingSetup
from tracer.versions import installed_torch_version

if TYPE_CHECKING:  # annotations only: the command line's help need not import transformers
    from transformers import PretrainedConfig

ENGINES = ("fsdp", "deepspeed")
TP_OUTPUTS = ("parallel", "gathered")
ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = ("optimizer", "optimizer,params")


@dataclass(frozen=True)
class Layout:
    """``gpus`` = ``pp`` x ``tp`` x data-parallel degree. ``zero`` is the ZeRO stage over the data-parallel group
    (0 is plain DDP). ``engine`` picks whose runtime is modelled: PyTorch (DDP for 0, DDP with
    ZeroRedundancyOptimizer for 1, FSDP2 for 2 and 3) or DeepSpeed. ``pp`` pipeline stages run ``microbatches``
    microbatches of the batch size per step under ``pp_schedule`` (torch.distributed.pipelining)."""

    gpus: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: MoE layers' experts split whole over this many ranks (tracer/expert_parallel.py)
    routing_imbalance: float = 1.0  # training with ep: the busiest rank's experts get this many times their share
    pp: int = 1
    cp: int = 1  # context parallelism: each sequence split over this many ranks, attention as a ring over them
    pp_schedule: str = "1f1b"
    microbatches: int | None = None  # None: as many as stages
    pp_split: tuple[int, ...] | None = None  # decoder layers per pipeline stage; None: even
    pp_stages_per_rank: int | None = None  # stages each pipeline rank holds; None: 2 if the schedule loops, else 1
    zero: int = 0
    engine: str = "fsdp"
    sequence_parallel: bool = False
    tp_output: str = "parallel"
    offload: str | None = None  # what lives in host memory: the optimizer step, or that and the parameters
    zero_config: ZeroConfig = field(default_factory=ZeroConfig)  # DeepSpeed's zero_optimization sizes

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise UserError(f"--gpus must be at least 1 (got {self.gpus}).")
        if self.tp < 1:
            raise UserError(f"--tp must be at least 1 (got {self.tp}).")
        if self.pp < 1:
            raise UserError(f"--pp must be at least 1 (got {self.pp}).")
        if self.ep < 1:
            raise UserError(f"--ep must be at least 1 (got {self.ep}).")
        if self.cp < 1:
            raise UserError(f"--cp must be at least 1 (got {self.cp}).")
        if self.routing_imbalance != 1 and self.ep == 1:
            raise UserError("--routing-imbalance sets how unevenly --ep's routed tokens spread: add --ep 2 or more.")
        if self.gpus % (self.tp * self.pp * self.cp):
            named = [f"--{name} {degree}" for name, degree in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp))]
            split = " x ".join(n for n in named if not n.endswith(" 1")) or "--tp 1"
            raise UserError(
                f"{split} must divide --gpus {self.gpus} (the data-parallel degree is gpus / (tp x pp x cp))."
            )
        self._check_pipeline()
        if self.zero not in ZERO_STAGES:
            raise UserError(f"--zero must be 0, 1, 2 or 3 (got {self.zero}).")
        if self.engine not in ENGINES:
            raise UserError(f"--engine must be fsdp or deepspeed (got {self.engine!r}).")
        if self.tp_output not in TP_OUTPUTS:
            raise UserError(f"--tp-output must be parallel or gathered (got {self.tp_output!r}).")
        if self.offload is not None:
            self._check_offload()
        if self.zero and self.replicas == 1 and not (self.offload and self.engine == "deepspeed"):
            raise UserError(
                f"--zero {self.zero} shards over the data-parallel group, which is a single GPU with --gpus "
                f"{self.gpus} --tp {self.tp}. Use more GPUs or --zero 0."
            )
        if self.engine == "deepspeed" and self.zero == 0 and self.replicas > 1:
            raise UserError(
                "DeepSpeed without ZeRO is not modelled: use --engine deepspeed --zero 1, 2 or 3, or plain "
                "PyTorch DDP with --engine fsdp --zero 0."
            )
        if self.zero_config != ZeroConfig() and self.engine != "deepspeed":
            raise UserError("DeepSpeed's zero_optimization settings apply to --engine deepspeed.")
        if self.tp == 1 and (self.sequence_parallel or self.tp_output != "parallel"):
            raise UserError("--sequence-parallel and --tp-output apply to tensor parallelism: add --tp 2 or more.")

    def _check_pipeline(self) -> None:
        if self.pp_schedule not in SCHEDULES:
            raise UserError(
                f"--pp-schedule {self.pp_schedule!r} is not modelled: use one of {', '.join(SCHEDULES)} (zero-bubble "
                "schedules are not modelled yet)."
            )
        if self.microbatches is not None and self.microbatches < 1:
            raise UserError(f"--microbatches must be at least 1 (got {self.microbatches}).")
        if self.pp == 1:
            given = (self.microbatches, self.pp_split, self.pp_stages_per_rank)
            if any(value is not None for value in given) or self.pp_schedule != "1f1b":
                raise UserError(
                    "--microbatches, --pp-schedule, --pp-split and --stages-per-rank apply to pipeline parallelism: "
                    "add --pp 2 or more."
                )
            return
        self._check_stages_per_rank()
        stages = self.pp * self.stages_per_rank
        if self.pp_split is not None and (len(self.pp_split) != stages or min(self.pp_split) < 1):
            raise UserError(
                f"--pp-split gives each of the {stages} pipeline stages its decoder layers, at least one: {stages} "
                f"counts, e.g. --pp-split {','.join(['8'] * stages)} (got {','.join(map(str, self.pp_split))})."
            )
        if self.engine == "deepspeed":
            raise UserError(
                "--pp models torch.distributed.pipelining; DeepSpeed runs its own pipeline engine (PipelineModule), "
                "which is not modelled: with --pp use --engine fsdp (DDP, ZeroRedundancyOptimizer or FSDP2 per stage)."
            )
        if self.offload or self.sequence_parallel:
            flag = "--offload" if self.offload else "--sequence-parallel"
            raise UserError(f"{flag} with --pp is not modelled yet (not checked against a runtime): drop one of them.")
        if self.pp_schedule == "1f1b" and self.stage_microbatches < self.pp:
            raise UserError(
                f"--pp-schedule 1f1b needs at least as many microbatches as stages (Schedule1F1B refuses fewer): "
                f"--microbatches {self.pp} or more, or --pp-schedule gpipe."
            )

    def _check_stages_per_rank(self) -> None:
        looped = self.pp_schedule in LOOPED
        if self.pp_stages_per_rank is not None and not looped and self.pp_stages_per_rank != 1:
            raise UserError(
                f"--stages-per-rank applies to --pp-schedule {' or '.join(LOOPED)}; {self.pp_schedule} runs one "
                "stage per rank."
            )
        if looped and self.stages_per_rank < 2:
            raise UserError(
                f"--pp-schedule {self.pp_schedule} loops over several stages per rank: --stages-per-rank 2 or more "
                "(or --pp-schedule 1f1b for one)."
            )
        if not schedule_takes(self.pp_schedule, self.pp, self.stage_microbatches):
            rounds = interleaved_rounds(self.pp, self.stage_microbatches)
            raise UserError(
                f"--pp-schedule {self.pp_schedule} runs the microbatches in rounds of --pp {self.pp}: "
                f"--microbatches {self.stage_microbatches} must be a multiple of its {rounds} rounds "
                f"(ScheduleInterleaved1F1B refuses it), e.g. --microbatches {rounds * self.pp}."
            )

    def _check_offload(self) -> None:
        if self.offload not in OFFLOADS:
            raise UserError(f"--offload must be optimizer or optimizer,params (got {self.offload!r}).")
        if self.engine == "deepspeed":
            if self.zero == 0:
                raise UserError("DeepSpeed offloads with ZeRO: add --zero 1, 2 or 3 (ZeRO-Offload).")
            if self.offload == "optimizer,params" and self.zero != 3:
                raise UserError("DeepSpeed offloads parameters with ZeRO-3 only: use --zero 3.")
            return
        if self.zero != 3 or self.offload != "optimizer,params":
            raise UserError(
                "PyTorch offloads with FSDP2's CPUOffloadPolicy, which moves the parameters, gradients and "
                "optimizer step to the host: use --zero 3 --offload optimizer,params, or --engine deepspeed."
            )

    @property
    def dp(self) -> int:
        """Replicas that each run their own batch."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def replicas(self) -> int:
        """Ranks that hold the same parameters and reduce their gradients together: the data-parallel ones and,
        under context parallelism, those sharing each sequence (torchtitan's dp_shard x cp mesh for FSDP)."""
        return self.dp * self.cp

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank holds: as given, else 2 under a looped schedule (interleaved 1F1B), else 1."""
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule in LOOPED else 1

    def rank_stages(self, rank: Rank) -> list[int]:
        """The pipeline stages ``rank`` holds (its pipeline rank's; stage 0 without pipeline parallelism)."""
        return rank_stages(self.pp, rank.pp, self.stages_per_rank)

    @property
    def stage_microbatches(self) -> int:
        """Microbatches per pipeline step: as given, else one per stage."""
        return self.microbatches or self.pp

    @property
    def plain(self) -> bool:
        """One GPU, no ZeRO: the traced step as it is."""
        return self.gpus == 1 and not self.zero

    def describe(self) -> str:
        offload = f", {self.offload.replace(',', ' and ')} offloaded to the CPU" if self.offload else ""
        if self.plain:
            return "1 GPU"
        parts = []
        if self.cp > 1:
            parts.append(f"context parallel {self.cp}")
        if self.pp > 1:
            per_rank = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
            schedule = f"{self.pp_schedule}{per_rank}, {self.stage_microbatches} microbatches"
            split = f", layers {'+'.join(map(str, self.pp_split))}" if self.pp_split else ""
            parts.append(f"pipeline parallel {self.pp} ({schedule}{split})")
        if self.tp > 1:
            sequence = " with sequence parallelism" if self.sequence_parallel else ""
            gathered = ", gathered logits" if self.tp_output == "gathered" else ""
            experts = f", experts expert parallel {self.ep}" if self.ep > 1 else ""
            parts.append(f"tensor parallel {self.tp}{sequence}{gathered}{experts}")
        elif self.ep > 1:
            parts.append(f"expert parallel {self.ep}")
        runtime = data_parallel(self)
        if runtime is not None:
            parts.append(f"{runtime.name} over {self.replicas}" if self.replicas > 1 else runtime.name)
        return f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}: " + " x ".join(parts) + offload

    def to_json(self) -> dict[str, Any]:
        """The fields as given, with what follows from them: the data-parallel degree, the microbatches and the
        pipeline stages each rank holds."""
        piped = self.pp > 1
        resolved = {
            "dp": self.dp,
            "microbatches": self.stage_microbatches if piped else None,
            "pp_stages_per_rank": self.stages_per_rank if piped else None,
        }
        return asdict(self) | resolved


@dataclass(frozen=True)
class Rank:
    """A rank of the layout, by its coordinates in the data- and tensor-parallel groups and its pipeline stage."""

    dp: int = 0
    tp: int = 0
    pp: int = 0

    def global_rank(self, layout: Layout) -> int:
        return ((self.pp * layout.dp + self.dp) * layout.cp) * layout.tp + self.tp  # context-parallel rank 0


class DataParallel(Protocol):
    """A runtime that keeps data-parallel replicas in step (strategies/ddp.py, zero_redundancy.py, fsdp.py,
    deepspeed.py)."""

    @property
    def name(self) -> str: ...

    @property
    def note(self) -> str: ...

    def traced_setup(self, setup: TrainingSetup) -> tuple[TrainingSetup, str | None]:
        """The single-GPU step this runtime transforms, and what choosing it assumes (None: the setup's own)."""
        ...

    def distinct_ranks(self, step: StepGraph) -> list[int]:
        """The data-parallel ranks whose memory can differ."""
        ...

    def apply(self, step: StepGraph, setup: TrainingSetup, rank: int) -> StepGraph: ...


def data_parallel(layout: Layout) -> DataParallel | None:
    """The runtime ``--zero`` and ``--engine`` stand for; None for a single replica without ZeRO."""
    offload_params = layout.offload == "optimizer,params"
    if layout.engine == "deepspeed" and layout.zero:
        return DeepSpeedZero(
            layout.zero, layout.replicas, layout.offload is not None, offload_params, layout.zero_config
        )
    if layout.replicas == 1:
        return None
    if layout.zero == 0:
        return Ddp(experts_left_out=layout.ep > 1)
    if layout.zero == 1:
        return ZeroRedundancy(world=layout.replicas)
    return Fsdp2(layout.replicas, layout.zero == 3, offload_params, layout.tp, layout.ep)


@dataclass(frozen=True)
class PreparedLayout:
    """A layout checked against one model and step: the single-GPU step to trace (``traced``), and how each
    rank's step follows from it."""

    layout: Layout
    setup: TrainingSetup
    traced: TrainingSetup
    tensor: TensorParallel | None = None
    data: DataParallel | None = None
    pipeline: PipelineParallel | None = None
    assumptions: dict[str, str] = field(default_factory=dict)  # what the runtimes assume, for the report

    def ranks(self, step: StepGraph, dominant: bool = False) -> list[Rank]:
        """Ranks whose memory can differ, from the traced step; with ``dominant``, only the pipeline stages no other
        holds more than (the planner's search, which reads the busiest)."""
        if self.pipeline is None:
            stages = [0]
        else:
            stages = self.pipeline.dominant_ranks(step) if dominant else range(self.pipeline.ranks)
        tensor = self.tensor.distinct_ranks(step) if self.tensor else [0]
        data = self.data.distinct_ranks(step) if self.data else [0]
        return [Rank(dp=d, tp=t, pp=p) for p in stages for d in data for t in tensor]

    def rank_step(self, step: StepGraph, rank: Rank) -> StepGraph:
        """The step of ``rank``: the traced step transformed by the layout, its model-parallel part (tensor
        parallelism, the pipeline stage) first, then data parallelism."""
        return self.data_parallel_step(self.model_parallel_step(step, rank), rank)

    def model_parallel_step(self, step: StepGraph, rank: Rank, sliced: StepGraph | None = None) -> StepGraph:
        """The tensor-parallel slice and pipeline stage of ``rank``: what layouts splitting the model alike share,
        whatever their data parallelism (``model_parallel_key``); with expert parallelism in training, the traced
        step's token exchanges recorded as the rank's all-to-all collectives (they grow with the batch). The stage is
        cut from the slice (``sliced``: one already made, by ``tensor_slice``), which pipelines of any microbatches
        and schedule share."""
        if self.pipeline is not None and self.tensor is not None:
            sliced = self.tensor_slice(step, rank) if sliced is None else sliced
            step = self.tensor.staged(self.pipeline.apply(sliced, rank.pp), step)
        elif self.pipeline is not None:
            step = self.pipeline.apply(step, rank.pp)
        elif self.tensor is not None:
            step = self.tensor.apply(step, self.setup, rank.tp)
        if self.traced.expert_parallel > 1 and self.setup.mode == "train":
            step = recorded(step, *token_exchanges(step))
        if self.traced.context_parallel > 1:
            step = recorded(step, *ring_exchanges(step))
        return step

    @property
    def splits_the_model(self) -> bool:
        """Whether a rank's model-parallel step differs from the traced one (a stage, a slice, or the exchanges of
        expert or context parallelism recorded)."""
        traced = self.traced
        return bool(self.pipeline or self.tensor or traced.expert_parallel > 1 or traced.context_parallel > 1)

    def tensor_slice(self, step: StepGraph, rank: Rank) -> StepGraph:
        return self.tensor.slice(step, self.setup, rank.tp)

    def tensor_slice_key(self, rank: Rank) -> tuple:
        return self.tensor, rank.tp if self.tensor else 0, self.setup.seq_len

    def model_parallel_key(self, rank: Rank) -> tuple:
        return self.pipeline, rank.pp if self.pipeline else 0, *self.tensor_slice_key(rank)

    def data_parallel_step(self, step: StepGraph, rank: Rank) -> StepGraph:
        return self.data.apply(step, self.setup, rank.dp) if self.data is not None else step


def prepare(layout: Layout, setup: TrainingSetup, config: PretrainedConfig | None) -> PreparedLayout:
    """Refuse, before any tracing, a layout this model or step cannot be split into; otherwise the layout's
    runtimes and the step to trace for it. A custom model has no ``config``: its tensor-parallel plan is checked
    against the traced model when the plan is applied."""
    if setup.mode == "inference":
        return _prepare_inference(layout, setup, config)
    routing = _expert_parallel_routing(layout, setup, config) if layout.ep > 1 else None
    context = _context_parallel(layout, setup) if layout.cp > 1 else None
    if layout.engine == "deepspeed":
        hidden_size = getattr(config, "hidden_size", None)
        layout = dataclasses.replace(layout, zero_config=layout.zero_config.resolved(hidden_size))
    tensor = None
    if layout.tp > 1:
        tensor = TensorParallel(layout.tp, layout.sequence_parallel, layout.tp_output == "gathered")
        if config is not None:
            tensor.check(config)
    _refuse_quantized_tensor_parallel(layout, setup)
    if setup.quantize == "int8" and layout.engine == "deepspeed" and layout.zero == 3:
        raise UserError(
            "--load-in-8bit with DeepSpeed ZeRO-3 is not modelled: ZeRO-3 partitions the base weights, and PEFT "
            "documents only 4-bit weights stored in the compute dtype for it (bnb_4bit_quant_storage). Use --qlora, "
            "or --zero 1 or 2, which leave frozen weights whole."
        )
    if setup.quantize == "int8" and isinstance(data_parallel(layout), Fsdp2):
        torch_version = installed_torch_version()
        if torch_version < INTEGER_PARAMETERS_TORCH:
            raise UserError(
                f"--load-in-8bit under FSDP2 does not run on torch {torch_version[0]}.{torch_version[1]}: its "
                "fully_shard makes every shard require a gradient, which LLM.int8()'s integer weights refuse "
                "(pytorch#177844, fixed in torch 2.12). Use --zero 0 or 1, --engine deepspeed --zero 1 or 2, or "
                "--qlora with bnb_4bit_quant_storage in the compute dtype."
            )
    if setup.lora and layout.tp > 1:
        raise UserError(
            "LoRA with tensor parallelism is not modelled: PyTorch's ColwiseParallel and RowwiseParallel accept "
            "only nn.Linear and nn.Embedding, and peft wraps the projections it adapts. Use --tp 1."
        )
    if layout.sequence_parallel and setup.seq_len % layout.tp:
        raise UserError(
            f"--sequence-parallel splits the sequence over the {layout.tp} tensor-parallel GPUs: --seq-len "
            f"{setup.seq_len} must be a multiple of --tp {layout.tp}."
        )
    pipeline = None
    if layout.pp > 1:
        pipeline = PipelineParallel(
            layout.pp, layout.pp_schedule, layout.stage_microbatches, layout.pp_split, layout.stages_per_rank
        )
        pipeline.check(setup, config)
    data = data_parallel(layout)
    traced, recipe = data.traced_setup(setup) if data is not None else (setup, None)
    if pipeline is not None:
        traced = pipeline.traced_setup(traced)
    assumptions = {"mixed_precision_recipe": recipe} if recipe else {}
    if context is not None:
        traced = dataclasses.replace(traced, seq_len=context, context_parallel=layout.cp)
        assumptions["context_parallel"] = CONTEXT_PARALLEL_TRAINING.format(cp=layout.cp, local=context)
    if routing is not None:
        traced = dataclasses.replace(traced, expert_parallel=layout.ep, routing_imbalance=layout.routing_imbalance)
        assumptions["expert_parallel"] = EXPERT_PARALLEL_TRAINING
        assumptions["expert_routing"] = routing.describe(setup.batch_size * setup.seq_len)
    if not layout.plain:
        assumptions["layout"] = layout.describe()
        if pipeline is not None:
            assumptions["pipeline_parallel"] = pipeline.note
        if tensor is not None:
            assumptions["tensor_parallel"] = tensor.note
        if data is not None:
            assumptions["data_parallel"] = data.note
    return PreparedLayout(layout, setup, traced, tensor, data, pipeline, assumptions)


CONTEXT_PARALLEL_TRAINING = (
    "torch's context_parallel as torchtitan runs it: each sequence split over {cp} GPUs, load balanced (two of "
    "2 x {cp} chunks, {local} tokens, each), every attention a ring (the key and value all-gathered, the flash kernel "
    "block by block, merged in float32; the key/value gradients passed around by all-to-all); the busiest GPU, the "
    "first, is the one traced; parameters replicated or sharded over the data-parallel x context-parallel GPUs (with "
    "--tp, its DTensor slice sharded by FSDP2)"
)


def _context_parallel(layout: Layout, setup: TrainingSetup) -> int:
    """Refuse what context parallelism is not modelled with (each by name), else the tokens each rank holds."""
    if layout.ep > 1:
        raise UserError("--cp with --ep is not modelled yet (not checked against a runtime): drop one of them.")
    if layout.tp > 1 and layout.zero < 2:
        raise UserError(
            "--cp with --tp is modelled with FSDP2 over the data- and context-parallel GPUs, as torchtitan composes "
            "them: add --zero 2 or 3 (DDP over tensor-parallel DTensors has no runtime here to check it against)."
        )
    if layout.sequence_parallel:
        raise UserError("--cp with --sequence-parallel is not modelled yet (not checked against a runtime).")
    if layout.engine == "deepspeed" or layout.offload:
        raise UserError("--cp is torch's context_parallel: use --engine fsdp (DDP or FSDP2) without --offload.")
    if setup.attn == "eager":
        raise UserError("--cp runs attention as a ring over the flash kernel: drop --attn eager.")
    return local_length(setup.seq_len, layout.cp)


EXPERT_PARALLEL_TRAINING = (
    "torchtitan's AllToAllTokenDispatcher within groups of ep GPUs, each holding 1/ep of every MoE layer's experts: "
    "the routed tokens exchanged by all_to_all_single, run by grouped matmuls on the rows received, sent back; "
    "every GPU its own batch; the dense parameters under DDP (ep = gpus: the experts' gradients complete on their one "
    "GPU) or FSDP2 over all the GPUs (the experts sharded over the gpus / ep GPUs holding them)"
)


def _expert_parallel_routing(layout: Layout, setup: TrainingSetup, config: PretrainedConfig | None) -> Routing:
    """Refuse what expert parallelism in training is not modelled with (each refusal names what is), else the
    routing the traced rank assumes."""
    if config is None:
        raise UserError("--ep splits a transformers MoE model's experts by its ep_plan; a custom model has none.")
    if layout.tp > 1 or layout.pp > 1:
        raise UserError(
            "--ep with --tp or --pp in training is not modelled yet (not checked against a runtime): drop one of them."
        )
    if layout.zero == 1 or layout.engine != "fsdp" or layout.offload:
        raise UserError(
            "--ep in training is modelled with DDP (--zero 0) or torchtitan's FSDP2 (--zero 2 or 3) over the data-"
            "parallel GPUs; ZeroRedundancyOptimizer, DeepSpeed and offloading are not modelled with --ep."
        )
    if layout.dp % layout.ep:
        raise UserError(
            f"--ep {layout.ep} must divide --gpus {layout.gpus}: the GPUs form groups of --ep that exchange tokens, "
            "each GPU of a group holding its share of the experts."
        )
    if layout.zero == 0 and layout.ep != layout.dp:
        raise UserError(
            f"--ep {layout.ep} with DDP must equal --gpus {layout.gpus}: each expert then lives on one GPU, whose "
            "gradient the all-to-all's backward completes; experts repeated over gpus / ep GPUs need their gradients "
            "reduced over those, which torchtitan's FSDP2 does (--zero 2 or 3)."
        )
    if layout.zero and getattr(config, "tie_word_embeddings", False):
        raise UserError(
            "--ep with --zero 2/3 follows torchtitan's FSDP2 units, which group tied input and output embeddings with "
            "the final norm; that grouping is not modelled (not checked against a runtime): use --zero 0."
        )
    unchecked = {
        "--lora-r, --qlora": setup.lora or setup.quantize,
        "--grad-accum": setup.grad_accum > 1,
        "--keep-outputs, --accelerate-prepared": setup.keep_outputs or setup.accelerate_prepared,
    }
    used = [flag for flag, value in unchecked.items() if value]
    if used:
        raise UserError(f"{', '.join(used)} with --ep is not modelled yet (not checked against a runtime): drop it.")
    return routing_of(config, layout.ep, layout.routing_imbalance)


def _refuse_quantized_tensor_parallel(layout: Layout, setup: TrainingSetup) -> None:
    if setup.quantize and layout.tp > 1:
        flags = "--quantize" if setup.mode == "inference" else "--qlora, --load-in-8bit"
        raise UserError(
            f"Quantized base weights ({flags}) are not modelled with tensor parallelism: the parallel styles split "
            "nn.Linear weights, not bitsandbytes' packed ones. Use --tp 1."
        )


def _prepare_inference(layout: Layout, setup: TrainingSetup, config: PretrainedConfig | None) -> PreparedLayout:
    """Inference on one GPU, or tensor parallel over all of ``--gpus`` as transformers runs it."""
    if layout.cp > 1:
        raise UserError("--cp (torch's context_parallel) is modelled in training; drop it with --mode inference.")
    if layout.pp > 1:
        raise UserError(
            "--pp (torch.distributed.pipelining) is modelled in training; with --mode inference, --device-map auto "
            "spreads the layers over the GPUs as accelerate runs them (or --tp N splits each layer)."
        )
    if layout.routing_imbalance != 1:
        raise UserError(
            "--routing-imbalance applies to --ep in training: at inference each GPU runs its experts on every routed "
            "token, masked or not (AllReduceEP), whatever the routing."
        )
    if layout.ep not in (1, layout.tp):
        raise UserError(
            f"--ep {layout.ep} at inference must equal --tp {layout.tp}: transformers runs expert parallelism over the "
            "tensor-parallel GPUs, which share each batch (AllReduceEP)."
        )
    if layout.tp != layout.gpus or layout.zero or layout.offload or layout.sequence_parallel:
        raise UserError(
            "--mode inference is modelled on one GPU, or tensor parallel over all of them (--gpus N --tp N, "
            'transformers\' tp_plan="auto"): drop --zero, --offload and --sequence-parallel (a data-parallel replica '
            "serving its own requests needs what one GPU needs)."
        )
    if layout.tp == 1:
        return PreparedLayout(layout, setup, setup)
    _refuse_quantized_tensor_parallel(layout, setup)
    if not setup.dequantize:
        refuse_with_tensor_parallelism(config)
    expert_parallel = layout.ep > 1  # the model's ep_plan is read when the rank is traced (tracer/expert_parallel.py)
    tensor = TensorParallel.for_inference(layout.tp, expert_parallel)
    if config is not None:
        tensor.check(config)
    traced = dataclasses.replace(setup, expert_parallel=layout.ep) if expert_parallel else setup
    assumptions = {"layout": layout.describe(), "tensor_parallel": tensor.note}
    return PreparedLayout(layout, setup, traced, tensor, assumptions=assumptions)
