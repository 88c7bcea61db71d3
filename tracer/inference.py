"""Inference as ``model.generate()`` runs it: the prefill over the prompt, then the decode step with the cache at its
longest, each under ``torch.no_grad()``, with the tensors generate() itself keeps.

Follows transformers 5.24's ``GenerationMixin`` (generation/utils.py): ``generate`` makes the position ids from an
all-ones attention mask and then drops the mask, as a prompt without padding needs none (5.17 keeps it, passes it to
every forward and grows it by a column per token: :data:`DROPS_ALL_ONES_MASK`), passes ``logits_to_keep=1`` to models
that take it, builds the logits processors with ``_get_logits_processor``, and makes the cache ``cache_implementation``
names (``_prepare_cache_for_generation``: a static one sized to ``max_length - 1``); ``_sample`` builds each forward's
inputs with ``prepare_inputs_for_generation`` (a static cache's attention mask among them), copies the last position's
logits to float32, runs the processors on them, takes the argmax (or, sampling, the softmax and ``torch.multinomial``),
appends the token to ``input_ids``, grows the kwargs with ``_update_model_kwargs_for_generation`` and asks the stopping
criteria. ``max_new_tokens`` tokens take that many forwards: the prefill gives the first.

The decode step traced is the last: before it, the cache and the growing ids are brought to what they hold then,
without recording (the decode steps in between repeat the traced one with shorter tensors), so the decode peak
is the largest of all decode steps. A model that drops the cache part-way (Phi-3, at the token past
``original_max_position_embeddings``) has that forward traced as well: it runs the whole sequence again. No stop
token ends the generation early: every sequence runs to ``max_new_tokens``.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from unittest.mock import patch

import torch
import transformers
from torch import nn
from transformers import DynamicCache, GenerationConfig, PretrainedConfig, QuantizedCache, StaticCache, cache_utils
from transformers.generation import utils as generation_utils
from transformers.modeling_outputs import CausalLMOutputWithPast

from tracer.errors import UserError
from tracer.roles import Phase, Role
from tracer.step import Batch, OnPhase
from tracer.training import Target, TrainingSetup

# The keyword generate() holds the cache under, in its kwargs and the model's outputs: ``cache`` from
# transformers 5.24 (generation/utils.py ALL_CACHE_NAMES), ``past_key_values`` before.
CACHE_KWARG = "cache" if "cache" in generation_utils.ALL_CACHE_NAMES else "past_key_values"
# Whether generate() drops the all-ones attention mask of a prompt without padding once the position ids are made from
# it: transformers 5.24 does, and records the mask's length in GenerationConfig._mask_length, which 5.17 does not
# declare; 5.17 keeps the mask (batch x length int64) in its kwargs to the end, passes it to every forward and
# _update_model_kwargs_for_generation appends a column of ones to it for each token.
DROPS_ALL_ONES_MASK = "_mask_length" in getattr(GenerationConfig, "__annotations__", {})
# A cache offloaded to the host prefetches the next layer back on a stream of its own (Cache.prefetch_stream)
PREFETCH_STREAM = "cache prefetch"
FP8_CACHE = hasattr(cache_utils, "Fp8QuantizedLayer")  # QuantizedCache(backend="fp8"): transformers after 5.17
# Whether generate() runs MoE experts' grouped_mm as batched_mm in its decode steps on a GPU (:func:`_decoding`)
DECODES_WITH_BATCHED_MM = hasattr(generation_utils.GenerationMixin, "_optimize_model_for_decode")
GROUPED_MM, BATCHED_MM = "grouped_mm", "batched_mm"


@dataclass
class InferenceStep:
    model: nn.Module
    config: PretrainedConfig
    setup: TrainingSetup
    optimizer: None = None
    scaler: None = None
    kept_outputs: None = None
    processors_used: str = ""  # the logits processors generate() built, for the report
    dropped_cache: str = ""  # where the model dropped its cache part-way, for the report

    def prime(self, batch: Batch) -> None:
        """Nothing persists from one generation to the next."""

    @torch.no_grad()
    def run(self, batch: Batch, on_phase: OnPhase = lambda phase: None, micro_steps: int = 1, recorder=None) -> None:
        """Prefill, then the decode step at the longest cache. ``recorder``, when recording, is paused while
        the cache and ids grow, and told which storages are the cache."""
        setup, model = self.setup, self.model
        on_phase(Phase.PREFILL)
        parameters = set(inspect.signature(model.forward).parameters)
        with _streams_traced():
            cache = self._cache()
        if recorder is not None and recorder.placement is not None:
            for tensor in _made_with(cache):  # host tensors, which each layer copies to its GPU (lazy_initialization)
                recorder.place(tensor, on_device=False)
        # generate()'s own kwargs, which it keeps until it returns (the prompt's position ids among them)
        mask = _prompt_mask(batch.input_ids) if parameters & {"attention_mask", "position_ids"} else None
        kept = mask if "attention_mask" in parameters and not DROPS_ALL_ONES_MASK else None
        kwargs = {CACHE_KWARG: cache, "use_cache": True, "attention_mask": kept}
        if "position_ids" in parameters:
            kwargs["position_ids"] = _positions(mask)
        del mask
        if setup.logits_to_keep and "logits_to_keep" in parameters:
            kwargs["logits_to_keep"] = setup.logits_to_keep
        # generate() also passes the prompt as encoder_input_ids, to ask whether any id is negative (a value a trace
        # does not have); only the encoder-side penalties, which these settings leave off, read the answer
        prepared, _ = model._prepare_generation_config(generation_config(model, setup))  # the defaults filled in
        processors = model._get_logits_processor(
            generation_config=prepared,
            input_ids_seq_length=batch.input_ids.shape[1],
            device=batch.input_ids.device,
            model_kwargs=kwargs,
        )
        self.processors_used = ", ".join(_described(processor) for processor in processors) or "none"
        state = _Sampling(model, batch.input_ids, kwargs, processors, setup.sampling is not None)
        with _offloading(cache, recorder) if getattr(cache, "offloading", False) else nullcontext():
            state.forward(batch.input_ids.shape[1], first=True)
            _mark_cache(state.cache, recorder)
            if setup.max_new_tokens == 1:
                return
            last = batch.input_ids.shape[1] + setup.max_new_tokens - 1  # the ids' length at the last forward
            refill = getattr(self.config, "original_max_position_embeddings", None)
            refill = None if refill is None else refill + 1
            restarted = False
            with _decoding(model, setup):
                for length in _lengths_traced(state.ids.shape[1], last, refill):
                    _advance(state, length, recorder, grow_cache=not restarted)
                    drops, tokens = _next_inputs(state, recorder)
                    if length == refill and length < last and not drops:
                        continue  # a decode step like the last, with a shorter cache
                    if drops:
                        self.dropped_cache = (
                            "the model's prepare_inputs_for_generation drops the cache at sequence length "
                            f"{length}, and the forward runs {tokens} tokens into a new cache, the old one alive "
                            "meanwhile; traced"
                        )
                    on_phase(Phase.PREFILL if tokens > 1 else Phase.DECODE)
                    state.forward(1)
                    _mark_cache(state.cache, recorder)
                    # transformers 5.17 drops the cache but runs the one new token: every later step finds a cache of
                    # fewer than original_max_position_embeddings tokens and drops it again
                    restarted = drops and tokens == 1

    def _cache(self):
        """The cache generate() makes for ``setup.cache`` (``_prepare_cache_for_generation``)."""
        setup, config = self.setup, self.config
        offloading = setup.cache.startswith("offloaded")
        if setup.cache in ("static", "offloaded_static"):  # sized to max_length - 1
            length = setup.seq_len + setup.max_new_tokens - 1
            cache = StaticCache(config=config, max_cache_len=length, offloading=offloading)
            if offloading:
                _offloads_a_layer(cache)
            return cache
        if setup.cache == "quantized":
            if setup.cache_backend == "fp8" and not FP8_CACHE:
                raise UserError(
                    f"--cache-backend fp8: transformers {transformers.__version__} has no FP8 QuantizedCache "
                    "(Fp8QuantizedLayer came in a later 5.x): upgrade transformers, or choose another --cache."
                )
            try:
                return QuantizedCache(backend=setup.cache_backend, config=config)
            except ValueError as error:  # layers other than full attention
                raise UserError(f"--cache quantized: transformers refuses this model: {error}") from None
        return DynamicCache(config=config, offloading=offloading)


CACHES = {
    "dynamic": "DynamicCache: grows by concatenation",
    "static": "StaticCache: allocated for the prompt and every new token up front",
    "offloaded": "DynamicCache(offloading=True): every layer's keys and values in host memory, but the layer being "
    "updated and the next one, prefetched on a stream of its own",
    "offloaded_static": "StaticCache(offloading=True): every full-attention layer in host memory, but the layer being "
    "updated and the next one, prefetched on a stream of its own; sliding-window layers stay on the GPU",
    "quantized": "QuantizedCache(backend='fp8'): keys and values stored in float8_e4m3fn with a float32 scale per "
    "layer, each layer dequantized whole to the model's dtype (through float32) at every update",
}


def describe_generation(setup: TrainingSetup) -> dict[str, str]:
    """The generation the trace follows, for the report."""
    tokens = setup.max_new_tokens
    traced = "the prefill of the prompt" + (
        f", then the last decode step (the cache holds {setup.seq_len + tokens - 2} tokens before it)"
        if tokens > 1
        else " (one new token: no decode step)"
    )
    sampling = setup.sampling
    decoding = (
        "greedy (do_sample=False)"
        if sampling is None
        else f"sampling (do_sample=True, temperature={sampling.temperature:g}, top_k={sampling.top_k}, "
        f"top_p={sampling.top_p:g})"
    )
    logits = {0: "all positions", 1: "the last position, as generate() passes logits_to_keep=1"}
    return {
        "step": f"model.generate(), {decoding}, {tokens} new tokens with no stop token, under torch.no_grad(); "
        f"traced: {traced}",
        "kv_cache_class": CACHES[setup.cache],
        "prefill_logits": logits.get(setup.logits_to_keep, f"the last {setup.logits_to_keep} positions"),
    }


def _described(processor) -> str:
    """A logits processor by its class and settings, e.g. ``TopKLogitsWarper(top_k=50)``."""
    settings = {name: value for name, value in vars(processor).items() if isinstance(value, int | float)}
    return f"{type(processor).__name__}({', '.join(f'{name}={value:g}' for name, value in settings.items())})"


def _offloads_a_layer(cache) -> None:
    """StaticCache(offloading=True) offloads only full-attention layers; with none, its first prefetch fails to find
    one (``Cache.prefetch``: ValueError), as generate() would."""
    try:
        cache.prefetch(0, cache.only_non_sliding)  # nothing to move before the first update
    except ValueError:
        raise UserError(
            "--cache offloaded_static offloads the full-attention layers only, and this model has none (every layer "
            "slides a window): transformers' own prefetch fails on it. Use --cache offloaded or static."
        ) from None


def generation_config(model: nn.Module, setup: TrainingSetup) -> GenerationConfig:
    """The generation config generate() is called with: the model's own, without a stop or pad token (every
    sequence runs to ``max_new_tokens``), greedy or sampling, and the cache, as the setup says; generate() fills in
    its global defaults (``_prepare_generation_config``: top-k 50 when sampling)."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = config.pad_token_id = None
    config.max_new_tokens = setup.max_new_tokens
    config.do_sample = setup.sampling is not None
    if setup.sampling is not None:
        config.temperature, config.top_k, config.top_p = (
            setup.sampling.temperature,
            setup.sampling.top_k,
            setup.sampling.top_p,
        )
    config.cache_implementation = None if setup.cache == "dynamic" else setup.cache
    if setup.cache == "quantized":
        config.cache_config = {"backend": setup.cache_backend}
    return config


