"""Activation checkpointing as transformers and PyTorch run it, so that the trace records the recomputation
in backward rather than a formula for it."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import torch
import torch.utils.checkpoint
from torch import nn
from torch._functorch.partitioners import get_default_op_list
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_WRAPPED_MODULE,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from transformers import PreTrainedModel

from tracer.errors import UserError
from tracer.modules import decoder_blocks


def enable_checkpointing(model: nn.Module, kind: str, reentrant: bool) -> None:
    """``full``: every decoder layer, as ``model.gradient_checkpointing_enable()`` does (with transformers'
    default ``use_reentrant=False`` unless ``reentrant``), or, in a model that is no transformers model, as
    torch's ``checkpoint_wrapper`` around each repeated block does. ``op``: every decoder layer under torchtitan's
    per-op selective policy (:func:`torchtitan_op_policy`). ``selective``: only the attention module of every
    decoder layer is checkpointed, its inputs kept and its internals recomputed in backward."""
    if reentrant and kind != "full":  # transformers calls attention with keyword arguments; SAC needs non-reentrant
        raise UserError(f"--grad-checkpointing {kind} runs non-reentrant: drop --reentrant.")
    if kind in ("full", "op"):
        context = {"context_fn": torchtitan_op_policy} if kind == "op" else {}
        if not isinstance(model, PreTrainedModel):
            _wrap_blocks(model, reentrant, context)
            return
        if not model.supports_gradient_checkpointing:
            raise UserError(f"{type(model).__name__} does not support gradient checkpointing in transformers.")
        with warnings.catch_warnings():  # transformers 5 renames the method and warns about the old name
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant} | context)
        return
    attentions = [_attention_of(model.get_submodule(block)) for block in decoder_blocks(model)]
    if not attentions or None in attentions:
        raise UserError(f"--grad-checkpointing selective: no attention module found in {type(model).__name__}.")
    for attention in attentions:
        attention.forward = functools.partial(checkpoint, attention.forward, use_reentrant=False)
    if isinstance(model, PreTrainedModel):
        # As transformers does under gradient checkpointing: a recomputed attention would append to the cache twice.
        model.config.use_cache = False


@contextmanager
def unwinding_checkpoints() -> Iterator[None]:
    """Undo what a non-reentrant ``checkpoint`` entered for a forward that raised, before the caller's contexts exit.

    ``checkpoint(use_reentrant=False)`` enters its saved-tensor hooks and its ``context_fn``'s forward context (the
    dispatch modes of selective checkpointing) in a generator that it resumes only after the forward returns. In
    torch 2.11 a forward that raises leaves that generator suspended: its hooks stay installed and its modes stay
    on torch's mode stack until the generator is collected, which a kept traceback (a test failure, a caught
    error) defers indefinitely. Meanwhile each dispatch mode the caller leaves pops the top of that stack, the
    checkpoint's mode rather than its own, so the trace's FakeTensorMode outlived it, and every later run of the
    process dispatched into it ("Mixing fake modes NYI", "Please convert all Tensors to FakeTensors first").
    Later torch throws the error into the generator (``gen.throw``); this closes each suspended one, innermost
    first, which unwinds it the same way and does nothing where torch already did."""
    try:
        yield
    except BaseException as error:
        _close_suspended_checkpoints(error.__traceback__)
        raise


_CHECKPOINT_CODE = inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__


def _close_suspended_checkpoints(traceback: TracebackType | None) -> None:
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for frame in reversed(frames):  # the innermost checkpoint entered its contexts last
        if frame.f_code is _CHECKPOINT_CODE:
            generator = frame.f_locals.get("gen")
            if inspect.isgenerator(generator):
                generator.close()


def _wrap_blocks(model: nn.Module, reentrant: bool, context: dict) -> None:
    """A model that is no transformers model: each repeated block wrapped in torch's ``checkpoint_wrapper``,
    as torchtitan's ``apply_ac`` wraps its transformer blocks."""
    blocks = decoder_blocks(model)
    if not blocks:
        raise UserError(f"--grad-checkpointing: no repeated blocks found in {type(model).__name__} to checkpoint.")
    implementation = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    for path in blocks:
        parent, _, name = path.rpartition(".")
        container = model.get_submodule(parent)
        wrapped = checkpoint_wrapper(container.get_submodule(name), checkpoint_impl=implementation, **context)
        container.register_module(name, wrapped)
    # A tensor-parallel plan names the blocks' modules, now one level down (torchtitan applies TP first).
    blocks_pattern = blocks[0].rpartition(".")[0] + ".*."
    plan = getattr(model, "_tp_plan", None) or {}
    model._tp_plan = {
        (blocks_pattern + f"{_CHECKPOINT_WRAPPED_MODULE}." + pattern.removeprefix(blocks_pattern))
        if pattern.startswith(blocks_pattern)
        else pattern: style
        for pattern, style in plan.items()
    }


def _attention_of(block: nn.Module) -> nn.Module | None:
    """The block's attention: its child whose class name says so (``LlamaAttention``, ``GPT2Attention``...)."""
    return next((child for child in block.children() if "Attention" in type(child).__name__), None)


# torchtitan's per-op save list (torchtitan/distributed/activation_checkpoint.py:31-94 at b5bcd76): torch's
# compute-intensive ops, the other SDPA kernels, the float8 amax, linear and topk.
_OP_SAVE_LIST = {packet.default for packet in get_default_op_list().compute_intensive_ops} | {
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops.aten.max.default,
    torch.ops.aten.linear.default,
    torch.ops.aten.topk.default,
}
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


def torchtitan_op_policy():
    """The checkpoint contexts of torchtitan's selective activation checkpointing per op (``_get_custom_policy``,
    activation_checkpoint.py:241-274): save the outputs of the listed ops, except every second matmul of the
    layer, and recompute the rest. Counted apart in forward and in the recomputation, afresh for each call."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
        if func in _OP_SAVE_LIST:
            if func in _MATMULS and counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
