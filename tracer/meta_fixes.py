"""Where a fake tensor's meta kernel is stricter than the real kernels, give the real result's shape.

``aten._grouped_mm`` (the experts matmul of transformers' MoE layers) has a meta kernel that accepts only
bf16 inputs, while its CPU kernel and CUDA fallback (a loop of matmuls into one output) take any float
dtype. Its output is allocated once, as the meta kernel describes it; only the dtype differs.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GROUPED_MM = torch.ops.aten._grouped_mm.default


class MetaFixes(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is GROUPED_MM and args[0].dtype != torch.bfloat16:
            as_bf16 = [torch.empty_strided(a.shape, a.stride(), dtype=torch.bfloat16) for a in args[:2]]
            shaped = func(*as_bf16, *args[2:], **kwargs)
            dtype = kwargs.get("out_dtype") or args[0].dtype
            return torch.empty_strided(shaped.shape, shaped.stride(), dtype=dtype)
        return func(*args, **kwargs)
