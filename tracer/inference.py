"""Inference as ``generate`` runs it: the prefill over the prompt, then a decode step with the cache at its
longest, each under ``torch.no_grad()``.

The decode step traced is the last of ``max_new_tokens``: before it, the cache is grown to hold the prompt and
the tokens decoded so far, without recording (the steps in between repeat the traced one with a shorter
cache), so the decode peak is the largest of all decode steps.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig, StaticCache

from tracer.roles import Phase, Role
from tracer.step import Batch, OnPhase
from tracer.training import TrainingSetup


@dataclass
class InferenceStep:
    model: nn.Module
    config: PretrainedConfig
    setup: TrainingSetup
    optimizer: None = None
    scaler: None = None
    kept_outputs: None = None

    def prime(self, batch: Batch) -> None:
        """Nothing persists from one generation to the next."""

    @torch.no_grad()
    def run(self, batch: Batch, on_phase: OnPhase = lambda phase: None, micro_steps: int = 1, recorder=None) -> None:
        """Prefill, then the decode step at the longest cache. ``recorder``, when recording, is paused while
        the cache grows and told which storages are the cache."""
        setup = self.setup
        on_phase(Phase.PREFILL)
        cache = self._cache()
        outputs = self.model(
            batch.input_ids, past_key_values=cache, use_cache=True, logits_to_keep=setup.logits_to_keep
        )
        next_ids = outputs.logits[:, -1:].argmax(-1)
        del outputs
        _mark_cache(cache, recorder)
        before_last = setup.seq_len + setup.max_new_tokens - 1  # cached tokens when the last one is decoded
        with recorder.paused() if recorder else nullcontext():
            _grow(cache, setup.max_new_tokens - 1)
            position = torch.full((1,), before_last, dtype=torch.long, device=next_ids.device)
        if recorder:
            for tensor in _cache_tensors(cache):
                recorder.track_created(tensor, Role.KV_CACHE, "KV cache")
            recorder.track_created(next_ids, Role.INPUT, "decoded token")
            recorder.track_created(position, Role.INPUT, "cache position")
        on_phase(Phase.DECODE)
        outputs = self.model(next_ids, past_key_values=cache, use_cache=True, cache_position=position)
        outputs.logits[:, -1:].argmax(-1)
        del outputs
        _mark_cache(cache, recorder)

    def _cache(self):
        if self.setup.cache == "static":
            length = self.setup.seq_len + self.setup.max_new_tokens
            return StaticCache(config=self.config, max_cache_len=length)
        return DynamicCache(config=self.config)


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [
        tensor
        for layer in cache.layers
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(tensor, torch.Tensor)
    ]


def _mark_cache(cache, recorder) -> None:
    if recorder:
        for tensor in _cache_tensors(cache):
            recorder.mark(tensor, Role.KV_CACHE)


def _grow(cache, tokens: int) -> None:
    """Append ``tokens`` positions to every layer as its own ``update`` would (a sliding-window layer keeps
    its window), so that the cache holds what it holds before the last decode step."""
    if tokens == 0:
        return
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        layer.update(
            keys.new_zeros((*keys.shape[:2], tokens, keys.shape[-1])),
            values.new_zeros((*values.shape[:2], tokens, values.shape[-1])),
        )
