"""What vLLM's V1 engine prints at start-up, per GPU: weights, the profile run's activation peak, and the KV cache
that fills the rest of ``gpu_memory_utilization``.

vLLM sizes its KV cache once (vllm/v1/worker/gpu_worker.py, ``Worker.determine_available_memory``)::

    requested   = total_gpu_memory x gpu_memory_utilization
    kv_cache    = requested - (weights + non_torch_increase + torch_peak_increase)

* ``weights``: what loading the model allocated on the rank ("Model loading took X GiB"), see
  analysis/vllm_weights.py.
* ``torch_peak_increase`` ("PyTorch activation peak memory"): the allocator's peak during
  ``GPUModelRunner.profile_run`` above the weights (``gpu_worker.py``, the peak counter reset before it): one eager
  forward of ``max_num_batched_tokens`` tokens (``_dummy_run``) and the sampler on the last token of each of
  ``min(max_num_seqs, max_num_batched_tokens)`` dummy requests (``_dummy_sampler_run``). :func:`profile_peak`
  follows vLLM's layers: the fused qkv and gate_up projections (``QKVParallelLinear``,
  ``MergedColumnParallelLinear``), ``SiluAndMul``, fused-add RMSNorm in place, the MoE layers' router and the
  fused experts' workspace (``WorkspaceManager``, kept once made); the cuBLAS workspace of the first matmul stays
  too. The sampler (vllm/v1/sample) holds, besides the forward's hidden states, the last tokens' and their random
  stand-in: the gathered logits in the model's dtype, their float32 copy, the Triton top-k/top-p kernel's buffer
  of one vocabulary row per program (``topk_topp_triton.py``: ``min(next_power_of_2(programs), SMs)`` rows, kept in
  a module cache; from 8 rows on, below them the sort path: float32 values and int64 indices), the probabilities
  and ``random_sample``'s exponential draws, all float32 (FlashInfer's sampler is opt-in:
  ``VLLM_USE_FLASHINFER_SAMPLER``).
* ``non_torch_increase``: memory taken outside PyTorch during start-up (NCCL, cuBLAS workspaces, custom
  all-reduce buffers). It depends on the driver and the libraries, not on the model, so it is not predicted:
  ``--non-torch-memory`` takes it from the user's log and defaults to 0.

The KV cache is then cut into blocks (vllm/v1/core/kv_cache_utils.py, ``get_num_blocks``)::

    num_blocks = kv_cache // page_size // layers_per_group

with ``page_size = 2 x block_size x kv_heads_per_rank x head_size x dtype_bytes`` for full and sliding-window
attention and ``block_size x head_size x dtype_bytes`` for MLA, which caches DeepSeek's compressed latent
(``kv_lora_rank + qk_rope_head_dim``, one head, the same on every rank; ``MLAAttentionSpec``). Key/value heads
per rank are ``max(1, kv_heads // tp)`` (``ModelConfig.get_num_kv_heads``). A model that mixes sliding-window and
full layers is laid out by the hybrid allocator (``_get_kv_cache_groups_uniform_page_size``): each kind's
layers in groups of the smaller kind's count, every group one block table, so "GPU KV cache size" is
``num_blocks // groups x block_size`` tokens. Uniform models log ``num_blocks x block_size``. Maximum
concurrency is the blocks over what one request of ``max_model_len`` takes
(``get_max_concurrency_for_kv_cache_config``).

CUDA graphs are captured after the KV cache is allocated (``Worker.compile_or_warm_up_model`` ->
``GPUModelRunner.capture_model``), from what ``gpu_memory_utilization`` leaves free. vLLM 0.19 also measures them
beforehand (``profile_cudagraph_memory``, "Estimated CUDA graph memory") but subtracts that from the KV cache only
with ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``, which defaults to 0 (vllm/envs.py): by default the KV cache is
the same with or without graphs, and the process ends up holding ``requested`` plus the graphs.
``capture_model`` logs "Graph capturing finished in N secs, took X GiB", the drop in ``torch.cuda.mem_get_info``'s
free memory across the captures. :func:`cuda_graphs` follows what it captures by default:

* the sizes (``VllmConfig._set_cudagraph_sizes``): 1, 2, 4, multiples of 8 below 256, multiples of 16 from 256, up
  to ``min(2 x max_num_seqs, 512, max_num_batched_tokens)`` (gpt-oss raises the 512 to 1024,
  ``GptOssForCausalLMConfig``), captured largest first;
* the modes (``CompilationConfig.cudagraph_mode`` FULL_AND_PIECEWISE): for each size a PIECEWISE graph of a mixed
  batch (torch.compile's pieces between the attention layers, one graph per piece) and a FULL graph of a uniform
  decode batch (the whole forward, attention included); Llama 4's chunked local attention has no FULL graphs
  (PIECEWISE only);
* the memory pool every capture shares (``graph_capture``, ``CUDAGraphWrapper``'s ``graph_pool``): the largest capture's
  intermediate activations, which the smaller captures reuse. A piece's output is kept only until the next piece reads
  it and the last one is a weak reference, so the pool is one forward's transient working set of the largest size, not
  one per graph: the decoder layer's tensors as in the profile run (:func:`_layer_peak`'s attention/MLP/MoE parts) at
  that many tokens; the fused experts' workspace, made in the profile run at ``max_num_batched_tokens`` and kept, is not
  the pool's. The FULL decode graphs add FlashAttention 3's split-KV accumulators (``FlashAttentionMetadataBuilder``:
  ``max_num_splits = flash_attn_max_num_splits_for_cuda_graph`` = 32 under full graphs, so FA3's ``mha_fwd`` allocates
  ``out_accum`` [32, heads, tokens, head_dim_v] and ``softmax_lse_accum`` [32, heads, tokens] in float32): on Hopper,
  with the FLASH_ATTN and FLASH_ATTN_MLA backends (MLA's value is the latent, ``kv_lora_rank`` wide). Gemma 3's
  multimodal checkpoints run on TRITON_ATTN (its image-prefix attention) and gpt-oss's attention sinks showed none in
  llm-d's log: no accumulators for them.

Not modelled: the memory the CUDA driver keeps for each instantiated graph (kernel nodes, their parameters), which
``mem_get_info`` counts and which grows with the number of graphs (sizes x pieces). vLLM's own profiler measures it
(at least 1 MiB a graph, its floor) and no public source states it per graph, so the figure printed is the pool, a
lower bound of the logged one; the graphs captured are counted beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from analysis.vllm_weights import (
    FLASHINFER_MLA_WORKSPACE,
    HOPPER,
    VOCAB_PADDING,
    WNA16,
    RankWeights,
    load_replay,
    rank_weights,
    vision_bytes,
)
from tracer.cuda.workspaces import cublas_workspace_bytes
from tracer.errors import UserError
from tracer.expert_parallel import routed_experts
from tracer.gpus import Gpu, find_gpu
from tracer.published import quant_method
from tracer.units import next_power_of_2, round_up

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # CacheConfig.gpu_memory_utilization
DEFAULT_BLOCK_SIZE = 16  # CacheConfig.block_size on CUDA
DEFAULT_MAX_NUM_SEQS = 256  # SchedulerConfig.max_num_seqs
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # EngineArgs' V1 default for the OpenAI server on most GPUs
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("fp8",)  # --quantization of a 16-bit checkpoint
SLIDING = "sliding_attention"
FLOAT32, INT32, INT64, BOOL = (dtype.itemsize for dtype in (torch.float32, torch.int32, torch.int64, torch.bool))
TRITON_TOP_K_TOP_P_ROWS = 8  # apply_top_k_top_p: the Triton kernel from 8 rows, the PyTorch sort below
WORKSPACE_ALIGNMENT = 256  # WorkspaceManager.get_simultaneous: each tensor's bytes rounded up to 256


@dataclass(frozen=True)
class VllmSetup:
    """``vllm serve``'s flags that change memory, by vLLM's names."""

    gpu_memory_bytes: int  # what torch.cuda.mem_get_info reports as the device's total
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    kv_cache_dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: torch.dtype | None = None  # None: the checkpoint's, as vLLM's dtype="auto" (fp32 served as bf16)
    non_torch_bytes: int = 0
    quantization: str | None = None  # "fp8": dynamic FP8 of a 16-bit checkpoint's linear layers
    gpu: Gpu = field(default_factory=lambda: find_gpu("h100"))  # its capability picks GPTQ's and AWQ's kernels


@dataclass(frozen=True)
class KvLayout:
    page_bytes: int  # one block of one layer
    kinds: dict[str, int]  # layer kind -> how many layers
    groups: int  # block tables (1 unless the hybrid allocator splits the layers)
    layers_per_group: int
    sliding_window: int | None


@dataclass(frozen=True)
class CudaGraphs:
    """What ``capture_model`` captures by default and the memory pool the captures share."""

    sizes: tuple[int, ...]  # cudagraph_capture_sizes, ascending (captured largest first)
    modes: dict[str, int]  # mode -> graphs per size: PIECEWISE one per piece, FULL one
    pool_bytes: int  # the largest capture's transient working set: the pool, a lower bound of "took X GiB"
    pool_parts: dict[str, int]  # by mode: the decoder layer's peak at the largest size (+ FA3's accumulators)

    @property
    def count(self) -> int:
        return len(self.sizes) * sum(self.modes.values())


@dataclass(frozen=True)
class VllmStartup:
    setup: VllmSetup
    max_model_len: int
    weights: RankWeights
    activation_peak_bytes: int
    activation_parts: dict[str, int] = field(default_factory=dict)
    layout: KvLayout | None = None
    graphs: CudaGraphs | None = None
    vision_missing: str = ""  # why a multimodal checkpoint's vision tower is not among the weights

    @property
    def requested_bytes(self) -> int:
        return int(self.setup.gpu_memory_bytes * self.setup.gpu_memory_utilization)

    @property
    def process_bytes(self) -> int:
        """What the process holds once the graphs are captured, at least: ``requested`` (weights, activation peak,
        non-torch memory and the KV cache fill it) plus the graphs' pool, which vLLM 0.19 does not take out of it."""
        return self.requested_bytes + (self.graphs.pool_bytes if self.graphs else 0)

    @property
    def kv_cache_bytes(self) -> int:
        return self.requested_bytes - self.weights.total - self.activation_peak_bytes - self.setup.non_torch_bytes

    @property
    def num_blocks(self) -> int:
        return max(0, self.kv_cache_bytes) // self.layout.page_bytes // self.layout.layers_per_group

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks // self.layout.groups * self.setup.block_size

    @property
    def max_concurrency(self) -> float:
        blocks_per_request = -(-self.max_model_len // self.setup.block_size) * self.layout.groups
        return self.num_blocks / blocks_per_request


def vllm_startup(config, setup: VllmSetup, multimodal=None, multimodal_missing: str = "") -> VllmStartup:
    """vLLM's start-up memory on one tensor-parallel rank of ``config`` served with ``setup``; ``multimodal``: the
    whole config of a checkpoint whose language model ``config`` is, whose vision tower vLLM loads too, or
    ``multimodal_missing``: why that config could not be built."""
    from transformers import AutoModelForCausalLM

    _check(config, setup)
    method = quant_method(config)
    if method not in (None, "mxfp4", *WNA16):
        raise UserError(
            f"this checkpoint is published quantized ({method}); serve models 16-bit checkpoints, vLLM's "
            "--quantization fp8 of them, GPTQ and AWQ checkpoints, and gpt-oss's MXFP4. Pass a config.json without "
            "quantization_config to size the unquantized model (with --quantization fp8 for FP8 weights)."
        )
    if method and setup.quantization:
        raise UserError(f"--quantization {setup.quantization}: this checkpoint is already quantized ({method}).")
    dtype = setup.dtype or _served_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    max_model_len = setup.max_model_len or config.max_position_embeddings
    if max_model_len > config.max_position_embeddings:
        raise UserError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"({config.max_position_embeddings}); vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    parts = profile_peak(config, setup, dtype.itemsize)
    tp = setup.tensor_parallel_size
    weights = rank_weights(model, config, tp, setup.quantization or method, setup.gpu.compute_capability)
    vision_missing = multimodal_missing
    if not (setup.quantization or method):  # vLLM's loading takes whole blocks; quantized layers' are not replayed
        blocks = load_replay(model, config, tp, rotary_dtype=dtype).allocated
        weights = dataclasses.replace(weights, rounding_bytes=blocks - weights.parameter_bytes - weights.rotary_bytes)
    if getattr(config, "kv_lora_rank", None) and setup.gpu.compute_capability[0] == HOPPER[0]:
        weights = dataclasses.replace(weights, workspace_bytes=FLASHINFER_MLA_WORKSPACE)
    if multimodal is not None:
        vision = vision_bytes(multimodal, tp, dtype)
        if vision is None:
            vision_missing = f"transformers has no image-text-to-text model for {type(multimodal).__name__}"
        else:
            weights = dataclasses.replace(weights, vision_bytes=vision)
    return VllmStartup(
        setup,
        max_model_len,
        weights,
        max(parts.values()),
        parts,
        kv_layout(config, setup, dtype.itemsize, max_model_len),
        cuda_graphs(config, setup, dtype.itemsize),
        vision_missing,
    )


def _served_dtype(config) -> torch.dtype:
    """vLLM's ``dtype="auto"`` (config.py, ``_resolve_auto_dtype``): the checkpoint's dtype, bf16 for fp32 ones."""
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored.removeprefix("torch."), None)
    return torch.bfloat16 if stored in (None, torch.float32) else stored


