"""Device memory that CUDA libraries take from the caching allocator without it showing as an op output.

* The cuBLAS workspace, shared with cuBLASLt, allocated on the first matmul and kept for the process:
  ``getChosenWorkspaceSize`` in aten/src/ATen/cuda/CublasHandlePool.cpp (32 MiB on sm90/sm100/sm120,
  ``:4096:2:16:8`` = 8 MiB + 128 KiB elsewhere, unless ``CUBLAS_WORKSPACE_CONFIG`` says otherwise).
  One per cuBLAS handle and stream (``cublas_handle_stream_to_workspace``), and handles are per thread
  (``thread_local ... myPoolWindow``). Training runs its matmuls on two threads: the forward on the caller's,
  the backward on the autograd engine's thread for the device. So a training process keeps two: on an H200
  (torch 2.11) every training step measured kept two 32 MiB blocks to its end, every ``generate()`` one
  (benchmarks/ground_truth/data/nvidia-h200/*.trace.json.gz).
* Scratch buffers that attention backward kernels allocate for the duration of the kernel:
  flash (``mha_bwd`` in flash_attn/flash_api.cpp) allocates ``softmax_d`` and ``dq_accum`` in fp32, plus
  full-head ``dk``/``dv`` for grouped-query attention; memory-efficient attention
  (``_efficient_attention_backward`` in attention_backward.cu) allocates ``delta`` in fp32.
"""

from __future__ import annotations

import os
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tracer.gpus import Gpu
from tracer.units import round_up

KIB = 1024
CUBLAS_THREADS_IN_TRAINING = 2  # the caller's thread (forward, optimizer) and autograd's device thread (backward)


def cublas_workspace_bytes(gpu: Gpu) -> int:
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * KIB * int(count) for size, count in pairs)
    if gpu.compute_capability[0] in (9, 10, 12):
        return 4096 * KIB * 8
    return 4096 * KIB * 2 + 16 * KIB * 8


def flash_backward_scratch(query: torch.Tensor, key: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes ``mha_bwd`` allocates besides dq, dk, dv. ``query`` is (B, H, L, D)."""
    batch, heads, seq_q, head_dim = query.shape
    head_size = round_up(head_dim, 8)
    head_size_rounded = round_up(head_size, 32 if head_size <= 128 else 64)
    seq_q_rounded = round_up(seq_q, 128)
    scratch = [
        ((batch, heads, seq_q_rounded), torch.float32),  # softmax_d
        ((batch, seq_q_rounded, heads, head_size_rounded), torch.float32),  # dq_accum
    ]
    if key.size(1) != heads:  # MQA / GQA: dk and dv for every query head, summed into the kv heads after
        expanded = (batch, key.size(2), heads, head_size)
        scratch += [(expanded, query.dtype), (expanded, query.dtype)]
    return scratch


def efficient_backward_scratch(query: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``delta`` of ``_efficient_attention_backward``. ``query`` is (B, H, L, D)."""
    batch, heads, seq_q, _ = query.shape
    return [((batch, heads, seq_q), torch.float32)]


class KernelScratch(TorchDispatchMode):
    """Allocates each kernel's scratch buffers around the op, so the recorder sees them live during it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        scratch = self._scratch(func, args)
        # Made from the query, so that the trace links them to it (their size follows its heads).
        buffers = [args[1].new_empty(shape, dtype=dtype) for shape, dtype in scratch]
        out = func(*args, **(kwargs or {}))
        del buffers
        return out

    @staticmethod
    def _scratch(func, args) -> list[tuple[tuple[int, ...], torch.dtype]]:
        if func is torch.ops.aten._scaled_dot_product_flash_attention_backward.default:
            return flash_backward_scratch(args[1], args[2])
        if func is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default:
            return efficient_backward_scratch(args[1])
        return []
