"""PyTorch's own distributed runtimes, run for one rank of N on CPU with a fake process group under
FakeTensorMode, and the peak their memory trackers report. The references the strategies are checked
against."""

from __future__ import annotations

import dataclasses
import inspect
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import cache, partial
from types import SimpleNamespace
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools import mod_tracker
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _ModState
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard, _redistribute, _sharding_prop
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

from analysis.allocator import block_size
from analysis.measure import Generation
from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank
from strategies.tensor_parallel import (
    COLWISE,
    COLWISE_GATHER_OUTPUT,
    EMBEDDING_ROWWISE,
    MLA_KV_A_PROJ,
    ROWWISE,
    WHOLE_ACTIVATION_STYLES,
    TpPlan,
    expert_rules,
    megatron_plan,
)
from tracer.baseline import register_baseline
from tracer.graph import build_graph
from tracer.known_values import KnownValues
from tracer.meta_fixes import MetaFixes
from tracer.modules import ModuleScope, decoder_blocks, model_structure, plan_pattern
from tracer.quantization import Linear4bit
from tracer.recorder import StepRecorder
from tracer.resolve import Model, ResolvedModel
from tracer.roles import Phase, Role
from tracer.step import (
    TrainingStep,
    batch_tensors,
    build_model,
    build_optimizer,
    make_batch,
    optimizer_recipe,
    output_slots,
)
from tracer.tracing import as_eager
from tracer.training import TrainingSetup


@contextmanager
def fake_process_group(world: int, rank: int) -> Iterator[None]:
    """A fake process group in which this process is ``rank``. DTensor caches sharding decisions, which
    hold local shapes, by placement only: they are dropped so that another rank's are not reused."""
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute._gen_transform_infos.cache_clear()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _real_mesh(build: Callable[..., DeviceMesh]) -> Callable[..., DeviceMesh]:
    def build_outside_fake_mode(*args, **kwargs) -> DeviceMesh:
        with unset_fake_temporarily():
            return build(*args, **kwargs)

    return build_outside_fake_mode


def _peak_of_step(*args, **options) -> int:
    """The peak of :func:`_tracked_step` (its arguments)."""
    return _total_peak(_tracked_step(*args, **options)[0])


def _total_peak(tracker: MemTracker) -> int:
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _module_peaks(tracker: MemTracker, net: nn.Module, module: str) -> tuple[int, int]:
    """The most memory MemTracker saw while ``module`` ran its (last) forward and its backward."""
    snapshots = tracker.memory_tracking[net.get_submodule(module)].snapshots
    cpu = torch.device("cpu")
    return snapshots[_ModState.PEAK_FW][-1][cpu]["Total"], snapshots[_ModState.PEAK_BW][-1][cpu]["Total"]


def _tracked_step(
    model: Model,
    setup: TrainingSetup,
    parallelize: Callable[[nn.Module], None],
    context: Callable[[], AbstractContextManager] = nullcontext,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> tuple[MemTracker, nn.Module]:
    """Build under FakeTensorMode, parallelize, run two steps, and track the third with MemTracker (or
    FSDPMemTracker when FSDP wraps the model), which counts DTensor's local tensors; the tracker and the model.

    DTensor computes output shapes by running each op on fake global-shape tensors, in the fake mode it
    finds active; on a GPU that is a mode of its own and allocates nothing, so it is made one here too.
    transformers is told, as in the trace, that fake tensors do not mean graph tracing (``as_eager``).
    FSDP2 on a tensor-parallel model builds a device mesh, whose ranks are a small real tensor, so that is
    done outside the fake mode."""
    with (
        FakeTensorMode(),
        MetaFixes(),
        KnownValues(),
        as_eager(),
        patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None),
        patch.object(DeviceMesh, "_concatenate", staticmethod(_real_mesh(DeviceMesh._concatenate))),
    ):
        torch.manual_seed(0)
        net = model.build(setup)
        parallelize(net)
        optimizer = build_optimizer(net, setup, foreach=None)
        step = TrainingStep(wrap(net) if wrap else net, optimizer, loss_fn=model.loss_fn)
        if setup.autocast_dtype is not None:
            step.autocast = partial(torch.autocast, "cpu", dtype=setup.autocast_dtype)
        batch = model.batch(setup, "cpu")
        micro_steps = setup.grad_accum
        with context():
            step.run(batch, micro_steps=micro_steps)
            step.run(batch, micro_steps=micro_steps)
            tracker = _tracker(net, step.optimizer, batch)
            with tracker:
                step.run(batch, partial(_new_pass, tracker), micro_steps)
        return tracker, net