def _prompt_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """``_prepare_attention_mask_for_generation`` for a prompt without padding (no pad token): all ones."""
    return torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``_prepare_position_ids_for_generation`` over the all-ones mask of a prompt without padding."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 0)


class _Sampling:
    """What ``_sample`` holds from one iteration to the next: the ids so far, the model kwargs, the last float32
    logits, the processed scores, the probabilities when sampling, the tokens and the unfinished flags. Each is
    replaced as ``_sample`` rebinds it, so that the old tensor is released when the new one exists. The forward's
    inputs and the kwargs' growth come from transformers' own ``prepare_inputs_for_generation`` and
    ``_update_model_kwargs_for_generation``, the scores from its own logits processors."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, kwargs: dict, processors, sample: bool) -> None:
        self.model, self.ids, self.kwargs = model, input_ids, dict(kwargs)
        self.processors, self.sample = processors, sample
        self.logits = self.scores = self.probs = self.tokens = None
        self.unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)

    def forward(self, new_tokens: int, first: bool = False) -> None:
        """One iteration: the forward over the last ``new_tokens`` ids, then the kwargs grow, the last logits
        are copied to float32, processed, and a token is chosen (the previous iteration's tensors are still
        referenced meanwhile), appended, and the stopping criteria are asked (a maximum length only)."""
        inputs = self.model.prepare_inputs_for_generation(
            self.ids, next_sequence_length=new_tokens, is_first_iteration=first, **self.kwargs
        )
        outputs = self.model(**inputs, return_dict=True)
        del inputs
        self.kwargs = self.model._update_model_kwargs_for_generation(outputs, self.kwargs)
        self.logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)
        self.scores = self.processors(self.ids, self.logits)
        if self.sample:
            self.probs = nn.functional.softmax(self.scores, dim=-1)
            self.tokens = _multinomial(self.probs).squeeze(1)
        else:
            self.tokens = torch.argmax(self.scores, dim=-1)
        self.ids = torch.cat([self.ids, self.tokens[:, None]], dim=-1)
        rows, device = self.ids.shape[0], self.ids.device
        none_done = torch.full((rows,), False, dtype=torch.bool, device=device)  # StoppingCriteriaList.__call__
        at_max_length = torch.full((rows,), False, dtype=torch.bool, device=device)  # MaxLengthCriteria
        self.unfinished = self.unfinished & ~(none_done | at_max_length)
        self.unfinished.max() == 0  # noqa: B015 - the flag generate() reads to stop
        del outputs

    @property
    def cache(self):
        return self.kwargs[CACHE_KWARG]

    def skip(self, tokens: int, grow_cache: bool = True) -> None:
        """The cache, ids and kwargs as ``tokens`` more iterations leave them."""
        if tokens == 0:
            return
        if grow_cache:
            _grow(self.cache, tokens)
        self.ids = torch.cat([self.ids, self.ids.new_zeros((self.ids.shape[0], tokens))], dim=-1)
        grown = CausalLMOutputWithPast(**{CACHE_KWARG: self.cache})
        self.kwargs = self.model._update_model_kwargs_for_generation(grown, self.kwargs, num_new_tokens=tokens)


@contextmanager
def _decoding(model: nn.Module, setup: TrainingSetup) -> Iterator[None]:
    """generate()'s loop after the prefill. On a GPU, transformers runs MoE experts that use grouped_mm as batched_mm
    there (``GenerationMixin._optimize_model_for_decode``), which gathers each routed token's experts' weights: a
    copy per token and expert. The traced model's tensors sit on the CPU, where generate() leaves grouped_mm, so the
    target decides."""
    implementations = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else {}
    if not (decodes_with_batched_mm(setup) and GROUPED_MM in implementations.values()):
        yield
        return
    model.set_experts_implementation({k: BATCHED_MM if v == GROUPED_MM else v for k, v in implementations.items()})
    try:
        yield
    finally:
        model.set_experts_implementation(implementations)


def decodes_with_batched_mm(setup: TrainingSetup) -> bool:
    """Whether generate() runs a MoE model's grouped_mm experts as batched_mm in the decode steps of ``setup``."""
    return DECODES_WITH_BATCHED_MM and setup.mode == "inference" and setup.target is Target.CUDA


