"""The kernels CUDA picks where CPU picks others, so that the trace saves what a GPU run saves.

* ``scaled_dot_product_attention``: CUDA tries the backends in ``priority_order`` and takes the first whose
  ``can_use_*`` checks pass (``sdp::select_sdp_backend`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp),
  then calls it as ``scaled_dot_product_attention`` does (aten/src/ATen/native/transformers/attention.cpp):
  cuDNN, flash and efficient save a float32 logsumexp, not the attention matrix; math materialises it. The
  order is flash, efficient, math, unless ``check_prefer_cudnn_attention`` puts cuDNN first: on sm90/sm100
  (minor 0 or 3) with a runtime cuDNN newer than 9.15.0, and ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` unset. The
  rule is in torch 2.10 already; from 2.11 the CUDA 13 wheels bundle such a cuDNN (a trace recorded on an H200
  with 2.11.0+cu130 ran cuDNN attention), so cuDNN comes first from 2.11 on. From 2.12, cuDNN also refuses a
  dropout that is not a multiple of 1/16 (``check_cudnn_dropout``, pytorch#174245): GPT-2's 0.1 goes to flash.
* ``dropout``: on CUDA it is ``native_dropout``, which saves a bool mask (1 byte per element); on CPU it
  multiplies by a noise tensor of the input's dtype (``is_fused_kernel_acceptable`` in Dropout.cpp).

Both ops are composite (they decompose above autograd), so they are replaced at the ``AutogradCPU`` key.
"""

from __future__ import annotations

import math
import os
from enum import Enum

import torch
import torch.nn.functional as F

from tracer.cuda.registration import register_kernels
from tracer.gpus import Gpu
from tracer.versions import installed_torch_version


class SdpaBackend(str, Enum):
    CUDNN = "cudnn"
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


# Alignment of the attention bias for memory-efficient attention (``mem_eff_alignment`` in attention.cpp).
MEM_EFF_BIAS_ALIGNMENT = 16
FLASH_MAX_HEAD_DIM = 256
# check_cudnn_tensor_shapes: head dims up to 128 (d_qk 192 with d_v 128 on sm90/sm10x from cuDNN 9.11; 256 there
# only from cuDNN 9.23 with cudnn-frontend 1.24, newer than the wheels of torch 2.11-2.13 bundle).
CUDNN_MAX_HEAD_DIM = 128
CUDNN_MAX_BATCH_OR_HEADS = 65535
# The first torch whose CUDA 13 wheels bundle a cuDNN above 9.15.0, which check_prefer_cudnn_attention asks for.
CUDNN_FIRST_TORCH = (2, 11)
# The first torch with check_cudnn_dropout (pytorch#174245, merged 2026-02-26, after the 2.11 branch cut).
CUDNN_DROPOUT_CHECK_TORCH = (2, 12)
TRUE_ENV = {"1", "ON", "YES", "TRUE", "Y"}  # c10::utils::check_env