class _ReleasingGradHooks:
    """A memory tracker that frees what a GPU run frees between micro-steps. ModTracker puts
    ``register_multi_grad_hook(mode="all")`` on every module's inputs and never removes it; the hook's closure
    forms a cycle with the autograd graph, which then outlives backward, and with it a leaf input that requires
    grad (the embedding output transformers' ``enable_input_require_grads`` makes under checkpointing) and that
    leaf's ``.grad`` (pytorch/pytorch#139214). The hooks are removed at ``reset_mod_stats``, which the references
    call after each micro-step's backward."""

    def __enter__(self):
        self._grad_hooks: list = []
        register = mod_tracker.register_multi_grad_hook

        def register_and_keep(*args, **kwargs):
            handle = register(*args, **kwargs)
            self._grad_hooks.append(handle)
            return handle

        self._patched = patch.object(mod_tracker, "register_multi_grad_hook", register_and_keep)
        self._patched.start()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patched.stop()

    def reset_mod_stats(self) -> None:
        while self._grad_hooks:
            self._grad_hooks.pop().remove()
        super().reset_mod_stats()


class _SkippingShardingPropagation:
    """A memory tracker that leaves out the ops DTensor's sharding propagation runs in a fake mode of its own: their
    global-shape outputs allocate nothing on a GPU. torch 2.13's MemTracker and FSDPMemTracker skip them (they track
    only ops under the fake mode active when they were entered, ``_fake_mode_on_entry``); torch 2.11's counted them,
    one tensor the size of the rank's logits more in a ``loss_parallel()`` backward (+2.4% on a tiny Llama at TP 2)."""

    def __enter__(self):
        self._entry_fake_mode = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if active_fake_mode() is not self._entry_fake_mode and not any(t == DTensor for t in types):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _MemTracker(_SkippingShardingPropagation, _ReleasingGradHooks, MemTracker):
    pass


class _FsdpMemTracker(_SkippingShardingPropagation, _ReleasingGradHooks, FSDPMemTracker):
    pass


def _tracker(net: nn.Module, optimizer: torch.optim.Optimizer, batch) -> MemTracker:
    if isinstance(net, FSDPModule):
        tracker = _FsdpMemTracker(net, optimizer)
        tracker.track_inputs(tuple(tensor for _, tensor in batch_tensors(batch)))
    else:
        tracker = _MemTracker()
        tracker.track_external(net, optimizer, *(tensor for _, tensor in batch_tensors(batch)))
    return tracker


def _new_pass(tracker: MemTracker, phase: Phase) -> None:
    """FSDPMemTracker refuses a second forward through a module it has stats for; its module stats are
    dropped before each micro-step's forward (the peak it reports is kept)."""
    if phase is Phase.FORWARD:
        tracker.reset_mod_stats()


def reshard_argument(after_forward: bool) -> bool | None:
    """``fully_shard``'s argument: its default (None) reshards every module but the root after forward,
    which is ZeRO-3 as FSDP2 runs it; False keeps them all unsharded (ZeRO-2)."""
    return None if after_forward else False


