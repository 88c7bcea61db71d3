"""Trace one steady-state training step under FakeTensorMode: nothing is allocated, everything recorded."""

from __future__ import annotations

import os
import re
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from functools import cache, partial
from unittest.mock import patch

import torch
import transformers
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.utils._python_dispatch import _disable_current_modes
from transformers import masking_utils

from tracer.accumulation import MICRO_STEPS, NotDerivable, accumulating_trace
from tracer.baseline import register_baseline
from tracer.config_check import EXPERT_COUNTS
from tracer.context_parallel import ring_attention
from tracer.cuda import CudaEmulation
from tracer.cuda.caching_allocator import MIN_BLOCK_SIZE
from tracer.cuda.placement import mark_host_storages
from tracer.cuda.workspaces import CUBLAS_THREADS_IN_TRAINING
from tracer.device_map import DevicePlacement, free_memory, place_modules
from tracer.errors import UserError
from tracer.expert_parallel import AssumedExchange, routing_of, shard_experts
from tracer.gpus import find_gpu
from tracer.inference import GROUPED_MM, InferenceStep, decodes_with_batched_mm, describe_generation
from tracer.known_values import KnownValues
from tracer.layers import LayerPlan, plan_layers
from tracer.meta_fixes import MetaFixes
from tracer.modules import ModuleScope, count_parameters, decoder_blocks, model_structure
from tracer.published import (
    RESTATED,
    counted_as_published,
    describe,
    published_parameters,
    quant_method,
    track_published,
)
from tracer.recorder import StepRecorder
from tracer.resolve import Model
from tracer.roles import Phase, Role
from tracer.stamping import Blocks, NotStampable, stamp
from tracer.step import TrainingStep, attention_implementation, build_optimizer
from tracer.trace import Trace
from tracer.training import Target, TrainingSetup


