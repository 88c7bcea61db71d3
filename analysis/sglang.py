"""What SGLang prints at start-up, per GPU: the weights it loaded, and the KV-cache pool ``mem_fraction_static``
leaves them, in tokens (``max_total_num_tokens``).

SGLang sizes its pool once, after loading the weights (python/sglang/srt/model_executor/model_runner.py,
``ModelRunner.profile_max_num_token``, unchanged from v0.3 to v0.4.x; the same arithmetic is
``profile_available_bytes`` in pool_configurator.py today)::

    rest_memory          = available_after_load - available_before_load x (1 - mem_fraction_static)
    max_total_num_tokens = rest_memory // cell_size

* ``available_before_load`` ("Load weight begin. avail mem"): the free memory ``init_torch_distributed`` measured,
  the smallest over the ranks: the device's total less the CUDA context and NCCL's buffers, which are not
  predicted here: ``--non-torch-memory`` takes them and defaults to 0.
* ``available_after_load`` ("Load weight end. avail mem"): the same less what loading the weights took of the
  device, which ``get_available_gpu_memory`` reads with ``torch.cuda.mem_get_info`` after ``empty_cache()``: the
  caching allocator's segments, not the tensors in them (:func:`loaded_bytes`). SGLang's parallel layers split the
  weights as vLLM's do (it carries vLLM's linear.py and vocab_parallel_embedding.py), so they are counted by
  analysis/vllm_weights.py.
* ``cell_size``: the KV cache of one token over every layer. Key and value heads per rank,
  ``max(1, num_key_value_heads // tp)`` (``ModelConfig.get_num_kv_heads``), times ``head_dim``, layers, 2 and the
  cache dtype's bytes; for MLA (DeepSeek) ``kv_lora_rank + qk_rope_head_dim`` per layer, the same on every rank.

Whatever is not the weights or the pool (activations, CUDA graphs, the sampler) lives in the
``1 - mem_fraction_static`` share of the memory measured before loading. SGLang v0.4.x chose the fraction by the
tensor-parallel degree alone (server_args.py, ``ServerArgs.__post_init__``); later versions derive it from the GPU's
memory, the chunked-prefill size and the CUDA-graph batch sizes (PR #10975), so for them it is read from the log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from analysis.vllm_weights import RankWeights, load_replay, rank_weights, rotary_caches
from tracer.errors import UserError
from tracer.published import quant_method

KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# ServerArgs.__post_init__ in v0.4.x: the least tensor-parallel degree of each step, and its fraction
DEFAULT_FRACTIONS = ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87), (1, 0.88))
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class SglangSetup:
    """``sglang.launch_server``'s flags that change memory, by SGLang's names."""

    gpu_memory_bytes: int  # the device's total
    tensor_parallel_size: int = 1
    mem_fraction_static: float | None = None  # None: v0.4.x's default for the degree
    kv_cache_dtype: str = "auto"
    dtype: torch.dtype | None = None  # None: the checkpoint's 16-bit dtype
    non_torch_bytes: int = 0  # in use before the weights load: CUDA context, NCCL


@dataclass(frozen=True)
class SglangStartup:
    setup: SglangSetup
    mem_fraction_static: float
    weights: RankWeights
    dtype: torch.dtype
    cell_bytes: int  # one token's KV cache over every layer on one rank
    loaded_bytes: int  # what loading the weights took of the device: the allocator's segments holding them

    @property
    def available_before_load(self) -> int:
        return self.setup.gpu_memory_bytes - self.setup.non_torch_bytes

    @property
    def available_after_load(self) -> int:
        return self.available_before_load - self.loaded_bytes

    @property
    def rest_bytes(self) -> int:
        return self.available_after_load - int(self.available_before_load * (1 - self.mem_fraction_static))

    @property
    def max_total_num_tokens(self) -> int:
        return max(0, self.rest_bytes) // self.cell_bytes


def default_mem_fraction_static(tp: int) -> float:
    """SGLang v0.4.x's ``mem_fraction_static`` when none is given: less for more GPUs, whose NCCL buffers and
    custom all-reduce take more of the memory the weights and the pool may not."""
    return next(fraction for least, fraction in DEFAULT_FRACTIONS if tp >= least)


def sglang_startup(config, setup: SglangSetup) -> SglangStartup:
    """SGLang's start-up memory on one tensor-parallel rank of ``config`` served with ``setup``."""
    from transformers import AutoModelForCausalLM

    _check(config, setup)
    dtype = setup.dtype or _served_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    fraction = setup.mem_fraction_static or default_mem_fraction_static(setup.tensor_parallel_size)
    tp = setup.tensor_parallel_size
    lengths, rotary_dim = rotary_caches(config)
    rotary = sum(lengths) * rotary_dim * torch.float32.itemsize
    weights = RankWeights(rank_weights(model, config, tp).parameter_bytes, rotary)
    loaded = loaded_bytes(model, config, tp)
    return SglangStartup(setup, fraction, weights, dtype, cell_bytes(config, setup, dtype), loaded)


def loaded_bytes(model: nn.Module, config, tp: int) -> int:
    """What loading ``model`` takes of one of ``tp`` ranks' device, as SGLang builds it (v0.4.2.post1 to 0.5.8):
    :func:`load_replay`, with the rotary cache SGLang keeps in float32 on CUDA (rotary_embedding.py, "cache needs to
    be in FP32"); then ``empty_cache()`` and what the caching allocator still holds in segments. The checkpoint's
    tensors are read on the host and copied into the parameters, so they leave nothing behind."""
    allocator = load_replay(model, config, tp, rotary_dtype=torch.float32)
    allocator.empty_cache()
    return allocator.reserved