def fsdp2_peak(
    model: Model,
    setup: TrainingSetup,
    world: int,
    rank: int = 0,
    mixed_precision: bool = False,
    reshard_after_forward: bool = True,
) -> int:
    """``fully_shard`` on every decoder layer and on the root; fp32 model, or bf16 compute with fp32 reduce."""
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()
    reshard = reshard_argument(reshard_after_forward)
    integer_parameters_shard = fully_shard_takes_integer_parameters()

    with fake_process_group(world, rank):
        mesh: DeviceMesh = init_device_mesh("cpu", (world,))  # outside FakeTensorMode: it reads its ranks

        def parallelize(net: nn.Module) -> None:
            if not integer_parameters_shard:
                store_packed_in_compute_dtype(net)
            for block in decoder_blocks(net):
                fully_shard(net.get_submodule(block), mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
            fully_shard(net, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)

        return _peak_of_step(model, setup, parallelize)


@cache
def fully_shard_takes_integer_parameters() -> bool:
    """Whether this torch's ``fully_shard`` shards a frozen integer parameter, such as bitsandbytes' packed 4-bit
    weights in their default uint8 storage or LLM.int8()'s int8 ones, tried on one rank. torch 2.13 makes the sharded
    parameter with the original's ``requires_grad``; 2.11 (``FSDPParam._init_sharded_param``) makes it requiring a
    gradient first, which an integer tensor refuses (RuntimeError): there FSDP2 over QLoRA weights needs them stored
    in a floating dtype, and over LLM.int8() weights, which have no such storage, does not run."""
    probe = nn.Module()
    probe.packed = nn.Parameter(torch.zeros(1, 1, dtype=torch.uint8), requires_grad=False)
    with fake_process_group(1, 0):
        try:
            fully_shard(probe, mesh=init_device_mesh("cpu", (1,)))
        except RuntimeError:
            return False
    return True


def store_packed_in_compute_dtype(net: nn.Module) -> None:
    """Each packed 4-bit weight stored in its layer's compute dtype, as the FSDP-QLoRA recipes of transformers and
    peft set ``bnb_4bit_quant_storage``: the same bytes, in (numel + 1) // (2 * itemsize) rows of one element
    (bitsandbytes' ``quantize_4bit``)."""
    for module in net.modules():
        if isinstance(module, Linear4bit):
            dtype = module.compute_dtype
            rows = (module.logical_weight_numel + 1) // (2 * dtype.itemsize)
            module.weight = nn.Parameter(module.weight.new_empty((rows, 1), dtype=dtype), requires_grad=False)


def tensor_parallelize(net: nn.Module, mesh: DeviceMesh, plan: TpPlan) -> None:
    """The estimate's plan applied to ``net``: ``parallelize_module`` with PyTorch's styles (:func:`dtensor_plan`),
    and transformers' own style classes where the plan's style is transformers' alone (:func:`transformers_rules`),
    as ``from_pretrained(tp_plan=...)`` applies them: ``apply_tensor_parallelism`` over the rules expanded to the
    model's modules and parameters. A tied output layer takes the embedding's weight again afterwards, as
    ``from_pretrained`` ties it once the model is sharded: ``parallelize_module`` gives each module its own shard
    of the one weight (both shard the vocabulary), which would hold it, its gradient and its optimizer states
    twice."""
    parallelize_module(net, mesh, dtensor_plan(plan, net))
    _apply_transformers_rules(net, mesh, _expanded(transformers_rules(plan), net))
    if getattr(getattr(net, "config", None), "tie_word_embeddings", False) and net.get_output_embeddings() is not None:
        net.get_output_embeddings().weight = net.get_input_embeddings().weight


def _apply_transformers_rules(net: nn.Module, mesh: DeviceMesh, rules: dict[str, str]) -> None:
    """``apply_tensor_parallelism`` over ``rules`` (module and parameter names). transformers 5.24 takes them as an
    argument; 5.17 (``apply_tensor_parallelism(model, tp_mesh)``) reads the model's ``tp_plan``, whose keys it
    matches with each layer number written as ``*``: there the rules are set as the plan, in that form, while it
    runs."""
    if len(inspect.signature(apply_tensor_parallelism).parameters) > 2:
        apply_tensor_parallelism(net, mesh, rules)
        return
    if not rules:  # nothing for transformers to run (a model of the user's own has no tp_plan to read)
        return
    previous = net._tp_plan
    net._tp_plan = {re.sub(r"\.\d+(\.|$)", r".*\1", name): style for name, style in rules.items()}
    try:
        apply_tensor_parallelism(net, mesh)
    finally:
        net._tp_plan = previous


def transformers_rules(plan: TpPlan) -> dict[str, str]:
    """The rules run by transformers' classes: the MoE experts' (``MoeExpertsParallel``, and ``PackedColwiseParallel``
    and ``RowwiseParallel`` on their 3-D weights), which PyTorch has no style for, and the decoder layers' gathered
    projections (``colwise_gather_output``, ``rowwise_split_input``: transformers' DTensor ``ColwiseParallel`` and
    ``RowwiseParallel`` with replicated outputs or inputs), and multi-head latent attention's latent projection
    (``mla_kv_a_proj``: ``MlaKvAProjParallel``)."""
    gathered = {p: s for p, s in plan.styles.items() if s in WHOLE_ACTIVATION_STYLES and p != plan.output_embedding}
    latent = {p: s for p, s in plan.styles.items() if s == MLA_KV_A_PROJ}
    return expert_rules(plan.styles) | gathered | latent


def _expanded(rules: dict[str, str], net: nn.Module) -> dict[str, str]:
    """transformers' ``_expand_parallel_plan`` on any module: each module's parameters, by their own rule or else the
    module's, then the module."""

    def rule(name: str) -> str | None:
        return next((style for pattern, style in rules.items() if plan_pattern(pattern).fullmatch(name)), None)

    expanded = {}
    for name, module in net.named_modules():
        style = rule(name)
        for param, _ in module.named_parameters(recurse=False):
            if param_style := rule(f"{name}.{param}") or style:
                expanded[f"{name}.{param}"] = param_style
        if style:
            expanded[name] = style
    return expanded


def dtensor_plan(plan: TpPlan, net: nn.Module) -> dict[str, ParallelStyle]:
    """The estimate's plan as DTensor styles. With sequence parallelism, as torchtitan lays it out: the
    embedding and row-wise layers reduce-scatter into sequence slices, norms run on them, and the attention,
    the MLP and the lm_head gather their input (the gathered input stays a DTensor, so that the input
    gradients of q, k and v add up before one reduce-scatter)."""
    sequence = Shard(1) if plan.sequence_length else Replicate()
    styles = {
        COLWISE: ColwiseParallel(),
        ROWWISE: RowwiseParallel(output_layouts=sequence),
        EMBEDDING_ROWWISE: RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence),
        COLWISE_GATHER_OUTPUT: ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()),
    }
    own = transformers_rules(plan)  # transformers' classes run them (tensor_parallelize)
    styles_by_module = {pattern: styles[style] for pattern, style in plan.styles.items() if pattern not in own}
    if plan.output_embedding and plan.styles[plan.output_embedding] == COLWISE:  # feeding loss_parallel()
        styles_by_module[plan.output_embedding] = ColwiseParallel(
            input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False
        )
    if plan.sequence_length:
        for name, module in net.named_modules():
            if "Norm" in type(module).__name__:
                styles_by_module[name] = SequenceParallel(use_local_output=True)
        for pattern, style in plan.styles.items():
            if style == COLWISE and "*" in pattern:
                styles_by_module[pattern.rpartition(".")[0]] = _GatherSequence()
    return styles_by_module