class TraceGradScaler(torch.amp.GradScaler):
    """GradScaler whose step does not read ``found_inf`` back: fake tensors have no values, and reading
    a flag does not allocate device memory. Everything else (scale, unscale, update) runs as is."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


# Told (stage, done, total): each stage as it starts, then within forward and backward (and prefill/decode)
# the decoder blocks done out of all; a total of 0 is a stage without a count.
Progress = Callable[[str, int, int], None]


def trace_step(
    model: Model,
    setup: TrainingSetup,
    progress: Progress | None = None,
    every_layer: bool = False,
    every_gpu: bool = False,
    derive_accumulation: bool = True,
) -> Trace:
    """Record one steady-state training step, telling ``progress`` how far it got. A training step of a model
    whose decoder layers repeat is recorded on the model cut to a few layers and stamped out to all of them
    (tracer/layers.py, tracer/stamping.py), which gives the same trace; ``every_layer`` records them all. Under a
    device map the trace holds every GPU's storages, each with its GPU, which only a reading per GPU may sum
    (``every_gpu``: analysis/device_map.py). A step of accumulating micro-steps is derived from the step without
    accumulation (tracer/accumulation.py), which gives the same trace; ``derive_accumulation`` False records the
    accumulating loop."""
    if setup.device_map is not None and not every_gpu:
        raise UserError(
            "A device map spreads the model over several GPUs, each estimated on its own: use "
            "analysis.device_map.estimate_device_map(model, setup)."
        )
    if derive_accumulation and may_derive_accumulation(setup):
        plain = trace_step(model, replace(setup, grad_accum=1), progress, every_layer, every_gpu)
        return accumulating_step(model, setup, plain, progress, every_layer, every_gpu)
    inference = setup.mode == "inference"
    plan = None if every_layer or inference or model.config is None else plan_layers(model.config)
    why = "every layer traced" + (" (inference grows its cache outside the layers: not stamped)" if inference else "")
    if model.config is None:
        why += " (a custom model: no config to build it with fewer layers)"
    if plan is not None:
        try:
            cut, net = _record(model, setup, _naming_the_cut(progress, plan), plan)
            return _stamped(cut, net, plan)
        except NotStampable as reason:
            why += f": the layers do not repeat as stamping needs ({reason})"
        except UserError:  # the cut model could not be traced; the whole one says why, or traces
            why += ": the model cut to a few layers could not be traced"
    trace, net = _record(model, setup, progress)
    trace.structure = model_structure(net)
    trace.assumptions["decoder_layers"] = why
    return trace


def _naming_the_cut(progress: Progress | None, plan: LayerPlan) -> Progress | None:
    """``progress`` told, with each counted stage, that its count is of the layers traced."""
    if progress is None:
        return None
    cut = f" ({plan.traced} of {plan.layers} layers)"
    return lambda stage, done, total: progress(stage + (cut if total else ""), done, total)


def _stamped(cut: Trace, net: nn.Module, plan: LayerPlan) -> Trace:
    """The step of the whole model from the step of the model cut to ``plan.traced`` layers."""
    structure = model_structure(net)
    list_path = structure.blocks[0].rpartition(".")[0]
    if structure.blocks != tuple(f"{list_path}.{i}" for i in range(plan.traced)):
        raise NotStampable(f"decoder layers {structure.blocks[0]} ... are not numbered in order")
    blocks = Blocks(list_path, plan.template, plan.period, plan.copies)
    trace = stamp(cut, blocks)
    total, trainable = count_parameters(net)
    for path in structure.blocks[plan.template : plan.template + plan.period]:
        block_total, block_trainable = count_parameters(net.get_submodule(path))
        total += block_total * plan.copies
        trainable += block_trainable * plan.copies
    trace.parameter_count, trace.trainable_parameter_count = total, trainable
    trace.structure = replace(structure, blocks=tuple(f"{list_path}.{i}" for i in range(plan.layers)))
    first, last = plan.template + plan.period, plan.template + plan.period * (plan.copies + 1) - 1
    source = f"layer {plan.template}" if plan.period == 1 else f"layers {plan.template}-{first - 1}"
    trace.assumptions["decoder_layers"] = (
        f"{plan.traced} of {plan.layers} traced; layers {first}-{last} stamped from {source}"
    )
    return trace


@cache
def _first_backward_outside_fake_mode() -> None:
    """This process's first backward, on a real CPU tensor, before any trace's.

    The autograd engine sizes its device threads once, at the first backward of a process (``Engine::start_device_
    threads`` under ``call_once``, torch/csrc/autograd/engine.cpp), from the device count of every registered device
    guard; starting them, it registers ``pthread_atfork`` so that a forked child refuses autograd ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing"). Where torch is a CUDA build on a machine
    without a GPU (torch 2.11+cu130 on a CPU host), ``FakeTensorMode.__enter__`` swaps the CUDA guard for a no-op one
    that reports devices (``torch._C._ensureCUDADeviceGuardSet()``, torch/_subclasses/fake_tensor.py), so a first
    backward inside a trace starts threads for GPUs the machine lacks (eight, pt_autograd_0-7, measured on torch
    2.11.0+cu130), and ``plan``'s forked search processes cannot trace. Run first, the engine counts the devices there
    are: none, no threads. (torch 2.13.0+cpu starts none either way; on a GPU machine the threads start whatever runs
    first, and ``plan`` checks a fork before using one.)
    """
    with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
        torch.ones((), requires_grad=True).backward()


def _record(
    model: Model, setup: TrainingSetup, progress: Progress | None, plan: LayerPlan | None = None
) -> tuple[Trace, nn.Module]:
    """Record the step of ``model``, or of it cut to the layers ``plan`` traces, with the model it ran."""
    report = progress or (lambda stage, done, total: None)
    _first_backward_outside_fake_mode()
    cuda = setup.target is Target.CUDA
    emulation = CudaEmulation(find_gpu(setup.gpu), setup.autocast_dtype) if cuda else None
    restated = counted_as_published(model.config, setup) and quant_method(model.config) in RESTATED
    published = published_parameters(model.config, setup.param_dtype) if restated else {}
    with (
        traced_errors(model.model_id),
        FakeTensorMode(),
        MetaFixes(),
        KnownValues(),
        as_eager(),
        emulation or nullcontext(),
    ):
        report("building the model", 0, 0)
        net = (model if plan is None else replace(model, config=plan.cut)).build(setup)
        if plan is not None:
            plan.widen(net.config)
        counts = count_parameters(net)  # the model's, not one expert-parallel rank's
        if setup.expert_parallel > 1:  # training exchanges the tokens as the routing assumption says
            exchange = None
            if setup.mode == "train":
                exchange = AssumedExchange(routing_of(net.config, setup.expert_parallel, setup.routing_imbalance))
            shard_experts(net, setup.expert_parallel, exchange=exchange)
        batch = model.batch(setup, "cpu")
        if setup.mode == "inference":
            optimizer, step = None, InferenceStep(net, model.config, setup)
        else:
            optimizer = build_optimizer(net, setup, foreach=True if cuda else None)
            step = TrainingStep(
                net,
                optimizer,
                autocast=_autocast(setup, emulation),
                scaler=TraceGradScaler("cpu") if setup.mixed_precision == "fp16" else None,
                keep_outputs=setup.keep_outputs,
                fp32_outputs=setup.fp32_outputs,
                loss_fn=model.loss_fn,
            )
        step.prime(batch)
        blocks = len(decoder_blocks(net))
        placement = _device_map(net, setup)

        def on_block(index: int) -> None:  # blocks run in order, and in reverse in backward
            phase = recorder.phase
            report(phase.value, blocks - index if phase is Phase.BACKWARD else index + 1, blocks)

        recorder = StepRecorder(ModuleScope(net, on_block), device_type=None if cuda else "cpu", placement=placement)
        register_baseline(recorder, step, batch, step_counters_on_host=cuda)
        if placement is not None:
            placement.place_existing(recorder, net)
        scales = track_published(recorder, net, published)  # alive through the step
        workspace = []  # one per GPU and per thread that runs matmuls there (tracer/cuda/workspaces.py)
        if emulation is not None:
            threads = CUBLAS_THREADS_IN_TRAINING if setup.mode == "train" else 1
            for device in sorted(set(placement.placed.values())) if placement else [0]:
                for _ in range(threads):
                    workspace.append(torch.empty(emulation.cublas_workspace_bytes, dtype=torch.uint8))
                    recorder.track_existing(workspace[-1], Role.WORKSPACE, "cuBLAS workspace")
                    recorder.place(workspace[-1], device)

        def on_phase(phase: Phase) -> None:
            report(phase.value, 0, 0 if phase is Phase.OPTIMIZER else blocks)
            recorder.enter(phase)

        ring = setup.context_parallel > 1  # attention as context parallelism's ring runs it, on the rank's tokens
        with (
            recorder.recording(),
            emulation.kernel_scratch() if emulation else nullcontext(),
            placement.copies(recorder) if placement else nullcontext(),
            ring_attention(setup.context_parallel, 0, cuda) if ring else nullcontext(),
        ):
            if setup.mode == "inference":
                step.run(batch, on_phase=on_phase, recorder=recorder)
            else:
                step.run(batch, on_phase=on_phase, micro_steps=traced_micro_steps(setup))
        del workspace, scales

    trace = recorder.trace()
    trace.parameter_count, trace.trainable_parameter_count = counts
    if cuda:
        mark_host_storages(trace)
    config = None if model.config is None else net.config  # the one the model ran with
    trace.assumptions = _assumptions(model, config, setup, optimizer, emulation)
    if setup.mode == "inference":
        trace.assumptions["logits_processors"] = step.processors_used
        if step.dropped_cache:
            trace.assumptions["cache_dropped"] = step.dropped_cache
    if placement is not None:
        trace.assumptions |= placement.describe()
    return trace, net


@contextmanager
def as_eager() -> Iterator[None]:
    """transformers' mask code reads fake tensors as a sign of graph tracing (``is_tracing``) and then keeps
    causal masks that eager runs skip; the trace stands for an eager run, so that code is told none is going
    on. The one value-dependent question it then asks of this step, whether the positions hold packed
    sequences, gets the eager answer for a batch of whole sequences (no), after the ops that compute it ran."""
    tracing = masking_utils.is_tracing

    def unpacked(position_ids: torch.Tensor) -> None:
        first = position_ids[:, :1] - 1
        difference = torch.diff(position_ids, prepend=first, dim=-1)
        (difference != 1).cumsum(-1)

    with ExitStack() as stack:
        for name, replacement in (
            ("is_tracing", lambda tensor=None: tracing()),
            ("find_packed_sequence_indices", unpacked),
            *_eager_padding_answers(),
        ):
            if hasattr(masking_utils, name):  # both are recent (transformers 5.x)
                stack.enter_context(patch.object(masking_utils, name, replacement))
        for patched in _eager_recurrent_mask_answer():
            stack.enter_context(patched)
        yield


def _eager_padding_answers() -> list[tuple[str, Callable]]:
    """The other value-dependent question: whether SDPA's mask can be skipped for a padding mask made by the model's
    own code (OPT in transformers 5.17 makes an all-ones attention mask where none is given; 5.24 makes none). The
    trace passes no attention mask, so in eager that mask holds ones: the question is answered, outside the trace,
    for a real mask of ones prepared as the fake one was (padded with zeros to a static cache's length)."""
    prepare = getattr(masking_utils, "prepare_padding_mask", None)
    ignore = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if prepare is None or ignore is None:
        return []
    stand_ins: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def prepared(attention_mask, kv_length, kv_offset, *args, **kwargs):
        padding_mask = prepare(attention_mask, kv_length, kv_offset, *args, **kwargs)
        if isinstance(padding_mask, FakeTensor):
            with _disable_current_modes():
                ones = torch.ones(attention_mask.shape, dtype=attention_mask.dtype)
                stand_ins[id(padding_mask)] = (weakref.ref(padding_mask), prepare(ones, kv_length, kv_offset))
        return padding_mask

    def ignored(padding_mask, *args, **kwargs):
        held = stand_ins.get(id(padding_mask))
        if padding_mask is None or held is None or held[0]() is not padding_mask:
            return ignore(padding_mask, *args, **kwargs)
        with _disable_current_modes():
            return ignore(held[1], *args, **kwargs)

    return [("prepare_padding_mask", prepared), ("_ignore_causal_mask_sdpa", ignored)]


def _eager_recurrent_mask_answer() -> list[AbstractContextManager]:
    """The question linear-attention layers' mask asks (``create_recurrent_attention_mask``): whether a 2-D attention
    mask over more than one new token holds only ones, in which case eager skips the masking. The one such mask a
    trace passes is generate()'s own for a prompt without padding, which transformers 5.17 keeps (tracer/inference.py):
    ones, so the question is asked of the fake mask (its comparison and reduction allocate as in eager) and answered
    as eager answers it. The function is also held by the models, bound by name at import, and by the table of mask
    functions ``create_masks_for_generate`` reads: each is given this one, which hands anything but a fake mask to
    transformers' own."""
    name = "create_recurrent_attention_mask"
    recurrent = getattr(masking_utils, name, None)
    if recurrent is None:
        return []

    def answered(config, inputs_embeds, attention_mask=None, *args, **kwargs):
        if not isinstance(attention_mask, FakeTensor) or attention_mask.ndim != 2 or inputs_embeds.shape[1] == 1:
            return recurrent(config, inputs_embeds, attention_mask, *args, **kwargs)
        torch.all(attention_mask == 1)
        return None

    holders = [masking_utils] + [
        module
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("transformers.models.") and vars(module).get(name) is recurrent  # no lazy import
    ]
    patches = [patch.object(module, name, answered) for module in holders]
    tables = [getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})]
    tables += [table for table in tables[0].values() if isinstance(table, dict)]  # the hybrid patterns' own
    for table in tables:
        held = {pattern: answered for pattern, function in table.items() if function is recurrent}
        patches += [patch.dict(table, held)] if held else []
    return patches


