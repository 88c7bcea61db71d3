"""Layer norm's saved statistics as CUDA keeps them.

``native_layer_norm`` returns the output and, for its backward, each row's mean and reciprocal standard deviation.
CUDA makes those two in the accumulation type, float32 for half and bfloat16 inputs (``layer_norm_cuda`` in
aten/src/ATen/native/cuda/layer_norm_kernel.cu: ``at::empty({M}, X->options().dtype(acc_type))``); CPU makes them
in the input's dtype, and so does the meta kernel a trace on CPU runs. The H200 recordings of bf16 steps
(tests/fixtures/cuda) hold them in float32: twice the bytes, kept for every layer norm's backward.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LAYER_NORM = torch.ops.aten.native_layer_norm.default
HALF_PRECISION = (torch.float16, torch.bfloat16)


class NormStatistics(TorchDispatchMode):
    """Below the recorder: the op it records returns the statistics in float32, as the CUDA kernel does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not LAYER_NORM or args[0].dtype not in HALF_PRECISION:
            return func(*args, **kwargs)
        out, mean, rstd = func(*args, **kwargs)
        return (
            out,
            torch.empty_strided(mean.shape, mean.stride(), dtype=torch.float32),
            torch.empty_strided(rstd.shape, rstd.stride(), dtype=torch.float32),
        )