class _GatherSequence(ParallelStyle):
    """``PrepareModuleInput`` for the first input (``hidden_states``), however the module is called:
    ``Shard(1)`` redistributed to ``Replicate()``, left a DTensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if "hidden_states" in kwargs:
                kwargs = kwargs | {"hidden_states": self._gathered(kwargs["hidden_states"], device_mesh)}
            else:
                args = (self._gathered(args[0], device_mesh), *args[1:])
            return args, kwargs

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module

    @staticmethod
    def _gathered(tensor: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        return DTensor.from_local(tensor, mesh, (Shard(1),), run_check=False).redistribute(placements=(Replicate(),))


class WithPositions(nn.Module):
    """Passes the positions: under sequence parallelism the model sees a slice of the sequence and would
    number its positions (and size its attention mask) from it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.model(input_ids, labels=labels, position_ids=positions, cache_position=positions[0])


def tensor_parallel_peak(model: Model, setup: TrainingSetup, degree: int, *args, **options) -> int:
    """The peak of :func:`_tensor_parallel_step` (its arguments)."""
    return _total_peak(_tensor_parallel_step(model, setup, degree, *args, **options)[0])


def tensor_parallel_module_peaks(model: Model, setup: TrainingSetup, degree: int, module: str) -> tuple[int, int]:
    """The most memory rank 0 of :func:`tensor_parallel_peak` holds while ``module`` runs forward, and backward."""
    tracker, net = _tensor_parallel_step(model, setup, degree)
    return _module_peaks(tracker, net, module)