def traced_micro_steps(setup: TrainingSetup) -> int:
    """Micro-steps traced for gradient accumulation: the first creates the gradients, every later one runs
    with them alive and is the same as the second, so two stand for any number."""
    return min(setup.grad_accum, MICRO_STEPS)


def may_derive_accumulation(setup: TrainingSetup) -> bool:
    """Whether the accumulating step is derived from the step without accumulation rather than traced: a training
    step of accumulating micro-steps; the derivation checks the rest."""
    return setup.mode == "train" and traced_micro_steps(setup) == MICRO_STEPS


def accumulating_step(
    model: Model,
    setup: TrainingSetup,
    plain: Trace,
    progress: Progress | None = None,
    every_layer: bool = False,
    every_gpu: bool = False,
) -> Trace:
    """The trace of ``setup``'s accumulating step, derived from ``plain`` (its step without accumulation at the
    same batch size) or, where the derivation refuses, recorded as the loop runs."""
    try:
        return accumulating_from(plain, setup)
    except NotDerivable:
        return trace_step(model, setup, progress, every_layer, every_gpu, derive_accumulation=False)


def accumulating_from(plain: Trace, setup: TrainingSetup) -> Trace:
    """The trace of ``setup``'s accumulating step from ``plain``, its step without accumulation at the same batch
    size; raises NotDerivable when that step lacks the shape the derivation needs (tracer/accumulation.py)."""
    return accumulating_trace(plain, plain.assumptions["step"] + _micro_steps_clause(setup))


