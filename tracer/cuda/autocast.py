"""CUDA autocast's cast policies, applied to the CPU tensors the trace runs on.

The trace runs on CPU, whose autocast casts a different set of ops than CUDA's (CPU leaves softmax, pow,
layer_norm and sum in the input dtype; CUDA runs them in fp32 and keeps fp32 outputs). This module
replaces the ``AutocastCPU`` kernels, for as long as it is active, with Python kernels that apply CUDA's
policy to each op, following ``aten/src/ATen/autocast_mode.{h,cpp}``:

* lower_precision_fp: cast floating inputs to the autocast dtype (``AT_FORALL_LOWER_PRECISION_FP``);
* fp32: cast floating inputs to fp32 (``AT_FORALL_FP32``);
* fp32_set_opt_dtype: run with ``dtype=float32`` unless a dtype is given (``AT_FORALL_FP32_SET_OPT_DTYPE``);
* fp32_append_dtype: redispatch ``norm`` to its dtype overload with fp32 (``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``);
* promote: cast to the widest floating dtype among inputs (``AT_FORALL_PROMOTE``).

Casts of fp32 leaf tensors that require grad (parameters) to the autocast dtype are cached until the
outermost autocast region exits, as ``cached_cast`` does, so each weight is copied once per forward.
Ops that only CPU autocast handles fall through untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from tracer.cuda.registration import register_kernels

AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU


class CastPolicy(Enum):
    LOWER_PRECISION_FP = "lower_precision_fp"
    FP32 = "fp32"
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
    FP32_APPEND_DTYPE = "fp32_append_dtype"
    PROMOTE = "promote"
    BANNED = "banned"
    # Registered in builds with cuDNN only, for an op that CPU tensors never reach (CPU runs RNNs by other ops):
    # ``_cudnn_rnn``'s own wrapper (aten/src/ATen/cudnn/AutocastRNN.cpp) casts to fp16 and reflattens the weights.
    CUDNN_ONLY = "cudnn_only"


_LOWER_PRECISION_FP = """
    _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
    convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
    chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
    rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
    cudnn_convolution cudnn_convolution_transpose
"""
_FP32 = """
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
    layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss
    smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
    logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d
    upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
    _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