def _lengths_traced(first: int, last: int, refill: int | None) -> list[int]:
    """The ids' lengths at the forwards traced after the prefill, which run at ``first`` to ``last``: the last,
    where the cache is longest, and the one at ``refill``, where the model may drop the cache and run the whole
    sequence again (:func:`_next_inputs`). When that is the last forward, the longest decode step is the one
    before it."""
    if refill is None or not first <= refill <= last:
        return [last]
    if refill < last:
        return [refill, last]
    return [refill - 1, refill] if refill > first else [refill]


def _advance(state: _Sampling, length: int, recorder, grow_cache: bool = True) -> None:
    """Grow the cache, ids and kwargs, without recording, to what they hold when the ids reach ``length`` tokens:
    the decode steps in between repeat a traced one with shorter tensors (``grow_cache`` False: each dropped the
    cache and left one of the same length). The storages made are then registered on the GPUs the cache's layers
    were on."""
    devices = [recorder.device_of(tensor) if recorder else 0 for tensor in _cache_tensors(state.cache)]
    with recorder.paused() if recorder else nullcontext():
        state.skip(length - state.ids.shape[1], grow_cache)
    if recorder:
        _track_cache(state.cache, recorder, devices)
        recorder.track_created(state.ids, Role.INPUT, "generated ids")
        if state.kwargs.get("position_ids") is not None:
            recorder.track_created(state.kwargs["position_ids"], Role.INPUT, "position ids")
        if state.kwargs.get("attention_mask") is not None:
            recorder.track_created(state.kwargs["attention_mask"], Role.INPUT, "attention mask")