def cell_bytes(config, setup: SglangSetup, dtype: torch.dtype) -> int:
    """``cell_size`` of ``profile_max_num_token``: one token's keys and values over every layer on one rank."""
    cache_dtype = KV_CACHE_DTYPES[setup.kv_cache_dtype] or dtype
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        return (config.kv_lora_rank + config.qk_rope_head_dim) * layers * cache_dtype.itemsize
    heads = config.num_attention_heads
    head = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = max(1, (getattr(config, "num_key_value_heads", None) or heads) // setup.tensor_parallel_size)
    return kv_heads * head * layers * 2 * cache_dtype.itemsize


def _served_dtype(config) -> torch.dtype:
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored.removeprefix("torch."), None)
    if stored not in (torch.bfloat16, torch.float16):
        raise UserError(
            f"this checkpoint is stored in {stored}; SGLang's dtype=auto for it depends on its version: "
            "pass --dtype bf16 or --dtype fp16 as your launch_server's --dtype."
        )
    return stored


def _check(config, setup: SglangSetup) -> None:
    fraction = setup.mem_fraction_static
    if fraction is not None and not 0 < fraction < 1:
        raise UserError(f"--mem-fraction-static {fraction} must be in (0, 1).")
    if setup.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UserError(f"--kv-cache-dtype {setup.kv_cache_dtype}: SGLang's are {', '.join(KV_CACHE_DTYPES)}.")
    if setup.tensor_parallel_size < 1:
        raise UserError("--tensor-parallel-size must be at least 1.")
    method = quant_method(config)
    if method:
        raise UserError(
            f"this checkpoint is published quantized ({method}); serve --engine sglang models 16-bit checkpoints. "
            "Pass a config.json without quantization_config to size the unquantized model."
        )
    if not isinstance(getattr(config, "intermediate_size", None), int):
        raise UserError(
            f"serve models decoders laid out as Llama's (Llama, Mistral, Mixtral, Qwen, DeepSeek); "
            f"{config.model_type} is not modelled yet."
        )
    if SLIDING in (getattr(config, "layer_types", None) or ()):
        raise UserError(
            "this model mixes sliding-window and full attention; SGLang gives it two pools "
            "(HybridSWAPoolConfigurator, split by --swa-full-tokens-ratio), which serve --engine sglang does not "
            "model. Use --engine vllm."
        )


def startup_json(startup: SglangStartup) -> dict:
    return {
        "engine": "sglang",
        "tensor_parallel_size": startup.setup.tensor_parallel_size,
        "total_gpu_memory_bytes": startup.setup.gpu_memory_bytes,
        "non_torch_bytes": startup.setup.non_torch_bytes,
        "mem_fraction_static": startup.mem_fraction_static,
        "available_before_load_bytes": startup.available_before_load,
        "weights_bytes": startup.weights.total,
        "loaded_bytes": startup.loaded_bytes,
        "available_after_load_bytes": startup.available_after_load,
        "kv_cell_bytes": startup.cell_bytes,
        "kv_pool_bytes": startup.max_total_num_tokens * startup.cell_bytes,
        "max_total_num_tokens": startup.max_total_num_tokens,
    }


def render_startup(model, startup: SglangStartup) -> str:
    """The report, in the order and the words of SGLang's own start-up log (its "GB" are GiB)."""
    from tracer.units import GIB

    setup = startup.setup
    tp = setup.tensor_parallel_size

    def gb(nbytes: int) -> str:
        return f"{nbytes / GIB:.2f} GB"

    if setup.mem_fraction_static:
        why = "--mem-fraction-static"
    else:
        why = (
            f"SGLang v0.4.x's default for tensor parallel {tp}; later versions derive it from the GPU's memory "
            "and other settings: pass --mem-fraction-static from your log's server_args"
        )
    lines = [
        f"{model.model_id} served by SGLang, tensor parallel {tp}; per GPU:",
        f"  mem_fraction_static={startup.mem_fraction_static} ({why})",
        f"  Load weight begin. avail mem={gb(startup.available_before_load)} (total {gb(setup.gpu_memory_bytes)} "
        f"less --non-torch-memory {gb(setup.non_torch_bytes)}: CUDA context and NCCL, not predicted)",
        f"  Load weight end. dtype={startup.dtype}, avail mem={gb(startup.available_after_load)}, "
        f"mem usage={gb(startup.loaded_bytes)} (parameters {gb(startup.weights.parameter_bytes)}, rotary cos/sin "
        f"cache {gb(startup.weights.rotary_bytes)} in float32, the caching allocator's segments round them up by "
        f"{gb(startup.loaded_bytes - startup.weights.total)})",
        f"  rest_memory = {gb(startup.available_after_load)} - {gb(startup.available_before_load)} x "
        f"(1 - {startup.mem_fraction_static}) = {gb(startup.rest_bytes)}",
        f"  KV cache cell: {startup.cell_bytes:,} bytes per token over {model.config.num_hidden_layers} layers",
        f"  KV Cache is allocated. #tokens: {startup.max_total_num_tokens}, "
        f"size: {gb(startup.max_total_num_tokens * startup.cell_bytes)}",
        f"  max_total_num_tokens={startup.max_total_num_tokens}",
    ]
    if startup.max_total_num_tokens == 0:
        lines.append(
            "  No memory is left for the KV cache: SGLang stops with 'Not enough memory. Please try to increase "
            "--mem-fraction-static.' Raise --mem-fraction-static or add GPUs (--tensor-parallel-size)."
        )
    return "\n".join(lines)
