"""Reproduce, in a trace that runs on CPU, the CUDA behaviour that changes memory.

Each emulation lives in its own module and cites the PyTorch source it follows:

* :mod:`tracer.cuda.autocast` — CUDA autocast's per-op cast policies and its weight-cast cache;
* :mod:`tracer.cuda.kernels` — SDPA backend choice (flash / memory-efficient / math) and fused dropout;
* :mod:`tracer.cuda.workspaces` — the cuBLAS workspace and attention-backward scratch buffers;
* :mod:`tracer.cuda.norm_statistics` — layer norm's saved mean and rstd in float32 for half-precision inputs.

Also CUDA-specific, and handled where the trace is built: optimizers default to ``foreach`` on CUDA
(``_default_to_fused_or_foreach``), and their ``step`` counters stay on the host (``capturable=False``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch

from tracer.cuda.autocast import CudaAutocast
from tracer.cuda.kernels import CudaKernels
from tracer.cuda.norm_statistics import NormStatistics
from tracer.cuda.workspaces import KernelScratch, cublas_workspace_bytes
from tracer.gpus import Gpu


class CudaEmulation:
    """Everything CUDA-specific for one trace. Enter it before building the model."""

    def __init__(self, gpu: Gpu, autocast_dtype: torch.dtype | None) -> None:
        self.gpu = gpu
        self.autocast_dtype = autocast_dtype
        self.kernels = CudaKernels(gpu)
        self._autocast = CudaAutocast() if autocast_dtype is not None else None
        self._stack = ExitStack()

    def __enter__(self) -> CudaEmulation:
        # A with statement whose __enter__ raises never calls __exit__: undo what was entered before the error.
        with ExitStack() as stack:
            stack.enter_context(self.kernels)
            stack.enter_context(NormStatistics())  # under the recorder's mode: it records the op as CUDA runs it
            if self._autocast is not None:
                stack.enter_context(self._autocast)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def autocast(self) -> AbstractContextManager:
        if self._autocast is None:
            return nullcontext()
        return self._autocast.region(self.autocast_dtype)

    def kernel_scratch(self) -> KernelScratch:
        return KernelScratch()

    @property
    def cublas_workspace_bytes(self) -> int:
        return cublas_workspace_bytes(self.gpu)