def _next_inputs(state: _Sampling, recorder) -> tuple[bool, int]:
    """Whether the model's ``prepare_inputs_for_generation`` drops generate()'s cache for the next forward, and
    how many tokens that forward runs. Phi-3's, PhiMoE's and Phi-4-multimodal's drop it at the first token past
    ``original_max_position_embeddings``, where longrope switches from its short factors to its long ones: from
    transformers 5.24 the forward runs the whole sequence again into a new cache (modeling_phi3.py)."""
    with recorder.paused() if recorder else nullcontext():
        inputs = state.model.prepare_inputs_for_generation(
            state.ids, next_sequence_length=1, is_first_iteration=False, **state.kwargs
        )
    return inputs.get(CACHE_KWARG) is not state.cache, inputs["input_ids"].shape[1]


def _multinomial(probs: torch.Tensor) -> torch.Tensor:
    """``torch.multinomial(probs, num_samples=1)`` as ATen runs it on CPU and CUDA alike (native/Distributions.cpp,
    the fast path for one sample): an exponential sample ``q`` of the probabilities' shape and dtype, divided in
    place, then its argmax. ``q`` is allocated inside the kernel, where a trace of the op alone would not see it."""
    q = torch.empty_like(probs).exponential_(1)
    torch.div(probs, q, out=q)
    return torch.argmax(q, dim=-1, keepdim=True)


