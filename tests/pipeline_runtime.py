"""PyTorch's pipeline-parallel runtime, ``torch.distributed.pipelining`` (``PipelineStage`` with ``ScheduleGPipe``,
``Schedule1F1B`` or ``ScheduleInterleaved1F1B``), run for one rank of P on CPU with a fake process group: the
reference the per-rank estimate is checked against. Real CPU tensors, every storage counted by the project's
recorder from before the step (parameters, optimizer states, the batch and the stages' receive buffers) to its last
reference, the third step measured; torch's MemTracker and a run under FakeTensorMode count the same bytes.

The model is split as torchtitan splits its Llama (``pipeline_llama_manual_split``): contiguous layers, the first
stages taking one more; stage 0 also holds the token embedding, the last the final norm and the lm_head. Each
stage runs transformers' decoder layers as ``LlamaModel.forward`` does, positions, mask and rotary embedding
included; the last stage's loss is the model's own, over the microbatch, divided by their number (the loop's
accumulation, as torchtitan rescales it with ``scale_grads=False``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from unittest.mock import patch

import pytest
import torch
from runtimes import data_parallel, fake_process_group, reshard_argument, tensor_parallelize
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining import stage as stage_module
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor.parallel import loss_parallel
from torch.torch_version import TorchVersion
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers.masking_utils import create_causal_mask

from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank
from strategies.pipeline import LOOPED, layer_split
from strategies.tensor_parallel import megatron_plan
from tracer.baseline import register_baseline
from tracer.context_parallel import local_length
from tracer.graph import StepGraph, build_graph
from tracer.inference import CACHE_KWARG
from tracer.materialize import initialize, materialize
from tracer.modules import ModuleScope, model_structure
from tracer.recorder import StepRecorder
from tracer.resolve import ResolvedModel
from tracer.roles import Phase, Role
from tracer.step import Batch, TrainingStep, build_optimizer, builds_on_meta, make_token_batch, optimizer_recipe
from tracer.trace import ModelStructure
from tracer.training import TrainingSetup

CPU = torch.device("cpu")
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class _Stage(nn.Module):
    """One stage of a transformers causal LM, as torchtitan's pruned copy of its model runs."""

    def __init__(self, causal_lm: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        base = causal_lm.model
        self.config = causal_lm.config
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        self.rotary_emb = type(base.rotary_emb)(config=causal_lm.config)  # each stage has its own
        self.norm = base.norm if last else None
        self.lm_head = causal_lm.lm_head if last else None
        self.autocast: torch.dtype | None = None  # mixed precision by autocast (without FSDP2's policy)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.autocast is None:
            return self._forward(h)
        with torch.autocast(h.device.type, dtype=self.autocast):
            return self._forward(h)

    def _forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, position_ids=positions, **{CACHE_KWARG: None}
        )
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if self.norm is not None:
            h = self.lm_head(self.norm(h))
        return h


@contextmanager
def _as_a_real_run() -> Iterator[None]:
    """Under the fake process group the schedule's warm-up vote receives zeros and would fall back to dynamic
    shape inference, which a run whose ranks all pass the same static metadata never does; and receives leave
    the buffers as ``empty`` made them, whose garbage would reach the weights (they are filled when made: the
    same allocation)."""

    def vote(self, stages, has_backward, p2p_done):
        from torch.distributed.pipelining._utils import InferenceMode

        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    make = stage_module._make_tensor_from_meta

    def make_filled(meta, device):
        tensor = make(meta, device)
        if tensor.is_floating_point():
            with torch.no_grad():
                tensor.uniform_(-1e-2, 1e-2)
        return tensor

    with ExitStack() as patches:
        if hasattr(_PipelineSchedule, "_warmup_p2p"):  # torch 2.13; before it, shapes were static without a vote
            patches.enter_context(patch.object(_PipelineSchedule, "_warmup_p2p", vote))
        patches.enter_context(patch.object(stage_module, "_make_tensor_from_meta", make_filled))
        yield


def _receive_buffers(stage: PipelineStage) -> Iterator[torch.Tensor]:
    """The stage's receive buffers. The first stage's model inputs are placeholders, without a buffer before torch
    2.13 (``_RootArgPlaceholder``) and with ``buffer=None`` from it."""
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        yield from (info.buffer for info in infos if getattr(info, "buffer", None) is not None)