def _tensor_parallel_step(
    model: Model,
    setup: TrainingSetup,
    degree: int,
    rank: int = 0,
    gathered_output: bool = False,
    data_parallel: int = 1,
    data_rank: int = 0,
    reshard_after_forward: bool = True,
    sequence_parallel: bool = False,
) -> tuple[MemTracker, nn.Module]:
    """``parallelize_module`` with the Megatron plan the estimate assumes (the lm_head's output left sliced
    for ``loss_parallel()``, or gathered; optionally sequence parallel), over ``degree`` ranks; with
    ``data_parallel`` > 1, FSDP2 over the other dimension of a 2-D mesh, mixed precision as its
    MixedPrecisionPolicy (bf16 compute over float32 weights, float32 reduction). The third step tracked: the
    tracker and the model."""
    world = degree * data_parallel
    policy = MixedPrecisionPolicy()
    if data_parallel > 1 and setup.mixed_precision is not None:
        setup = dataclasses.replace(setup, mixed_precision=None)
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    with fake_process_group(world, data_rank * degree + rank):
        mesh = init_device_mesh("cpu", (data_parallel, degree), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            structure = model_structure(model.build(setup))
        sequence_length = setup.seq_len if sequence_parallel else None
        plan = megatron_plan(structure, degree, rank, gathered_output, sequence_length)

        def parallelize(net: nn.Module) -> None:
            tensor_parallelize(net, mesh["tp"], plan)
            if data_parallel > 1:
                reshard = reshard_argument(reshard_after_forward)
                shard = partial(fully_shard, mesh=mesh["dp"], reshard_after_forward=reshard, mp_policy=policy)
                for block in structure.blocks:
                    shard(net.get_submodule(block))
                shard(net)

        context = nullcontext if gathered_output else loss_parallel
        wrap = WithPositions if sequence_parallel else None
        return _tracked_step(model, setup, parallelize, context, wrap)


def data_parallel(
    net: nn.Module, group: dist.ProcessGroup | None = None
) -> tuple[DistributedDataParallel, dict[int, torch.Tensor]]:
    """``DistributedDataParallel(net)`` with a pass-through communication hook that hands back each bucket's flat
    buffer (the fake process group's all-reduce returns none), and the buffers by bucket index, which the reducer
    keeps for the module's life."""
    ddp = DistributedDataParallel(net, process_group=group)
    buckets: dict[int, torch.Tensor] = {}

    def keep_bucket(state, bucket):  # unannotated: DDP checks annotations, which are strings here
        buckets[bucket.index()] = bucket.buffer()
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, keep_bucket)
    return ddp, buckets


def ddp_peak(model: Model, setup: TrainingSetup, world: int, rank: int = 0, zero_redundancy: bool = False) -> int:
    """``DistributedDataParallel`` with its defaults, on real CPU tensors (its reducer is C++ and does not run
    on fake ones); with ``zero_redundancy``, its optimizer wrapped in ``ZeroRedundancyOptimizer`` (ZeRO-1).
    A pass-through communication hook hands back each bucket's flat buffer, which the recorder counts from
    before the step as the reducer keeps it for the module's life."""
    with fake_process_group(world, rank):
        torch.manual_seed(0)
        net = model.build(setup)
        ddp, buckets = data_parallel(net)
        if zero_redundancy:
            optimizer_class, arguments = optimizer_recipe(setup)
            trainable = [p for p in net.parameters() if p.requires_grad]
            optimizer = ZeroRedundancyOptimizer(trainable, optimizer_class, **arguments)
        else:
            optimizer = build_optimizer(net, setup, foreach=None)
        step = TrainingStep(ddp, optimizer, loss_fn=model.loss_fn)
        batch = model.batch(setup, "cpu")
        micro_steps = setup.grad_accum
        step.run(batch, micro_steps=micro_steps)
        step.run(batch, micro_steps=micro_steps)  # the reducer rebuilds its buckets in gradient-ready order
        recorder = StepRecorder(ModuleScope(net), device_type="cpu")
        register_baseline(recorder, step, batch, step_counters_on_host=False)
        if zero_redundancy:  # the states live in the rank's local optimizer
            for states in optimizer.optim.state.values():
                for name, value in states.items():
                    recorder.track_existing(value, Role.OPTIMIZER_STATE, name)
        for index, buffer in buckets.items():
            recorder.track_existing(buffer, Role.COMMUNICATION, f"bucket {index}")
        with recorder.recording():
            step.run(batch, recorder.enter, micro_steps)
        return find_peak(timeline(build_graph(recorder.trace()), rounded=False)).bytes


