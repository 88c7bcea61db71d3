"""Activation checkpointing as transformers and PyTorch run it, so that the trace records the recomputation
in backward rather than a formula for it."""

from __future__ import annotations

import functools
import warnings

from torch import nn
from torch.utils.checkpoint import checkpoint

from tracer.errors import UserError
from tracer.modules import decoder_blocks


def enable_checkpointing(model: nn.Module, kind: str, reentrant: bool) -> None:
    """``full``: every decoder layer, as ``model.gradient_checkpointing_enable()`` does (with transformers'
    default ``use_reentrant=False`` unless ``reentrant``). ``selective``: only the attention module of every
    decoder layer is checkpointed, its inputs kept and its internals recomputed in backward."""
    if kind == "full":
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise UserError(f"{type(model).__name__} does not support gradient checkpointing in transformers.")
        with warnings.catch_warnings():  # transformers 5 renames the method and warns about the old name
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return
    if reentrant:  # transformers calls attention with keyword arguments, which reentrant checkpoint refuses
        raise UserError("--grad-checkpointing selective runs non-reentrant: drop --reentrant.")
    attentions = [_attention_of(model.get_submodule(block)) for block in decoder_blocks(model)]
    if not attentions or None in attentions:
        raise UserError(f"--grad-checkpointing selective: no attention module found in {type(model).__name__}.")
    for attention in attentions:
        attention.forward = functools.partial(checkpoint, attention.forward, use_reentrant=False)
    # As transformers does under gradient checkpointing: a recomputed attention would append to the cache twice.
    model.config.use_cache = False


def _attention_of(block: nn.Module) -> nn.Module | None:
    """The block's attention: its child whose class name says so (``LlamaAttention``, ``GPT2Attention``...)."""
    return next((child for child in block.children() if "Attention" in type(child).__name__), None)