"""
_FP32_SET_OPT_DTYPE = "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum"
_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"

CUDA_POLICY: dict[str, CastPolicy] = {
    **dict.fromkeys(_LOWER_PRECISION_FP.split(), CastPolicy.LOWER_PRECISION_FP),
    **dict.fromkeys(_FP32.split(), CastPolicy.FP32),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE.split(), CastPolicy.FP32_SET_OPT_DTYPE),
    "norm": CastPolicy.FP32_APPEND_DTYPE,
    **dict.fromkeys(_PROMOTE.split(), CastPolicy.PROMOTE),
    "binary_cross_entropy": CastPolicy.BANNED,
    "_cudnn_rnn": CastPolicy.CUDNN_ONLY,
}

# In CUDA autocast's fp32 list after torch 2.11 only: 2.11 registers no autocast kernel for ``rms_norm``, which
# decomposes there into ops (pow, rsqrt) that the table casts. The kernels follow the ops this torch registers.
LATER_THAN_2_11 = frozenset({"rms_norm"})

# fp32_append_dtype: the overload each dtype-less ``norm`` overload redispatches to.
_NORM_WITH_DTYPE = {
    "Scalar": "ScalarOpt_dtype",
    "ScalarOpt_dim": "ScalarOpt_dim_dtype",
    "names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype",
}


def registered_ops(dispatch_key: str) -> list[str]:
    """Operator overloads ("aten::name.overload") with a kernel for ``dispatch_key`` in this torch build."""
    return sorted(
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, dispatch_key)
    )


def _base_name(qualified: str) -> str:
    return qualified.removeprefix("aten::").partition(".")[0]


def _overload(qualified: str) -> torch._ops.OpOverload:
    name, _, overload = qualified.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


class CudaAutocast:
    """Swaps CUDA's cast policies in for CPU autocast while active. See the module docstring."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._library: torch.library.Library | None = None
        self._clear_torch_cache = torch.clear_autocast_cache

    def __enter__(self) -> CudaAutocast:
        cuda_ops = registered_ops("AutocastCUDA")
        unknown = [op for op in cuda_ops if _base_name(op) not in CUDA_POLICY]
        if unknown:
            raise RuntimeError(f"CUDA autocast policy unknown for {unknown}; update tracer/cuda/autocast.py")
        emulated = [op for op in cuda_ops if CUDA_POLICY[_base_name(op)] is not CastPolicy.CUDNN_ONLY]
        self._library = register_kernels(
            [
                *(
                    (_overload(op), self._kernel(_overload(op), CUDA_POLICY[_base_name(op)]), "AutocastCPU")
                    for op in emulated
                ),
                *(
                    (_overload(op), torch.library.fallthrough_kernel, "AutocastCPU")
                    for op in set(registered_ops("AutocastCPU")) - set(cuda_ops)
                ),
            ]
        )
        self._clear_torch_cache = torch.clear_autocast_cache
        torch.clear_autocast_cache = self._clear_cache
        return self

    def _clear_cache(self) -> None:
        """``torch.autocast.__exit__`` clears the cast cache when it leaves the outermost region: the user's, and
        also each region activation checkpointing opens to recompute a layer in backward, which drops the
        recomputed layer's weight copies once its backward no longer holds them."""
        self._clear_torch_cache()
        self._cache.clear()

    def __exit__(self, *exc: object) -> None:
        torch.clear_autocast_cache = self._clear_torch_cache
        if self._library is not None:
            self._library._destroy()
            self._library = None
        self._cache.clear()

    @contextmanager
    def region(self, dtype: torch.dtype) -> Iterator[None]:
        """The user's ``torch.autocast("cuda", dtype)`` region, on CPU tensors with CUDA's policies."""
        with torch.autocast("cpu", dtype=dtype):
            yield
        self._cache.clear()  # clear_cache() runs when the outermost autocast region exits

    def _kernel(self, op: torch._ops.OpOverload, policy: CastPolicy):
        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(AUTOCAST_CPU)):
                lower = torch.get_autocast_dtype("cpu")
                if policy is CastPolicy.LOWER_PRECISION_FP:
                    args, kwargs = self._cast_all((args, kwargs), lower)
                elif policy is CastPolicy.FP32:
                    args, kwargs = self._cast_all((args, kwargs), torch.float32)
                elif policy is CastPolicy.FP32_SET_OPT_DTYPE:
                    if _eligible(args[0]):
                        args, kwargs = _set_dtype_if_unset(op, args, kwargs, torch.float32)
                elif policy is CastPolicy.FP32_APPEND_DTYPE:
                    out_type = torch.float32 if _eligible(args[0]) else args[0].dtype
                    with_dtype = getattr(torch.ops.aten.norm, _NORM_WITH_DTYPE[op._overloadname])
                    return with_dtype(*args, **kwargs, dtype=out_type)
                elif policy is CastPolicy.PROMOTE:
                    args, kwargs = self._cast_all((args, kwargs), _promote_type((args, kwargs), lower))
                else:
                    raise RuntimeError(f"{op} is unsafe to autocast (CUDA autocast bans it).")
                return op(*args, **kwargs)

        return kernel

    def _cast_all(self, tree, to_type: torch.dtype):
        """Each argument cast, the last first: CUDA's wrapper casts them in the arguments of one call
        (``cached_cast(...)...`` in ``WrapFunction_``, aten/src/ATen/autocast_mode.h), which GCC evaluates right to
        left; the H200 recordings (tests/fixtures/cuda) allocate a linear's bias copy, then its weight's, then its
        input's, and the caching allocator places them in that order."""
        leaves, spec = tree_flatten(tree)
        cast = [self._cached_cast(leaf, to_type) for leaf in reversed(leaves)]
        return tree_unflatten(cast[::-1], spec)

    def _cached_cast(self, leaf: object, to_type: torch.dtype) -> object:
        if not _eligible(leaf) or leaf.dtype == to_type:
            return leaf
        cacheable = (
            to_type == torch.get_autocast_dtype("cpu")
            and leaf.dtype == torch.float32
            and leaf.requires_grad
            and leaf.is_leaf
            and not leaf._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return leaf.to(to_type)
        cached = self._cache.get(id(leaf))
        if cached is None or cached[0] is not leaf:
            cached = (leaf, leaf.to(to_type))
            self._cache[id(leaf)] = cached
        return cached[1]


def _eligible(leaf: object) -> bool:
    """``is_eligible`` with the trace's CPU tensors standing in for CUDA tensors."""
    return (
        isinstance(leaf, torch.Tensor)
        and leaf.device.type == "cpu"
        and leaf.is_floating_point()
        and leaf.dtype != torch.float64
    )


def _set_dtype_if_unset(op: torch._ops.OpOverload, args: tuple, kwargs: dict, dtype: torch.dtype):
    position = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
    if len(args) > position:
        if args[position] is None:
            args = (*args[:position], dtype, *args[position + 1 :])
    elif kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": dtype}
    return args, kwargs


def _promote_type(tree, lower: torch.dtype) -> torch.dtype:
    """``promote_type``: fp32 if any eligible floating input is fp32, else the autocast dtype."""
    current = lower
    for leaf in torch.utils._pytree.tree_leaves(tree):
        if _eligible(leaf) and (current == torch.float32 or leaf.dtype == torch.float32):
            current = torch.float32
    return current