# A linear-attention layer's cache (Qwen3-Next's gated delta net): a convolution and a recurrent state per layer, of
# fixed size, updated in place (transformers' LinearAttentionLayer).
LINEAR_ATTENTION_STATES = ("conv_states", "recurrent_states")
# A quantized layer's states: (values, scale) pairs (cache_utils.py BaseQuantizedLayer)
QUANTIZED_STATES = ("_quantized_keys", "_quantized_values")


def _layer_tensors(layer) -> list[torch.Tensor]:
    tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
    tensors += [state for name in LINEAR_ATTENTION_STATES for state in (getattr(layer, name, None) or {}).values()]
    tensors += [tensor for name in QUANTIZED_STATES for tensor in (getattr(layer, name, None) or ())]
    return [tensor for tensor in tensors if isinstance(tensor, torch.Tensor)]


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [tensor for layer in cache.layers for tensor in _layer_tensors(layer)]


def _made_with(cache) -> list[torch.Tensor]:
    """What the cache's layers hold when it is made: 0-dim counters (``cumulative_length``, the sliding window)."""
    return [value for layer in cache.layers for value in vars(layer).values() if isinstance(value, torch.Tensor)]


def _track_cache(cache, recorder, devices: list[int]) -> None:
    """The cache's storages made while paused: on the GPU each layer's were on before (``devices``, one per tensor
    of ``_cache_tensors``), or in host memory for the layers an offloading cache holds there."""
    pairs = [(layer, tensor) for layer in cache.layers for tensor in _layer_tensors(layer)]
    for (layer, tensor), device in zip(pairs, devices, strict=True):
        on_host = getattr(layer, "_on_host", False)
        recorder.track_created(tensor, Role.KV_CACHE, "KV cache", device=device, on_device=not on_host)


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
            quantized = getattr(layer, "_quantized_keys", None)
            keys = layer.keys if quantized is None else quantized[0]
            values = layer.values if quantized is None else layer._quantized_values[0]
            dtype = layer.keys.dtype  # a quantized layer takes states in the model's dtype
            layer.update(
                keys.new_zeros((*keys.shape[:2], chunk, keys.shape[-1]), dtype=dtype),
                values.new_zeros((*values.shape[:2], chunk, values.shape[-1]), dtype=dtype),
            )