def _micro_steps_clause(setup: TrainingSetup) -> str:
    return f"; {setup.grad_accum} micro-steps per optimizer step" if setup.grad_accum > 1 else ""


def _training_assumptions(config, setup: TrainingSetup, optimizer) -> dict[str, object]:
    """``config`` is the transformers config the model ran with, None for a custom model (its loss function)."""
    kind = type(optimizer)
    implementation = ", ".join(
        f"{key}={optimizer.defaults[key]}" for key in ("foreach", "fused", "momentum") if optimizer.defaults.get(key)
    )
    if config is None:
        forward = "loss = loss_fn(model, batch)"
    elif setup.keep_outputs:
        forward = "outputs = model(input_ids, labels=labels); loss = outputs.loss"
    else:
        forward = "loss = model(input_ids, labels=labels).loss"
    return {
        "step": f"{forward}; loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)"
        + ("; with torch.amp.GradScaler" if setup.mixed_precision == "fp16" else "")
        + _micro_steps_clause(setup),
        "state": "steady state: optimizer states exist before the step; gradients are freed at its end"
        + ("; the previous step's outputs are held until the forward returns new ones" if setup.keep_outputs else ""),
        "optimizer_implementation": f"{kind.__module__}.{kind.__name__}"
        + (f", {implementation}" if implementation else ""),
        "kv_cache_in_forward": bool(getattr(config, "use_cache", False)),
    }