def runtime_peak(model: Model, setup: TrainingSetup, layout: Layout, rank: Rank) -> int | None:
    """The runtime the layout stands for, run for ``rank``; None where none runs here (DeepSpeed, and DDP
    over tensor-parallel DTensors). Mixed precision under FSDP2 is its MixedPrecisionPolicy."""
    if layout.engine == "deepspeed" or (layout.tp > 1 and layout.zero < 2 and layout.dp > 1):
        return None
    if layout.pp > 1:  # its stages run context parallelism's ring themselves
        from pipeline_runtime import pipeline_peak  # it runs on this module's fake process group

        return pipeline_peak(model, setup, layout, rank)
    if layout.cp > 1:
        from cp_runtime import context_parallel_peak  # it runs on this module's fake process group

        return context_parallel_peak(model, setup, layout) if rank == Rank() else None
    if layout.tp > 1:
        return tensor_parallel_peak(
            model,
            setup,
            layout.tp,
            rank.tp,
            gathered_output=layout.tp_output == "gathered",
            data_parallel=layout.dp,
            data_rank=rank.dp,
            reshard_after_forward=layout.zero == 3,
            sequence_parallel=layout.sequence_parallel,
        )
    if layout.zero < 2:
        return ddp_peak(model, setup, layout.dp, rank.dp, zero_redundancy=layout.zero == 1)
    fp32 = dataclasses.replace(setup, mixed_precision=None)
    mixed = setup.mixed_precision is not None
    return fsdp2_peak(model, fp32, layout.dp, rank.dp, mixed, reshard_after_forward=layout.zero == 3)


