"""The kernels CUDA picks where CPU picks others, so that the trace saves what a GPU run saves.

* ``scaled_dot_product_attention``: CUDA chooses flash, then memory-efficient, then math attention by the
  rules of ``sdp::select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) and calls it as
  ``scaled_dot_product_attention`` does (aten/src/ATen/native/transformers/attention.cpp): flash and
  efficient save a float32 logsumexp, not the attention matrix; math materialises it.
* ``dropout``: on CUDA it is ``native_dropout``, which saves a bool mask (1 byte per element); on CPU it
  multiplies by a noise tensor of the input's dtype (``is_fused_kernel_acceptable`` in Dropout.cpp).

Both ops are composite (they decompose above autograd), so they are replaced at the ``AutogradCPU`` key.
"""

from __future__ import annotations

import math
import warnings
from enum import Enum

import torch
import torch.nn.functional as F

from tracer.gpus import Gpu


class SdpaBackend(str, Enum):
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


# Alignment of the attention bias for memory-efficient attention (``mem_eff_alignment`` in attention.cpp).
MEM_EFF_BIAS_ALIGNMENT = 16
FLASH_MAX_HEAD_DIM = 256


def select_sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    gpu: Gpu,
) -> SdpaBackend:
    """The first of flash, efficient, math whose constraints hold, as ``select_sdp_backend`` checks them."""
    if _can_use_flash(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, gpu):
        return SdpaBackend.FLASH
    if _can_use_efficient(query, key, value, gpu):
        return SdpaBackend.EFFICIENT
    return SdpaBackend.MATH


def _heads_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grouped: bool) -> bool:
    """``check_batch_size_and_num_heads_dense``: equal heads, or grouped heads when ``grouped``."""
    q_heads, k_heads, v_heads = query.size(1), key.size(1), value.size(1)
    if query.size(0) != key.size(0) or query.size(0) != value.size(0):
        return False
    if q_heads == k_heads == v_heads:
        return True
    return grouped and k_heads == v_heads and q_heads % k_heads == 0


def _can_use_flash(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, gpu: Gpu) -> bool:
    cc = gpu.compute_capability
    if not (query.dim() == key.dim() == value.dim() == 4) or attn_mask is not None:
        return False
    head_dim = query.size(-1)
    if not (head_dim == key.size(-1) == value.size(-1) and head_dim <= FLASH_MAX_HEAD_DIM):
        return False
    if not ((8, 0) <= cc <= (12, 1)):
        return False
    requires_grad = query.requires_grad or key.requires_grad or value.requires_grad
    consumer_arch = (8, 6) <= cc <= (8, 9) or (12, 0) <= cc <= (12, 1)
    if requires_grad and consumer_arch and not (head_dim <= 192 or (dropout_p == 0.0 and head_dim > 224)):
        return False
    if is_causal and query.size(-2) != key.size(-2):
        return False
    if query.dtype not in (torch.float16, torch.bfloat16):
        return False
    if query.size(-2) == 0 or key.size(-2) == 0:
        return False
    return _heads_ok(query, key, value, grouped=enable_gqa)


def _can_use_efficient(query, key, value, gpu: Gpu) -> bool:
    cc = gpu.compute_capability
    if not ((5, 0) <= cc <= (12, 1)) or not (query.dim() == key.dim() == value.dim() == 4):
        return False
    half = query.dtype in (torch.float16, torch.bfloat16)
    # minimum_gemm_alignment: 4 from sm80 on, 128 bits over the element size where tensor cores are used.
    alignment = 4 if cc >= (8, 0) else 1
    if cc >= (8, 0) or (cc >= (7, 0) and half):
        alignment = max(alignment, 128 // (16 if half else 32))
    q_dim, v_dim = query.size(-1), value.size(-1)
    if q_dim != key.size(-1) or q_dim % alignment or v_dim % alignment:
        return False
    if query.size(-2) == 0 or key.size(-2) == 0:
        return False
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return False
    # Memory-efficient attention has no grouped-query path in torch 2.11-2.13 (its backward returns
    # gradients for every query head); grouped K/V send SDPA to the math kernel (pytorch#191085 adds one).
    if not _heads_ok(query, key, value, grouped=False):
        return False
    allowed = (torch.float16, torch.float32, torch.bfloat16) if cc >= (8, 0) else (torch.float16, torch.float32)
    return query.dtype in allowed


def _pad_last_dim(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    remainder = tensor.size(-1) % multiple
    return tensor if remainder == 0 else F.pad(tensor, (0, multiple - remainder))


def _convert_boolean_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``convert_boolean_attn_mask``: a bool mask becomes an additive mask of the query's dtype."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=attn_mask.device)
    return torch.where(attn_mask.logical_not(), -math.inf, zero)


def _preprocess_efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: pad the bias so its rows are aligned, then expand to (B, H, L, S)."""
    aligned = mask.stride(-1) == 1 and all(s % MEM_EFF_BIAS_ALIGNMENT == 0 for s in mask.stride()[:-1])
    if not aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, MEM_EFF_BIAS_ALIGNMENT - last % MEM_EFF_BIAS_ALIGNMENT))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


class CudaKernels:
    """Replaces SDPA and dropout with CUDA's kernel choices while active; records the SDPA backends used."""

    def __init__(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.sdpa_backends: set[SdpaBackend] = set()
        self._library: torch.library.Library | None = None

    def __enter__(self) -> CudaKernels:
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            library.impl("scaled_dot_product_attention", self._sdpa, "AutogradCPU")
            library.impl("dropout", _cuda_dropout, "AutogradCPU")
        self._library = library
        return self

    def __exit__(self, *exc: object) -> None:
        if self._library is not None:
            self._library._destroy()
            self._library = None

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        backend = select_sdpa_backend(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, self.gpu)
        self.sdpa_backends.add(backend)
        attn_mask = _convert_boolean_mask(attn_mask, query.dtype)
        if backend is SdpaBackend.FLASH:
            head_dim = query.size(-1)
            scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                _pad_last_dim(query, 8),
                _pad_last_dim(key, 8),
                _pad_last_dim(value, 8),
                dropout_p,
                is_causal,
                False,
                scale=scale,
            )[0]
            return out if out.size(-1) == head_dim else out[..., :head_dim]
        if backend is SdpaBackend.EFFICIENT:
            if attn_mask is not None:
                attn_mask = _preprocess_efficient_mask(attn_mask, query, key)
            compute_logsumexp = torch.is_grad_enabled() and (
                query.requires_grad or key.requires_grad or value.requires_grad
            )
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, compute_logsumexp, dropout_p, is_causal, scale=scale
            )[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]


def _cuda_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``at::dropout`` as CUDA runs it: ``native_dropout`` when training with 0 < p < 1."""
    if train and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    if not train or p == 0.0 or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)