class _LocalStorageRecorder(StepRecorder):
    """The recorder, counting what a rank holds: the tensor inside a wrapper subclass (a DTensor's local shard: the
    sharded parameters, gradients and optimizer states FSDP2 and tensor parallelism make, whose wrapper's own
    storage is the global size; the buffer a functional collective's AsyncCollectiveTensor wraps), and told
    about ``UntypedStorage.resize_``, which FSDP2 uses to free and re-allocate its unsharded parameters without
    the dispatcher seeing it: a resize ends the storage's record and a resize to a size starts a new one (as
    torch's MemTracker patches it, ``_track_resize``)."""

    def _storage_of(self, tensor: torch.Tensor, created_at: int | None):
        while is_traceable_wrapper_subclass(tensor):  # a DTensor, or a functional collective's async wrapper
            inner, _ = tensor.__tensor_flatten__()
            tensor = getattr(tensor, inner[0])
        return super()._storage_of(tensor, created_at)

    @contextmanager
    def recording(self) -> Iterator[StepRecorder]:
        resize = torch.UntypedStorage.resize_

        def tracked_resize(storage: torch.UntypedStorage, size: int):
            address = storage._cdata
            storage_id = self._live.pop(address, None)
            if storage_id is not None:
                self.storages[storage_id].freed_after = len(self.ops) - 1
                self._finalizers.pop(storage_id, None)
            result = resize(storage, size)
            if size > 0:
                tensor = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                self._storage_of(tensor, created_at=len(self.ops))
            return result

        with patch.object(torch.UntypedStorage, "resize_", tracked_resize), super().recording() as recorder:
            yield recorder


def recorded_third_step(
    model: ResolvedModel,
    setup: TrainingSetup,
    net: nn.Module,
    wrapped: nn.Module,
    buckets: dict[int, torch.Tensor],
    around: Callable[[], AbstractContextManager] = nullcontext,
) -> StepGraph:
    """Run two steps of ``wrapped`` (``net`` under its data-parallel runtime, if any), then record the third,
    counting ``buckets`` (DDP's) from before it. Each step runs inside ``around()``, which is entered above the
    recorder so that the recorder sees the ops it runs."""
    step = TrainingStep(wrapped, build_optimizer(net, setup, foreach=None), loss_fn=model.loss_fn)
    if setup.autocast_dtype is not None:
        step.autocast = partial(torch.autocast, "cpu", dtype=setup.autocast_dtype)
    batch = model.batch(setup, "cpu")
    with around():
        step.run(batch)
        step.run(batch)
    recorder = _LocalStorageRecorder(ModuleScope(net), device_type="cpu")
    register_baseline(recorder, step, batch, step_counters_on_host=False)
    for index, buffer in buckets.items():
        recorder.track_existing(buffer, Role.COMMUNICATION, f"DDP bucket {index}")
    with recorder.recording(), around():
        step.run(batch, recorder.enter)
    return build_graph(recorder.trace())


def _stage_structure(model: ResolvedModel, layers: range, first: bool, last: bool) -> ModelStructure:
    """The stage module's structure, its transformers TP plan named as the stage names its modules."""
    with torch.device("meta"):
        structure = model_structure(model.build(TrainingSetup()))
    prefix = structure.blocks[0].rpartition(".")[0] + "."
    return ModelStructure(
        blocks=tuple(f"layers.{i}" for i in layers),
        input_embedding="embed_tokens" if first else "",
        output_embedding="lm_head" if last else None,
        tp_plan={pattern.replace(prefix, "layers.", 1): style for pattern, style in structure.tp_plan.items()},
        model_class=structure.model_class,
    )


