"""Inference as ``model.generate()`` runs greedy decoding: the prefill over the prompt, then the decode step with
the cache at its longest, each under ``torch.no_grad()``, with the tensors generate() itself keeps.

Follows transformers 5.23's ``GenerationMixin`` (generation/utils.py): ``generate`` makes the position ids from
an all-ones attention mask and then drops the mask, as a prompt without padding needs none (5.17 keeps it, a
batch x length int64 tensor more), passes ``logits_to_keep=1`` to models that take it, and sizes a static cache
to ``max_length - 1``; ``_sample`` builds each forward's inputs with ``prepare_inputs_for_generation`` (a static
cache's attention mask among them), copies the last position's logits to float32, takes their argmax, appends
it to ``input_ids``, grows the kwargs with ``_update_model_kwargs_for_generation`` and asks the stopping
criteria. ``max_new_tokens`` tokens take that many forwards: the prefill gives the first.

The decode step traced is the last: before it, the cache and the growing ids are brought to what they hold then,
without recording (the decode steps in between repeat the traced one with shorter tensors), so the decode peak
is the largest of all decode steps. No stop token ends the generation early: every sequence runs to
``max_new_tokens``.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig, StaticCache
from transformers.generation import utils as generation_utils
from transformers.modeling_outputs import CausalLMOutputWithPast

from tracer.roles import Phase, Role
from tracer.step import Batch, OnPhase
from tracer.training import TrainingSetup

# The keyword generate() holds the cache under, in its kwargs and the model's outputs: ``cache`` from
# transformers 5.24 (generation/utils.py ALL_CACHE_NAMES), ``past_key_values`` before.
CACHE_KWARG = "cache" if "cache" in generation_utils.ALL_CACHE_NAMES else "past_key_values"


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
        the cache and ids grow, and told which storages are the cache."""
        setup, model = self.setup, self.model
        on_phase(Phase.PREFILL)
        parameters = set(inspect.signature(model.forward).parameters)
        # generate()'s own kwargs, which it keeps until it returns (the prompt's position ids among them)
        kwargs = {CACHE_KWARG: self._cache(), "use_cache": True, "attention_mask": None}
        if "position_ids" in parameters:
            kwargs["position_ids"] = _positions(batch.input_ids)
        if setup.logits_to_keep and "logits_to_keep" in parameters:
            kwargs["logits_to_keep"] = setup.logits_to_keep
        state = _Sampling(model, batch.input_ids, kwargs)
        state.forward(batch.input_ids.shape[1], first=True)
        _mark_cache(kwargs[CACHE_KWARG], recorder)
        if setup.max_new_tokens == 1:
            return
        with recorder.paused() if recorder else nullcontext():
            state.skip(setup.max_new_tokens - 2)  # the decode steps before the last
        if recorder:
            _track_cache(kwargs[CACHE_KWARG], recorder)
            recorder.track_created(state.ids, Role.INPUT, "generated ids")
            if state.kwargs.get("position_ids") is not None:
                recorder.track_created(state.kwargs["position_ids"], Role.INPUT, "position ids")
        on_phase(Phase.DECODE)
        state.forward(1)
        _mark_cache(kwargs[CACHE_KWARG], recorder)

    def _cache(self):
        if self.setup.cache == "static":  # generate() sizes it to max_length - 1 (_prepare_cache_for_generation)
            length = self.setup.seq_len + self.setup.max_new_tokens - 1
            return StaticCache(config=self.config, max_cache_len=length)
        return DynamicCache(config=self.config)


def _positions(input_ids: torch.Tensor) -> torch.Tensor:
    """``_prepare_position_ids_for_generation`` over the all-ones mask of a prompt without padding."""
    attention_mask = torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 0)