def trainer_peak(model: ResolvedModel, setup: TrainingSetup, **arguments) -> int:
    """The Hugging Face Trainer's own loop (``Trainer.train``: accelerate's wrapping, the loss, gradient
    clipping, ``model.zero_grad()``) on real CPU tensors, its third optimizer step tracked with MemTracker from
    a callback. ``arguments``: TrainingArguments, e.g. ``bf16=True, optim="adamw_torch_fused"``."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    net = build_model(model.config, setup)
    ids = make_batch(model.config, dataclasses.replace(setup, batch_size=1), "cpu").input_ids[0]
    micro_steps = arguments.get("gradient_accumulation_steps", 1)
    data = [{"input_ids": ids, "labels": ids.clone()}] * (setup.batch_size * micro_steps * 3)
    peaks: list[int] = []

    class TrackThirdStep(TrainerCallback):
        tracker: MemTracker | None = None

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            if state.global_step == 2:
                self.tracker = _FrozenAwareMemTracker()
                self.tracker.track_external(net, optimizer)
                self.tracker.__enter__()

        def on_substep_end(self, args, state, control, **kwargs):
            if self.tracker is not None and not peaks:  # a micro-step of accumulation: MemTracker keeps the peak
                self.tracker.reset_mod_stats()

        def on_step_end(self, args, state, control, **kwargs):
            if self.tracker is not None and not peaks:
                self.tracker.__exit__(None, None, None)
                peaks.append(self.tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])

    with tempfile.TemporaryDirectory() as output:
        args = TrainingArguments(
            output_dir=output,
            per_device_train_batch_size=setup.batch_size,
            max_steps=3,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            remove_unused_columns=False,
            **arguments,
        )
        Trainer(model=net, args=args, train_dataset=data, callbacks=[TrackThirdStep()]).train()
    return peaks[0]


class _FrozenAwareMemTracker(_ReleasingGradHooks, MemTracker):
    """MemTracker without the gradient hooks it would put on frozen parameters (peft's base), which refuse hooks
    and never get a gradient; the hooks only label gradients, the totals do not depend on them."""

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        no_hook = SimpleNamespace(remove=lambda: None)
        for param in module.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (no_hook, no_hook))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def accelerate_loop_peak(model: ResolvedModel, setup: TrainingSetup, mixed_precision: str = "no") -> int:
    """The loop of accelerate's examples (examples/nlp_example.py): ``outputs = model(**batch); loss =
    outputs.loss; accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()``, ``outputs`` alive until
    the next forward returns; its third step tracked with MemTracker."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    torch.manual_seed(0)
    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton: another run set it
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    net = build_model(model.config, setup)
    optimizer_class, arguments = optimizer_recipe(setup)
    net, optimizer = accelerator.prepare(net, optimizer_class(net.parameters(), **arguments))
    batch = make_batch(model.config, setup, "cpu")
    outputs = None
    tracker = _FrozenAwareMemTracker()
    for step in range(3):
        if step == 2:  # what the previous step's outputs hold is live when this one starts
            tracker.track_external(net, optimizer, batch.input_ids, batch.labels, *_tensors_of(outputs))
            tracker.__enter__()
        outputs = model_outputs = net(input_ids=batch.input_ids, labels=batch.labels)
        accelerator.backward(model_outputs.loss)
        optimizer.step()
        optimizer.zero_grad()
        del model_outputs
    tracker.__exit__(None, None, None)
    del outputs
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _tensors_of(outputs) -> list[torch.Tensor]:
    """The tensors a model output holds: its fields, and the keys and values of its cache."""
    return [getattr(holder, attribute) for *_, holder, attribute in output_slots(outputs)]


# transformers' expert parallelism at inference as the estimate models it: DistributedConfig(tp_size=N, ep_size=N),
# the tp_plan with the experts split by the ep_plan. transformers 5.17 has no ep_size: its enable_expert_parallel
# runs the ep_plan alone (attention whole), another layout.
TRANSFORMERS_EP_SIZE = "ep_size" in inspect.signature(DistributedConfig).parameters
EP_SIZE_MISSING = (
    "this transformers' DistributedConfig has no ep_size (transformers 5.17 runs expert parallelism another way)"
)


def transformers_tp_generate_peak(
    model: ResolvedModel, setup: TrainingSetup, degree: int, rank: int = 0, expert_parallel: bool = False
) -> int:
    """transformers' own tensor-parallel inference: a checkpoint of the model loaded with
    ``from_pretrained(tp_plan="auto", tp_size=degree)`` (with ``expert_parallel``,
    ``distributed_config=DistributedConfig(tp_size=degree, ep_size=degree)``) as ``rank`` of a fake process group,
    and ``generate()`` itself (``analysis.measure.Generation``) on real CPU tensors, after one warm-up generation.
    Expert parallelism at inference runs ``AllReduceEP``, whose memory does not depend on the routing: every rank
    runs its experts on every routed token, masked or not.

    The peak is the CPU allocator's: what the rank holds before (its weight shards, buffers and the prompt) plus
    the highest running sum of the allocations and frees torch.profiler reports, each in the 512-byte blocks the
    estimate counts. DTensor's own temporaries (the vocabulary-parallel embedding's masks) are among them. The
    checkpoint is saved in another dtype than it is loaded in, so that each shard is a copy of its slice, as on
    a GPU, not a view of the memory-mapped file."""
    saved_dtype = torch.float32 if setup.param_dtype == torch.bfloat16 else torch.bfloat16
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        model.build(setup).to(saved_dtype).save_pretrained(directory)
        if expert_parallel:
            if not TRANSFORMERS_EP_SIZE:
                raise NotImplementedError(EP_SIZE_MISSING)
            parallel = {"distributed_config": DistributedConfig(tp_size=degree, ep_size=degree)}
        else:
            parallel = {"tp_plan": "auto", "tp_size": degree}
        # transformers loads the shards onto the host's accelerator (and reads LOCAL_RANK for it): this runtime is
        # CPU's, on a machine with a GPU too.
        on_cpu = patch.object(torch._C, "_get_accelerator", lambda: torch.device("cpu"))
        with fake_process_group(degree, rank), on_cpu:
            net = AutoModelForCausalLM.from_pretrained(directory, dtype=setup.param_dtype, **parallel).eval()
            batch = model.batch(setup, "cpu")
            Generation(net, setup).run(batch)
            held = {
                storage.data_ptr(): block_size(storage.nbytes())
                for tensor in (*net.parameters(), *net.buffers(), batch.input_ids)
                for storage in get_untyped_storages(tensor)
            }
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
                Generation(net, setup).run(batch)
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    now = peak = 0
    for _, nbytes in events:
        now += block_size(nbytes) if nbytes > 0 else -block_size(-nbytes)
        peak = max(peak, now)
    return sum(held.values()) + peak