def cudnn_preferred(gpu: Gpu, torch_version: tuple[int, int]) -> bool:
    """``check_prefer_cudnn_attention``: cuDNN first on sm90 and sm100/sm103 with a bundled cuDNN above 9.15.0."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").upper() in TRUE_ENV:
        return False
    major, minor = gpu.compute_capability
    # CUDA 12 builds take minor 0 or 3 only, CUDA 13 builds any minor of 9 and 10: the same GPUs in our table.
    return torch_version >= CUDNN_FIRST_TORCH and major in (9, 10) and minor in (0, 3)


def select_sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    gpu: Gpu,
    torch_version: tuple[int, int] | None = None,
) -> SdpaBackend:
    """The first backend in ``priority_order`` whose constraints hold, as ``select_sdp_backend`` checks them,
    for ``torch_version`` (the installed torch unless given)."""
    torch_version = torch_version or installed_torch_version()
    if cudnn_preferred(gpu, torch_version) and _can_use_cudnn(
        query, key, value, attn_mask, dropout_p, enable_gqa, gpu, torch_version
    ):
        return SdpaBackend.CUDNN
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


def _mask_shape_ok(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> bool:
    """``check_attn_mask_shape`` (sdp_utils_cpp.h): 2-D, or 4-D broadcastable over batch and heads."""
    if mask is None:
        return True
    if mask.requires_grad or mask.size(-2) not in (query.size(2), 1) or mask.size(-1) not in (key.size(2), 1):
        return False
    if mask.dim() == 2:
        return True
    return mask.dim() == 4 and mask.size(0) in (1, query.size(0)) and mask.size(1) in (1, query.size(1))


def _can_use_cudnn(query, key, value, attn_mask, dropout_p, enable_gqa, gpu: Gpu, torch_version) -> bool:
    """``can_use_cudnn_attention`` for dense inputs, with the runtime cuDNN of the torch 2.11-2.13 wheels."""
    cc = gpu.compute_capability
    if not (query.dim() == key.dim() == value.dim() == 4):  # check_tensor_shapes
        return False
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        return False  # check_cudnn_deterministic
    if query.dtype not in (torch.float16, torch.bfloat16) or not _mask_shape_ok(attn_mask, query, key):
        return False
    if not ((8, 0) <= cc <= (12, 1)):  # check_cudnn_hardware_support
        return False
    if torch_version >= CUDNN_DROPOUT_CHECK_TORCH and dropout_p * 16.0 != math.floor(dropout_p * 16.0):
        return False  # check_cudnn_dropout
    if query.size(2) == 0 or key.size(2) == 0:  # check_nonzero_sequence_lengths_dense
        return False
    if any(t.size(-1) != 1 and t.stride(-1) != 1 for t in (query, key, value)):  # last-dim stride, singleton ignored
        return False
    # check_batch_size_and_num_heads_dense<supports_gqa, !requires_same_num_heads>
    q_heads, k_heads, v_heads = query.size(1), key.size(1), value.size(1)
    if not query.size(0) == key.size(0) == value.size(0):
        return False
    if not (q_heads == k_heads == v_heads or (enable_gqa and q_heads % k_heads == 0 and q_heads % v_heads == 0)):
        return False
    # check_cudnn_tensor_shapes
    if max(query.size(0), q_heads) > CUDNN_MAX_BATCH_OR_HEADS:
        return False
    d_qk, d_v = query.size(-1), value.size(-1)
    hopper_or_blackwell = (cc[0] == 9 and cc[1] == 0) or cc[0] == 10
    limit_ok = (d_qk <= CUDNN_MAX_HEAD_DIM and d_v <= CUDNN_MAX_HEAD_DIM) or (
        hopper_or_blackwell and d_qk == 192 and d_v == 128
    )
    if not limit_ok or d_qk % 8 or d_v % 8:
        return False
    return key.size(2) != 1 and not (dropout_p != 0.0 and query.size(2) == 1)


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
    """``convert_boolean_attn_mask``: a bool mask becomes an additive mask of the query's dtype, as
    ``at::where(*attn_mask, 0.0, at::scalar_tensor(neg_inf, ...))`` makes it (no inverted copy of the mask)."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.where(attn_mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=attn_mask.device))


def _preprocess_efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: pad the bias so its rows are aligned, then expand to (B, H, L, S)."""
    aligned = mask.stride(-1) == 1 and all(s % MEM_EFF_BIAS_ALIGNMENT == 0 for s in mask.stride()[:-1])
    if not aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, MEM_EFF_BIAS_ALIGNMENT - last % MEM_EFF_BIAS_ALIGNMENT))[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


class CudaKernels:
    """Replaces SDPA and dropout with CUDA's kernel choices while active; records the SDPA backends used."""

    def __init__(self, gpu: Gpu, torch_version: tuple[int, int] | None = None) -> None:
        self.gpu = gpu
        self.torch_version = torch_version or installed_torch_version()
        self.sdpa_backends: set[SdpaBackend] = set()
        self._library: torch.library.Library | None = None

    def __enter__(self) -> CudaKernels:
        self._library = register_kernels(
            [("scaled_dot_product_attention", self._sdpa, "AutogradCPU"), ("dropout", _cuda_dropout, "AutogradCPU")]
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._library is not None:
            self._library._destroy()
            self._library = None

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        backend = select_sdpa_backend(
            query, key, value, attn_mask, dropout_p, is_causal, enable_gqa, self.gpu, self.torch_version
        )
        self.sdpa_backends.add(backend)
        attn_mask = _convert_boolean_mask(attn_mask, query.dtype)
        compute_logsumexp = torch.is_grad_enabled() and (
            query.requires_grad or key.requires_grad or value.requires_grad
        )
        if backend is SdpaBackend.CUDNN:
            # Returns output, logsumexp (B, H, L, 1) fp32, two undefined cum_seq, max_q, max_k, philox seed and
            # offset (int64 scalars) and an undefined debug mask (``_cudnn_attention_forward`` in
            # aten/src/ATen/native/transformers/cuda/attention.cu); autograd saves output, logsumexp, seed, offset.
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, attn_mask, compute_logsumexp, dropout_p, is_causal, False, scale=scale
            )[0]
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