class _Sampling:
    """What ``_sample`` holds from one iteration to the next: the ids so far, the model kwargs, the last
    float32 logits and the unfinished flags. Each is replaced as ``_sample`` rebinds it, so that the old tensor
    is released when the new one exists. The forward's inputs and the kwargs' growth come from transformers'
    own ``prepare_inputs_for_generation`` and ``_update_model_kwargs_for_generation``."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, kwargs: dict) -> None:
        self.model, self.ids, self.kwargs, self.logits = model, input_ids, dict(kwargs), None
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)

    def forward(self, new_tokens: int, first: bool = False) -> None:
        """One iteration: the forward over the last ``new_tokens`` ids, then the kwargs grow, the last logits
        are copied to float32 (the previous copy is still referenced meanwhile), the greedy token is appended,
        and the stopping criteria are asked (a maximum length only)."""
        inputs = self.model.prepare_inputs_for_generation(
            self.ids, next_sequence_length=new_tokens, is_first_iteration=first, **self.kwargs
        )
        outputs = self.model(**inputs, return_dict=True)
        del inputs
        self.kwargs = self.model._update_model_kwargs_for_generation(outputs, self.kwargs)
        self.logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
        tokens = torch.argmax(self.logits, dim=-1)
        self.ids = torch.cat([self.ids, tokens[:, None]], dim=-1)
        rows, device = self.ids.shape[0], self.ids.device
        none_done = torch.full((rows,), False, dtype=torch.bool, device=device)  # StoppingCriteriaList.__call__
        at_max_length = torch.full((rows,), False, dtype=torch.bool, device=device)  # MaxLengthCriteria
        self.unfinished = self.unfinished & ~(none_done | at_max_length)
        self.unfinished.max() == 0  # noqa: B015 - the flag generate() reads to stop
        del outputs

    def skip(self, tokens: int) -> None:
        """The cache, ids and kwargs as ``tokens`` more iterations leave them."""
        if tokens == 0:
            return
        cache = self.kwargs[CACHE_KWARG]
        _grow(cache, tokens)
        self.ids = torch.cat([self.ids, self.ids.new_zeros((self.ids.shape[0], tokens))], dim=-1)
        grown = CausalLMOutputWithPast(**{CACHE_KWARG: cache})
        self.kwargs = self.model._update_model_kwargs_for_generation(grown, self.kwargs, num_new_tokens=tokens)


# A linear-attention layer's cache (Qwen3-Next's gated delta net): a convolution and a recurrent state per layer, of
# fixed size, updated in place (transformers' LinearAttentionLayer).
LINEAR_ATTENTION_STATES = ("conv_states", "recurrent_states")


def _cache_tensors(cache) -> list[torch.Tensor]:
    tensors = []
    for layer in cache.layers:
        tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
        tensors += [state for name in LINEAR_ATTENTION_STATES for state in (getattr(layer, name, None) or {}).values()]
    return [tensor for tensor in tensors if isinstance(tensor, torch.Tensor)]


def _track_cache(cache, recorder) -> None:
    for tensor in _cache_tensors(cache):
        recorder.track_created(tensor, Role.KV_CACHE, "KV cache")


def _mark_cache(cache, recorder) -> None:
    if recorder:
        for tensor in _cache_tensors(cache):
            recorder.mark(tensor, Role.KV_CACHE)


def _grow(cache, tokens: int) -> None:
    """Append ``tokens`` (at least 1) positions to every layer as its own ``update`` would, so that the cache
    holds what it holds before the last decode step. The last position is appended on its own, as a decode step
    appends it: a sliding-window layer keeps a view of what its last ``update`` concatenated, whose storage is
    then the window and not everything appended at once."""
    for chunk in (tokens - 1, 1):
        if chunk == 0:
            continue
        for layer in cache.layers:
            if not hasattr(layer, "keys"):  # a linear-attention state: as large after any number of tokens
                continue
            keys, values = layer.keys, layer.values
            layer.update(
                keys.new_zeros((*keys.shape[:2], chunk, keys.shape[-1])),
                values.new_zeros((*values.shape[:2], chunk, values.shape[-1])),
            )