def _checkpoint_quantization(model: Model, setup: TrainingSetup) -> dict[str, str]:
    """How a quantized checkpoint's weights are counted, beside the dtype."""
    method = quant_method(model.config)
    if method is None:
        return {}
    if counted_as_published(model.config, setup):
        return {"checkpoint_weights": describe(model.config)}
    why = (
        "loaded dequantized (--dequantize)"
        if setup.dequantize
        else "fine-tuning loads it dequantized"
        if setup.mode == "train" and method in RESTATED
        else "its format is not modelled"
    )
    return {"checkpoint_weights": f"published as {method}; weights counted in --dtype: {why}"}


def _device_map(net: nn.Module, setup: TrainingSetup) -> DevicePlacement | None:
    """accelerate's placement of the model over the setup's GPUs and its hooks on it, for a device map."""
    if setup.device_map is None:
        return None
    placement = DevicePlacement(place_modules(net, setup.device_map, free_memory(find_gpu(setup.gpu))))
    placement.dispatch(net)
    return placement


def _inference_assumptions(setup: TrainingSetup) -> dict[str, object]:
    return describe_generation(setup)


def _autocast(setup: TrainingSetup, emulation: CudaEmulation | None):
    if emulation is not None:
        return emulation.autocast
    if setup.autocast_dtype is None:
        return nullcontext
    return partial(torch.autocast, "cpu", dtype=setup.autocast_dtype)


_NO_FAKE_KERNEL = re.compile(r"no fake impl registered for <CustomOpDef\((?P<op>[^)]+)\)>")