@contextmanager
def _offloading(cache, recorder) -> Iterator[None]:
    """transformers' own offloading (``Cache.update``: prefetch the next offloaded layer, update this one, offload
    it) run on the CPU trace: its stream synchronisation waits for nothing, and a layer's ``offload`` and
    ``prefetch`` copy its keys and values to host memory and back as ``.to("cpu")`` and ``.to(self.device)`` do on
    a GPU, the host copies counted off the device, the prefetched ones allocated on the prefetch stream."""

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.to(copy=True)
        if recorder:
            recorder.place(host, on_device=False)
        return host

    def offload(layer) -> None:  # CacheLayerMixin.offload
        if layer.is_initialized:
            layer.keys, layer.values = to_host(layer.keys), to_host(layer.values)
            layer._on_host = True

    def prefetch(layer) -> None:  # CacheLayerMixin.prefetch: back to the layer's device if it is not there
        if layer.is_initialized and getattr(layer, "_on_host", False):
            layer.keys, layer.values = layer.keys.to(copy=True), layer.values.to(copy=True)
            layer._on_host = False

    with ExitStack() as stack:
        stack.enter_context(patch.object(torch.cuda, "default_stream", lambda device=None: _TracedStream()))
        stack.enter_context(patch.object(cache_utils.CacheLayerMixin, "offload", offload))
        stack.enter_context(patch.object(cache_utils.CacheLayerMixin, "prefetch", prefetch))
        stack.enter_context(patch.object(cache, "prefetch_stream", _TracedStream()))
        yield


class _TracedStream(nullcontext):
    """A stream on the CPU trace: its work runs in order, so there is nothing to wait for."""

    def wait_stream(self, other) -> None:
        pass


@contextmanager
def _streams_traced() -> Iterator[None]:
    """An offloading cache makes its prefetch stream as it is made (``torch.Stream()``, ``torch.cuda.Stream()`` before
    torch 2.7), which a CUDA build of torch on a machine without a GPU refuses: the trace's stands in for it."""
    with patch.object(torch, "Stream", _TracedStream), patch.object(torch.cuda, "Stream", _TracedStream):
        yield
