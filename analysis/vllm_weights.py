"""The weights one vLLM tensor-parallel rank loads, from the model's parameters as transformers names them.

vLLM builds its own layers; each splits its weight over the ``--tensor-parallel-size`` ranks by a rule of
vllm/model_executor/layers/:

* ``ColumnParallelLinear`` and ``MergedColumnParallelLinear`` (linear.py): the output features divided by
  the degree (weight and bias); q, gate, up and the MLA up-projections.
* ``QKVParallelLinear`` (linear.py): the query heads divided; the key/value heads divided too, or, when the
  degree reaches their number, one head per rank (``num_kv_heads = 1``, ``num_kv_head_replicas = tp //
  total_num_kv_heads``).
* ``RowParallelLinear`` (linear.py): the input features divided; the bias is whole on every rank.
* ``VocabParallelEmbedding`` / ``ParallelLMHead`` (vocab_parallel_embedding.py): the vocabulary padded to a
  multiple of ``DEFAULT_VOCAB_PADDING_SIZE`` (64), then divided; a tied lm_head is the embedding itself.
* ``FusedMoE`` (fused_moe/layer.py) without expert parallelism: every expert on every rank, its
  ``intermediate_size_per_partition = intermediate_size // tp``; the router is a ``ReplicatedLinear``.
* ``ReplicatedLinear`` and everything else (norms, MLA's down-projections ``q_a_proj`` and
  ``kv_a_proj_with_mqa``, routers): whole on every rank.
* gpt-oss' attention sinks are divided with the heads (``GptOssAttention``: ``num_attention_heads // tp``).

With ``--quantization fp8`` (quantization/fp8.py, ``Fp8OnlineLinearMethod`` and ``Fp8OnlineMoEMethod``: a 16-bit
checkpoint quantized as it loads, layer by layer) the column-, row- and QKV-parallel layers and the experts hold
one byte per weight and one float32 scale per layer; embeddings, the lm_head, norms and the layers built without a
quantization config (routers) keep the model's dtype.

gpt-oss's MXFP4 experts (quantization/mxfp4.py, ``Mxfp4MoEMethod`` with the Triton backend vLLM picks on Hopper,
fused_moe/oracle/mxfp4.py) hold per rank an intermediate size rounded up to 64, two FP4 values per byte and a
uint8 scale per 32 as loaded, then ``_swizzle_mxfp4`` lays the values out again padded to 64 and the scales padded
to 256 rows, dropping the loaded values but keeping the loaded scales; the biases become float32.

``get_rope`` (rotary_embedding.py) adds one ``cos_sin_cache`` buffer per distinct rotary setup,
``max_position_embeddings x rotary_dim`` in the model's dtype, shared by every layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from tracer.errors import UserError
from tracer.published import MXFP4_VALUES_PER_SCALE
from tracer.units import round_up

VOCAB_PADDING = 64  # vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE
FP8_SCALE_BYTES = 4  # one float32 scale per layer (per tensor), as scaled_fp8_quant computes it
MXFP4_TRITON_ALIGNMENT = 64  # oracle/mxfp4.py: the intermediate size per rank rounded up for the Triton backend

_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head|wte|word_embeddings|embed_in|embed_out)\.weight$")
_KEY_VALUE = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
_COLUMN = re.compile(
    r"\.(q_proj|gate_proj|up_proj|gate_up_proj|c_fc|fc1|w1|w3|q_b_proj|kv_b_proj|query_key_value|dense_h_to_4h"
    r"|qkv_proj)\.(weight|bias)$"
)
_ROW = re.compile(r"\.(o_proj|down_proj|c_proj|fc2|w2|dense|dense_4h_to_h|out_proj)\.weight$")
_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_SINKS = re.compile(r"\.sinks$")
_REPLICATED = re.compile(r"\.(gate|router|q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)$")


@dataclass(frozen=True)
class RankWeights:
    parameter_bytes: int  # the rank's share of every parameter
    rotary_bytes: int  # the cos/sin cache get_rope keeps

    @property
    def total(self) -> int:
        return self.parameter_bytes + self.rotary_bytes


def rank_weights(model: nn.Module, config, tp: int, quantization: str | None = None) -> RankWeights:
    """What one of ``tp`` ranks holds of ``model`` (built on the meta device) once vLLM has loaded it: its linear
    layers and experts in FP8 with ``--quantization fp8``, gpt-oss's experts in MXFP4 for an ``mxfp4`` checkpoint."""
    heads = config.num_attention_heads
    if heads % tp:
        raise UserError(
            f"--tensor-parallel-size {tp} does not divide the {heads} attention heads; vLLM refuses it "
            "(ModelConfig.verify_with_parallel_config). Pick a degree that divides them."
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = {getattr(config, name, None) for name in ("intermediate_size", "moe_intermediate_size")} - {None}
    total = 0
    for name, parameter in model.named_parameters():
        if quantization == "mxfp4" and _EXPERTS.search(name):
            continue  # counted per layer below
        numel = _rank_numel(name, tuple(parameter.shape), tp, kv_heads, intermediate)
        quantized = quantization == "fp8" and _quantized_linear(name)
        total += numel + FP8_SCALE_BYTES if quantized else numel * parameter.element_size()
    if quantization == "mxfp4":
        total += config.num_hidden_layers * _mxfp4_experts_bytes(config, tp)
    return RankWeights(total, _rotary_bytes(config, _dtype(model)))


def _mxfp4_experts_bytes(config, tp: int) -> int:
    """One layer's MXFP4 experts on one rank, with the Triton backend's padding and the scales kept twice."""
    experts, hidden = config.num_local_experts, config.hidden_size
    inner = round_up(config.intermediate_size // tp, MXFP4_TRITON_ALIGNMENT)  # per rank
    values = round_up(hidden // 2, 64) * 2 * inner + round_up(inner // 2, 64) * hidden  # swizzled, padded
    group = MXFP4_VALUES_PER_SCALE
    loaded_scales = 2 * inner * hidden // group + hidden * inner // group
    swizzled_scales = round_up(2 * inner, 256) * hidden // group + round_up(hidden, 256) * inner // group
    biases = (2 * inner + hidden) * 4  # float32
    return experts * (values + loaded_scales + swizzled_scales + biases)


def _quantized_linear(name: str) -> bool:
    """A weight (not a bias) ``--quantization fp8`` quantizes: of a parallel linear layer, or the experts'."""
    if not name.endswith(("weight", "proj")):  # the experts' weights are ``...experts.gate_up_proj``
        return False
    return bool(_KEY_VALUE.search(name) or _COLUMN.search(name) or _ROW.search(name) or _EXPERTS.search(name))


def _rank_numel(name: str, shape: tuple[int, ...], tp: int, kv_heads: int, intermediate: set[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    if tp == 1:
        return numel
    if _VOCAB.search(name):
        padded = round_up(shape[0], VOCAB_PADDING)
        return padded // tp * shape[1]
    if _KEY_VALUE.search(name):
        return numel // kv_heads * max(1, kv_heads // tp)
    if _COLUMN.search(name) or _SINKS.search(name):
        return numel // tp
    if _ROW.search(name):
        return numel // tp
    if _EXPERTS.search(name):
        return _expert_share(name, shape, tp, intermediate)
    if len(shape) > 1 and not _REPLICATED.search(name):
        raise UserError(
            f"--tensor-parallel-size {tp}: which of vLLM's parallel layers holds {name} {list(shape)} is not "
            "modelled, so its share per rank is unknown; use --tensor-parallel-size 1."
        )
    return numel


def _expert_share(name: str, shape: tuple[int, ...], tp: int, intermediate: set[int]) -> int:
    """transformers keeps each MoE layer's experts as 3-D tensors (experts x out x in, or x in x out); vLLM splits
    the intermediate dimension, which is the intermediate size or, fused with the gate, twice it."""
    numel = 1
    for size in shape:
        numel *= size
    for size in shape[1:]:
        if size in intermediate or size // 2 in intermediate:
            return numel // tp
    raise UserError(f"cannot tell which dimension of {name} {list(shape)} vLLM splits over the tensor-parallel ranks.")


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _rotary_bytes(config, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "qk_rope_head_dim", None) or getattr(config, "head_dim", None)
    head_dim = head_dim or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    positions = getattr(config, "max_position_embeddings", 0) or 0
    return positions * rotary_dim * dtype.itemsize