class traced_errors(AbstractContextManager):
    """Turn anything that fails while the model is built or traced into one message naming the model and,
    where the recorder saw it, the op and module (``TRACER_DEBUG=1`` keeps the traceback)."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, UserError) or not isinstance(exc, Exception):
            return False
        if os.environ.get("TRACER_DEBUG") == "1":
            return False
        missing = _NO_FAKE_KERNEL.search(str(exc)) if isinstance(exc, RuntimeError) else None
        if isinstance(exc, UnsupportedOperatorException) or missing:
            op = exc.func if missing is None else missing["op"]
            raise UserError(
                f"The tracer cannot run op {op}: it has no FakeTensor (meta) implementation, so its memory "
                "cannot be traced. Register one with torch.library.register_fake."
            ) from None
        if isinstance(exc, DataDependentOutputException | DynamicOutputShapeException):
            raise UserError(
                f"The tracer cannot run op {exc.func}: its output size depends on tensor values, "
                "which a trace without data does not have."
            ) from None
        where = f" at {exc.traced_op}" if hasattr(exc, "traced_op") else ""
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        raise UserError(
            f"Tracing {self.model_id} failed{where}: {type(exc).__name__}: {reason}. This model or setup is not "
            "supported; please report it with the command you ran (TRACER_DEBUG=1 shows the traceback)."
        ) from None


def _experts_assumptions(config, setup: TrainingSetup) -> dict[str, str]:
    """How a MoE model's experts run, and so why the routing does or does not change the estimate."""
    if config is None or not any(getattr(config, field, None) for field in EXPERT_COUNTS):
        return {}
    if setup.expert_parallel > 1 and setup.mode == "train":
        return {
            "moe_experts": "torchtitan's all-to-all token dispatcher: the routed tokens sent to the GPUs holding their "
            "experts, run there by grouped matmuls over the rows each GPU receives (expert_routing), sent back"
        }
    implementation = getattr(config, "_experts_implementation", None) or "eager"
    if implementation == GROUPED_MM:
        experts = (
            "transformers' grouped_mm, its default where torch's grouped matmul runs (CUDA compute capability 8.0 and "
            "later): the routed tokens sorted by expert and multiplied once, so the memory does not depend on how the "
            "router spreads them"
        )
        if decodes_with_batched_mm(setup):
            experts += (
                "; generate()'s decode steps on a GPU switch to batched_mm, which copies the weights of each routed "
                "token's experts (batch x top-k copies in each layer)"
            )
        return {"moe_experts": experts}
    return {"moe_experts": f"the model's own experts code ({implementation})"}


def _assumptions(model: Model, config, setup: TrainingSetup, optimizer, emulation) -> dict[str, object]:
    """What the trace assumed; ``config`` is the config the model ran with (checkpointing turns its cache off)."""
    if config is None:
        attention = "the model's own code"
    else:
        attention = attention_implementation(config, setup)
        if attention != setup.attn:
            attention += f" ({type(config).__name__} has no SDPA path in transformers)"
    assumptions: dict[str, object] = {
        "model_source": model.source,
        **_checkpoint_quantization(model, setup),
        **(
            _inference_assumptions(setup)
            if setup.mode == "inference"
            else _training_assumptions(config, setup, optimizer)
        ),
        "attention_implementation": attention,
        **_experts_assumptions(config, setup),
        "allocation_rounding_bytes": MIN_BLOCK_SIZE,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if emulation is not None:
        major, minor = emulation.gpu.compute_capability
        assumptions["gpu_arch"] = f"{emulation.gpu.description} (sm{major}{minor})"
        assumptions["cublas_workspace_bytes"] = emulation.cublas_workspace_bytes
        if emulation.kernels.sdpa_backends:
            assumptions["sdpa_backend"] = ", ".join(sorted(b.value for b in emulation.kernels.sdpa_backends))
        if setup.mixed_precision:
            assumptions["autocast"] = f"CUDA autocast policies, {setup.mixed_precision}"
    elif setup.mixed_precision:
        assumptions["autocast"] = f"CPU autocast policies, {setup.mixed_precision}"
    return assumptions