def _check(config, setup: VllmSetup) -> None:
    if not 0 < setup.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization {setup.gpu_memory_utilization} must be in (0, 1].")
    if setup.quantization not in (None, *QUANTIZATIONS):
        raise UserError(
            f"--quantization {setup.quantization}: only fp8 (dynamic FP8 of the linear layers) is modelled."
        )
    if setup.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UserError(f"--kv-cache-dtype {setup.kv_cache_dtype}: one of {', '.join(KV_CACHE_DTYPES)}.")
    if not isinstance(getattr(config, "intermediate_size", None), int):
        raise UserError(
            f"serve models decoders laid out as Llama's (intermediate_size, q/k/v/o and gate/up/down projections: "
            f"Llama, Mistral, Mixtral, Qwen, Gemma, Phi-3/4, DeepSeek); {config.model_type} is not modelled yet."
        )
    for name in ("tensor_parallel_size", "max_num_batched_tokens", "max_num_seqs", "block_size"):
        if getattr(setup, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1.")


def kv_layout(config, setup: VllmSetup, model_dtype_bytes: int, max_model_len: int) -> KvLayout:
    dtype_bytes = 1 if setup.kv_cache_dtype.startswith("fp8") else model_dtype_bytes
    layers = config.num_hidden_layers
    if getattr(config, "kv_lora_rank", None):
        head = config.kv_lora_rank + config.qk_rope_head_dim
        return KvLayout(setup.block_size * head * dtype_bytes, {"mla": layers}, 1, layers, None)
    heads = config.num_attention_heads
    head = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = max(1, (getattr(config, "num_key_value_heads", None) or heads) // setup.tensor_parallel_size)
    page = 2 * setup.block_size * kv_heads * head * dtype_bytes
    window = getattr(config, "sliding_window", None)
    types = list(getattr(config, "layer_types", None) or [])[:layers]
    sliding = sum(kind == SLIDING for kind in types) if types else (layers if window else 0)
    if window and window >= max_model_len:
        sliding = 0  # a window as long as any request is full attention (ModelConfig.get_sliding_window)
    full = layers - sliding
    kinds = {name: count for name, count in (("full", full), ("sliding", sliding)) if count}
    if len(kinds) == 1:
        return KvLayout(page, kinds, 1, layers, window if sliding else None)
    per_group = min(kinds.values())
    groups = sum(-(-count // per_group) for count in kinds.values())
    return KvLayout(page, kinds, groups, per_group, window)


def profile_peak(config, setup: VllmSetup, dtype_bytes: int) -> dict[str, int]:
    """The allocator's peak above the weights during ``profile_run``, by where it falls: the forward's decoder
    layer (attention, dense MLP, MoE) at ``max_num_batched_tokens``, then the sampler. Each counts what stays
    allocated once made: the cuBLAS workspace, and from the first MoE layer on the fused experts' workspace."""
    tokens = setup.max_num_batched_tokens
    cublas = cublas_workspace_bytes(setup.gpu)
    experts = moe_workspace_bytes(config, setup, dtype_bytes, tokens)
    parts = _layer_peak(config, setup, dtype_bytes, tokens)
    # a model's dense MLP layers come before its MoE layers (DeepSeek's first_k_dense_replace)
    parts = {part: nbytes + cublas + (0 if part == "mlp" else experts) for part, nbytes in parts.items()}
    parts["sampler"] = cublas + experts + _sampler_peak(config, setup, dtype_bytes)
    return parts


def _sampler_peak(config, setup: VllmSetup, dtype_bytes: int) -> int:
    """``_dummy_sampler_run`` at its peak, with what ``profile_run`` still holds: the forward's hidden states and the
    last token's of each request, and the random stand-in the sampler runs on (``torch.rand_like``)."""
    tokens, hidden, vocab = setup.max_num_batched_tokens, config.hidden_size, config.vocab_size
    rows = min(setup.max_num_seqs, tokens)
    held = (tokens + 2 * rows) * hidden * dtype_bytes
    softcapped = getattr(config, "final_logit_softcapping", None)  # a new tensor, of the vocabulary unpadded
    logits = rows * (vocab if softcapped else round_up(vocab, VOCAB_PADDING)) * dtype_bytes
    float32 = rows * vocab * FLOAT32  # Sampler.forward's copy of the logits
    if rows >= TRITON_TOP_K_TOP_P_ROWS:  # the kernel's buffer, then the probabilities and the exponential draws
        programs = min(setup.gpu.multiprocessors, rows)
        buffer = min(next_power_of_2(programs), setup.gpu.multiprocessors) * vocab * FLOAT32
        return held + logits + float32 + buffer + 2 * rows * vocab * FLOAT32
    # apply_top_k_top_p_pytorch at its top-p mask: the sorted values, their int64 indices, the top-k mask, the
    # sorted probabilities and the top-p mask (more than the probabilities and the draws after it)
    return held + logits + float32 + rows * vocab * (FLOAT32 + INT64 + BOOL + FLOAT32 + BOOL)


def moe_workspace_bytes(config, setup: VllmSetup, dtype_bytes: int, tokens: int) -> int:
    """The fused experts' workspace for ``tokens`` tokens, which ``WorkspaceManager`` allocates at the first MoE
    layer and keeps (modular_kernel.py ``_allocate_buffers``, ``TritonExperts.workspace_shapes``): ``workspace13``
    (the gate_up output's activation, then the output: ``tokens x top_k x max(intermediate, hidden)`` or ``tokens
    x hidden``) and ``workspace2`` (``tokens x top_k x max(2 x intermediate, hidden)``), each rounded up to 256
    bytes. gpt-oss's MXFP4 experts run the monolithic Triton kernel, which takes none."""
    if not routed_experts(config) or quant_method(config) == "mxfp4":
        return 0
    top_k = _experts_per_token(config)
    intermediate = _expert_intermediate(config) // setup.tensor_parallel_size
    hidden = config.hidden_size
    workspace13 = max(tokens * top_k * max(intermediate, hidden), tokens * hidden) * dtype_bytes
    workspace2 = tokens * top_k * max(2 * intermediate, hidden) * dtype_bytes
    return round_up(workspace13, WORKSPACE_ALIGNMENT) + round_up(workspace2, WORKSPACE_ALIGNMENT)


def _experts_per_token(config) -> int:
    return getattr(config, "num_experts_per_tok", None) or getattr(config, "experts_per_token", 1)


def _expert_intermediate(config) -> int:
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def _layer_peak(config, setup: VllmSetup, dtype_bytes: int, tokens: int) -> dict[str, int]:
    """A decoder layer's own live tensors at its peak, one forward of ``tokens`` tokens: attention, dense MLP, MoE
    (the router's; the fused experts' workspace is :func:`moe_workspace_bytes`)."""
    tp = setup.tensor_parallel_size
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = max(1, (getattr(config, "num_key_value_heads", None) or heads) // tp)
    stream = 2 * tokens * hidden  # the residual and the normed hidden states, alive across every layer
    if getattr(config, "kv_lora_rank", None):
        q_head = config.qk_nope_head_dim + config.qk_rope_head_dim
        attention = tokens * (heads // tp) * (q_head + config.v_head_dim + q_head)  # q, output, expanded k
    else:
        attention = tokens * ((heads // tp) * head * 2 + 2 * kv_heads * head)  # qkv, then the attention output
    parts = {"attention": (stream + attention) * dtype_bytes}
    experts = routed_experts(config)
    dense_layers = getattr(config, "first_k_dense_replace", 0) or len(getattr(config, "mlp_only_layers", ()) or ())
    if not experts or dense_layers:
        intermediate = config.intermediate_size // tp
        parts["mlp"] = (stream + tokens * 3 * intermediate) * dtype_bytes  # gate_up, then SiluAndMul's output
    if experts:
        routed = tokens * _experts_per_token(config)
        parts["moe"] = (
            stream * dtype_bytes
            + tokens * experts * FLOAT32  # the router's logits
            + routed * (FLOAT32 + INT32)  # top-k weights and ids
        )
    return parts


FA3_SPLITS = 32  # AttentionConfig.flash_attn_max_num_splits_for_cuda_graph, FA3's splits under FULL graphs


def capture_sizes(config, setup: VllmSetup) -> tuple[int, ...]:
    """``VllmConfig._set_cudagraph_sizes``' default ``cudagraph_capture_sizes``."""
    largest = 1024 if config.model_type == "gpt_oss" else 512  # GptOssForCausalLMConfig raises vLLM's 512
    largest = min(setup.max_num_seqs * 2, largest, setup.max_num_batched_tokens)
    sizes = [size for size in (1, 2, 4) if size <= largest]
    sizes += range(8, min(largest + 1, 256), 8)
    sizes += range(256, largest + 1, 16)
    return tuple(sorted(set(sizes)))


def cuda_graphs(config, setup: VllmSetup, dtype_bytes: int) -> CudaGraphs:
    """The graphs ``capture_model`` captures and their shared pool: the largest size's forward, as a PIECEWISE
    mixed batch and (unless the model has no FULL graphs) a FULL uniform-decode batch with FA3's accumulators."""
    sizes = capture_sizes(config, setup)
    tokens = sizes[-1]
    layer = max(_layer_peak(config, setup, dtype_bytes, tokens).values())
    pieces = config.num_hidden_layers + 1  # torch.compile splits the forward at each attention layer
    modes = {"PIECEWISE": pieces}
    parts = {"PIECEWISE": layer}
    if not getattr(config, "attention_chunk_size", None):  # ChunkedLocalAttention (Llama 4): PIECEWISE only
        modes["FULL"] = 1
        parts["FULL"] = layer + _fa3_accumulators(config, setup, tokens)
    return CudaGraphs(sizes, modes, max(parts.values()), parts)


def _fa3_accumulators(config, setup: VllmSetup, tokens: int) -> int:
    """FA3's ``out_accum`` and ``softmax_lse_accum`` (float32) of one attention call of a FULL decode graph, or 0
    where vLLM runs another kernel (before Hopper, Gemma 3's TRITON_ATTN) or none is allocated (gpt-oss's sinks)."""
    if setup.gpu.compute_capability[0] != 9 or config.model_type in ("gemma3", "gpt_oss"):
        return 0
    heads = max(1, config.num_attention_heads // setup.tensor_parallel_size)
    if getattr(config, "kv_lora_rank", None):
        head_v = config.kv_lora_rank  # FLASH_ATTN_MLA attends over the latent
    else:
        head_v = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return FA3_SPLITS * heads * tokens * (head_v + 1) * 4


def startup_json(startup: VllmStartup) -> dict:
    return {
        "engine": "vllm",
        "tensor_parallel_size": startup.setup.tensor_parallel_size,
        "total_gpu_memory_bytes": startup.setup.gpu_memory_bytes,
        "gpu_memory_utilization": startup.setup.gpu_memory_utilization,
        "requested_bytes": startup.requested_bytes,
        "weights_bytes": startup.weights.total,
        "weight_kernels": startup.weights.kernels,
        "weights_allocator_rounding_bytes": startup.weights.rounding_bytes,
        "weights_workspace_bytes": startup.weights.workspace_bytes,
        "activation_peak_bytes": startup.activation_peak_bytes,
        "activation_peak_by_part": startup.activation_parts,
        "non_torch_bytes": startup.setup.non_torch_bytes,
        "kv_cache_bytes": startup.kv_cache_bytes,
        "kv_page_bytes": startup.layout.page_bytes,
        "kv_layer_kinds": startup.layout.kinds,
        "num_gpu_blocks": startup.num_blocks,
        "kv_cache_tokens": startup.kv_cache_tokens,
        "max_model_len": startup.max_model_len,
        "max_concurrency": startup.max_concurrency,
        "cuda_graph_capture_sizes": list(startup.graphs.sizes),
        "cuda_graph_modes": startup.graphs.modes,
        "cuda_graphs": startup.graphs.count,
        "cuda_graph_pool_bytes": startup.graphs.pool_bytes,
        "cuda_graph_pool_by_mode": startup.graphs.pool_parts,
        "cuda_graph_bytes_predicted": "at least",  # the pool; the driver's memory per graph is not predicted
        "process_bytes_at_least": startup.process_bytes,
        "vision_tower_not_counted": startup.vision_missing or None,
    }


def render_startup(model, startup: VllmStartup) -> str:
    """The report, in the order and the words of vLLM's own start-up log."""
    from tracer.units import GIB

    setup = startup.setup

    def gib(nbytes: int) -> str:
        return f"{nbytes / GIB:.2f}GiB"

    kinds = ", ".join(f"{count} {kind}" for kind, count in startup.layout.kinds.items())
    kernels = "".join(f", {count} layers on {kernel}" for kernel, count in startup.weights.kernels.items())
    if startup.weights.vision_bytes:
        kernels += f", vision tower and projector {gib(startup.weights.vision_bytes)}"
    if startup.weights.rounding_bytes:
        kernels += f", the caching allocator's whole blocks {gib(startup.weights.rounding_bytes)} more"
    if startup.weights.workspace_bytes:
        kernels += f", FlashInfer-MLA's workspace {gib(startup.weights.workspace_bytes)}"
    window = f", window {startup.layout.sliding_window}" if startup.layout.sliding_window else ""
    lines = [
        f"{model.model_id} served by vLLM (V1 engine), tensor parallel {setup.tensor_parallel_size}; per GPU:",
        f"  the current vLLM instance can use total_gpu_memory ({gib(setup.gpu_memory_bytes)}) x "
        f"gpu_memory_utilization ({setup.gpu_memory_utilization:.2f}) = {gib(startup.requested_bytes)}",
        f"  model weights take {gib(startup.weights.total)} (rotary cos/sin cache {gib(startup.weights.rotary_bytes)}"
        f"{kernels})",
    ]
    if startup.vision_missing:
        lines.append(
            f"  the vision tower and projector are not counted ({startup.vision_missing}): vLLM loads them too, so "
            "its KV cache is smaller than this by their weights"
        )
    lines += [
        f"  non_torch_memory takes {gib(setup.non_torch_bytes)} (not predicted: --non-torch-memory)",
        f"  PyTorch activation peak memory takes {gib(startup.activation_peak_bytes)} (profile run: "
        f"{setup.max_num_batched_tokens} tokens, sampler on {min(setup.max_num_seqs, setup.max_num_batched_tokens)} "
        "rows; " + ", ".join(f"{part} {gib(b)}" for part, b in startup.activation_parts.items()) + ")",
        f"  the rest of the memory reserved for KV Cache is {gib(startup.kv_cache_bytes)}",
        f"  KV blocks of {setup.block_size} tokens, {startup.layout.page_bytes:,} bytes per layer ({kinds}{window}): "
        f"{startup.num_blocks:,}",
        f"  GPU KV cache size: {startup.kv_cache_tokens:,} tokens",
        f"  Maximum concurrency for {startup.max_model_len:,} tokens per request: {startup.max_concurrency:.2f}x",
    ]
    graphs = startup.graphs
    modes = " and ".join(f"{mode} ({per} graph{'s' if per > 1 else ''} each)" for mode, per in graphs.modes.items())
    pool = ", ".join(f"{mode} {gib(b)}" for mode, b in graphs.pool_parts.items())
    lines += [
        f"  Graph capturing (after the KV cache is allocated) takes at least {gib(graphs.pool_bytes)}: the shared pool "
        f"of the largest capture, {graphs.sizes[-1]} tokens ({pool}); {len(graphs.sizes)} sizes x {modes} = "
        f"{graphs.count:,} graphs, whose CUDA driver memory is not predicted",
        f"  vLLM 0.19 does not take the graphs out of the KV cache (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0): the "
        f"process holds at least {gib(startup.process_bytes)}, "
        f"{startup.process_bytes / setup.gpu_memory_bytes:.1%} of total_gpu_memory, above gpu_memory_utilization by "
        "the graphs",
    ]
    if startup.kv_cache_bytes <= 0:
        lines.append(
            "  No memory is left for the KV cache: vLLM stops with 'No available memory for the cache blocks'. "
            "Raise --gpu-memory-utilization, add GPUs (--tensor-parallel-size), or lower --max-num-batched-tokens."
        )
    elif startup.max_concurrency < 1:
        lines.append(
            f"  One request of --max-model-len {startup.max_model_len} does not fit: vLLM refuses to start "
            "(check_enough_kv_cache_memory). Lower --max-model-len or add memory."
        )
    elif startup.process_bytes > setup.gpu_memory_bytes:
        lines.append(
            "  The graphs' pool does not fit in what gpu_memory_utilization leaves: capture runs out of memory. "
            "Lower --gpu-memory-utilization or --max-num-seqs."
        )
    return "\n".join(lines)