def _parallelize(
    module: _Stage,
    structure: ModelStructure,
    layout: Layout,
    rank: Rank,
    mesh: DeviceMesh,
    replicas: DeviceMesh,
    mixed_precision: bool,
    materialize_on: torch.device | None,
) -> tuple[nn.Module, dict[int, torch.Tensor]]:
    """torchtitan's order, on a stage built on the meta device (or, with quantized base weights, on the device):
    tensor parallelism on the stage's modules, then its data parallelism (FSDP2 on each decoder layer and the
    stage, ``reshard_after_forward`` as ``--zero`` asks, bf16 compute and float32 reduction with
    ``mixed_precision``; DDP; or DDP with ZeroRedundancyOptimizer, whose optimizer the caller builds) over
    ``replicas``, the data- and context-parallel ranks. A meta stage gets its storage on ``materialize_on`` once
    sharded (before DDP, which needs it). Returns the module the stage runs and DDP's bucket buffers."""
    if layout.tp > 1:
        plan = megatron_plan(structure, layout.tp, rank.tp, gathered_output=layout.tp_output == "gathered")
        tensor_parallelize(module, mesh["tp"], plan)
    sharded = layout.replicas > 1 and layout.zero >= 2
    if sharded:
        reshard = reshard_argument(layout.zero == 3)
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()
        for block in structure.blocks:
            fully_shard(module.get_submodule(block), mesh=replicas, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(module, mesh=replicas, reshard_after_forward=reshard, mp_policy=policy)
    if materialize_on is not None:
        materialize(module, materialize_on)
    if layout.replicas == 1 or sharded:
        return module, {}
    return data_parallel(module, replicas.get_group())


def ring_attention(group) -> AbstractContextManager:
    """Context parallelism's ring attention over ``group``, as tests/cp_runtime.py runs it (imported here when
    asked for: that module builds on this one's recorder)."""
    from cp_runtime import RingDispatch

    return RingDispatch(group)


@contextmanager
def _refused_by_torch_2_11() -> Iterator[None]:
    """Skips what torch 2.11's own runtimes refuse (torch 2.13 runs both): a stage that computes in bf16 under
    autocast, whose outputs its shape check expects in the inputs' float32, and FSDP2 over a tensor-parallel
    stage's ``_StridedShard`` placements."""
    try:
        yield
    except (RuntimeError, ValueError) as error:  # PipeliningShapeError is a RuntimeError
        refused = "dtype mismatch" in str(error) or "_StridedShard" in str(error)
        if refused and TorchVersion(torch.__version__) < (2, 12):
            pytest.skip(f"torch {torch.__version__}'s runtime refuses this layout: {error}")
        raise


@dataclass
class PipelineRank:
    """One pipeline rank built as torchtitan builds it, ready to step: its stages' modules, their
    ``PipelineStage``s and DDP buckets, the optimizer over them, and the whole batch every rank loads."""

    modules: nn.ModuleDict
    pipelines: list[PipelineStage]
    stage_buckets: list[dict[int, torch.Tensor]]  # DDP's, filled as each stage's reducer runs
    optimizer: torch.optim.Optimizer
    batch: Batch
    step: Callable[..., None]  # step(on_phase): schedule.step, then the optimizer's step and zero_grad


@contextmanager
def pipeline_rank(
    model: ResolvedModel, setup: TrainingSetup, layout: Layout, rank: Rank, device: torch.device = CPU
) -> Iterator[PipelineRank]:
    """``rank`` of ``layout`` (its stages, ``layout.rank_stages(rank)``, composed with the layout's tensor and data
    parallelism) on ``device``, inside a fake process group of ``layout.gpus`` ranks: each step runs
    ``layout.stage_microbatches`` microbatches of ``setup.batch_size``."""
    config = model.config
    ranks, mbs = layout.pp, layout.stage_microbatches
    stage_count = ranks * layout.stages_per_rank
    stages = layout.rank_stages(rank)
    first, last = 0 in stages, stage_count - 1 in stages
    with fake_process_group(layout.gpus, rank.global_rank(layout)), _as_a_real_run(), _refused_by_torch_2_11():
        shape_of_mesh = (ranks, layout.dp, layout.cp, layout.tp)
        mesh = init_device_mesh(device.type, shape_of_mesh, mesh_dim_names=("pp", "dp", "cp", "tp"))
        replicas = mesh["dp", "cp"]._flatten("dp_cp") if layout.cp > 1 else mesh["dp"]
        setup = dataclasses.replace(setup, seq_len=local_length(setup.seq_len, layout.cp))  # the rank's tokens
        torch.manual_seed(0)
        sharded_mixed = layout.zero >= 2 and layout.replicas > 1 and setup.mixed_precision is not None
        if sharded_mixed:  # FSDP2's MixedPrecisionPolicy over float32 weights, not autocast
            setup = dataclasses.replace(setup, mixed_precision=None)
        on_meta = builds_on_meta(config, setup)
        with torch.device("meta") if on_meta else device:
            causal_lm = model.build(setup)
        causal_lm = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
        # What passes between stages: the weights' dtype, or the low-precision one FSDP2's policy computes in.
        dtype = torch.bfloat16 if sharded_mixed else next(causal_lm.parameters()).dtype
        model_loss = causal_lm.loss_function  # transformers' ForCausalLMLoss: shifts the labels itself
        split = layer_split(config.num_hidden_layers, stage_count, layout.pp_split)
        modules = nn.ModuleDict(
            {str(stage): _Stage(causal_lm, split[stage], stage == 0, stage == stage_count - 1) for stage in stages}
        )
        pipelines, stage_buckets = [], []
        shape = (setup.batch_size, setup.seq_len)
        storage = device if on_meta else None
        for stage in stages:
            module = modules[str(stage)]
            structure = _stage_structure(model, split[stage], stage == 0, stage == stage_count - 1)
            wrapped, buckets = _parallelize(module, structure, layout, rank, mesh, replicas, sharded_mixed, storage)
            stage_buckets.append(buckets)
            module.autocast = setup.autocast_dtype
            inputs = (
                torch.empty(shape, dtype=torch.long, device="meta")
                if stage == 0
                else torch.empty(*shape, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
            )
            width = config.vocab_size if stage == stage_count - 1 else config.hidden_size
            outputs = torch.empty(*shape, width, dtype=dtype, device="meta", requires_grad=True)
            pipelines.append(
                PipelineStage(
                    wrapped,
                    stage,
                    stage_count,
                    device,
                    input_args=inputs,
                    output_args=outputs,
                    group=mesh["pp"].get_group(),
                )
            )
        if on_meta:
            initialize(causal_lm)  # its other stages' layers stay on the meta device
        del causal_lm
        if layout.zero == 1:
            optimizer_class, arguments = optimizer_recipe(setup)
            params = [p for p in modules.parameters() if p.requires_grad]
            optimizer = ZeroRedundancyOptimizer(params, optimizer_class, replicas.get_group(), **arguments)
        else:
            optimizer = build_optimizer(modules, setup, foreach=None)

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return model_loss(logits=logits, labels=labels, vocab_size=config.vocab_size) / mbs

        schedule_class = SCHEDULES[layout.pp_schedule]
        stage_or_stages = pipelines if layout.pp_schedule in LOOPED else pipelines[0]
        schedule_run = schedule_class(stage_or_stages, n_microbatches=mbs, loss_fn=loss_fn, scale_grads=False)
        whole = dataclasses.replace(setup, batch_size=setup.batch_size * mbs)  # every rank loads the whole batch
        batch = make_token_batch(config.vocab_size, whole, device)

        parallel_loss = layout.tp > 1 and layout.tp_output == "parallel"
        ring = ring_attention(mesh["cp"].get_group()) if layout.cp > 1 else nullcontext()

        def step(on_phase=lambda phase: None) -> None:
            on_phase(Phase.FORWARD)
            args = (batch.input_ids,) if first else ()
            target = batch.labels if last else None
            with loss_parallel() if parallel_loss else nullcontext(), ring:
                schedule_run.step(*args, target=target, losses=[] if last else None, return_outputs=False)
            on_phase(Phase.OPTIMIZER)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        yield PipelineRank(modules, pipelines, stage_buckets, optimizer, batch, step)


def pipeline_peak(model: ResolvedModel, setup: TrainingSetup, layout: Layout, rank: Rank) -> int:
    """Peak tensor bytes of ``rank`` over its third step on CPU, every storage counted from before the step."""
    with pipeline_rank(model, setup, layout, rank) as built:
        built.step()
        built.step()
        modules, optimizer = built.modules, built.optimizer
        recorder = _LocalStorageRecorder(ModuleScope(modules), device_type="cpu")
        names = {id(param): name for name, param in modules.named_parameters()}
        for name, param in modules.named_parameters():
            recorder.track_existing(param, Role.PARAMETER, name)
        for name, buffer in modules.named_buffers():
            recorder.track_existing(buffer, Role.BUFFER, name)
        states = optimizer.optim.state if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer.state
        for param, state in states.items():
            for key, value in state.items():
                recorder.track_existing(value, Role.OPTIMIZER_STATE, f"{names[id(param)]}.{key}", names[id(param)])
        recorder.track_existing(built.batch.input_ids, Role.INPUT, "input_ids")
        recorder.track_existing(built.batch.labels, Role.INPUT, "labels")
        stages = layout.rank_stages(rank)
        for stage, buckets in zip(stages, built.stage_buckets, strict=True):
            for index, buffer in buckets.items():
                recorder.track_existing(buffer, Role.COMMUNICATION, f"DDP bucket {index} of stage {stage}")
        received = [buffer for pipeline in built.pipelines for buffer in _receive_buffers(pipeline)]
        for index, buffer in enumerate(received):
            recorder.track_existing(buffer, Role.COMMUNICATION, f"receive buffer {index}")
        with recorder.recording():
            built.step(recorder.enter)
        return find_peak(timeline(build_graph(recorder.trace()), rounded=False)).bytes
