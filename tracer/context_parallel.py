"""Context parallelism as ``torch.distributed.tensor.experimental.context_parallel`` runs it (torch 2.13), for one
rank of C.

torchtitan shards the batch's sequence over the C ranks of the context-parallel group, load balanced for causal
attention (``_HeadTailLoadBalancer``: the sequence cut into 2C chunks, rank r holding chunks r and 2C - 1 - r), and
enables the dispatcher that runs every ``scaled_dot_product_attention`` as ring attention. Everything but
attention then runs on the rank's seq/C tokens as on any others, so the rank is traced on them, with
``F.scaled_dot_product_attention`` replaced as the dispatcher replaces it (``_DispatchMode.MONKEY_PATCH``) by
ring attention over the base kernel the step would run (flash attention: on CUDA ``_scaled_dot_product_flash_
attention``, on a CPU its ``_for_cpu`` kernel).

The ring is transcribed from ``_context_parallel/_attention.py``: ``_templated_ring_attention`` (the key and value
made contiguous, concatenated and all-gathered once by the default ``_AllGatherRotater``, one kernel call per
block of the ring with the causal behaviour and the round-robin halves ``_is_causal_behavior`` picks, merged in
float32 by ``_SDPAMerger``) and ``_templated_ring_attention_backward`` (float32 gradient accumulators, the key and
value gathered again, the key/value gradients passed on by ``_AllToAllRotater``'s ``permute_tensor``), autograd
saving what the flash kernel's own node saves (the local query, key and value, the merged output and
log-sum-exp). The collectives are PyTorch's functional ops, whose registered fake kernels allocate their outputs
without a process group. The token positions' values and the causal mask's content do not change memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest.mock import patch

import torch
import torch.distributed._functional_collectives  # registers the fake kernels of its ops
import torch.nn.functional as F

from tracer.errors import UserError

ROUND_ROBIN_CYCLE = 2
SEQ_DIM = 2  # (batch, heads, sequence, head dim), as torch's handlers hard-code it
GROUP = "context_parallel"  # a group name the fake kernels never look up


def local_length(seq_len: int, degree: int) -> int:
    """Tokens of the sequence each rank holds: the load balancer's 2C chunks, two per rank."""
    if seq_len % (ROUND_ROBIN_CYCLE * degree):
        raise UserError(
            f"--cp {degree} cuts the sequence into {ROUND_ROBIN_CYCLE * degree} chunks (two per rank, load balanced "
            f"for causal attention): --seq-len {seq_len} must be a multiple of {ROUND_ROBIN_CYCLE * degree}."
        )
    return seq_len // degree


class _Kernel:
    """The base attention kernel and its backward, on the device the step targets."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def forward(self, q, k, v, is_causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        if self.cuda:
            out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal, False, scale=scale
            )
            return out, lse, tuple(rest)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse, ()

    def backward(self, grad_out, q, k, v, out, lse, rest: tuple, is_causal: bool, scale: float | None):
        if self.cuda:
            cum_q, cum_k, max_q, max_k, seed, offset, _ = rest
            return torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset, scale=scale
            )
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )


def _causal_behavior(rank: int, size: int, i: int, is_causal: bool) -> bool | None:
    """``_is_causal_behavior`` with load balancing: the first block causal, the others whole (None: skipped)."""
    if not is_causal:
        return False
    return i == 0


def _partial_update(original: torch.Tensor, new: torch.Tensor, idx: int, add: bool) -> torch.Tensor:
    chunks = list(original.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM))
    if add:
        chunks[idx] += new
    else:
        chunks[idx] = new
    return torch.cat(chunks, dim=SEQ_DIM)


class _Merger:
    """``_SDPAMerger`` with ``convert_to_f32``."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.dtypes: tuple[torch.dtype, torch.dtype] | None = None

    def step(self, block_out: torch.Tensor, block_lse: torch.Tensor, partial: bool) -> None:
        self.dtypes = (block_out.dtype, block_lse.dtype)
        block_out, block_lse = block_out.to(torch.float32), block_lse.to(torch.float32).unsqueeze(dim=-1)
        if self.lse is None:
            self.out, self.lse = block_out, block_lse
            return
        lse = self.lse.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[1] if partial else self.lse
        out = self.out.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[1] if partial else self.out
        out = out - F.sigmoid(block_lse - lse) * (out - block_out)
        lse = lse - F.logsigmoid(lse - block_lse)
        if partial:
            self.lse = _partial_update(self.lse, lse, idx=1, add=False)
            self.out = _partial_update(self.out, out, idx=1, add=False)
        else:
            self.lse, self.out = lse, out

    def results(self) -> tuple[torch.Tensor, torch.Tensor]:
        out_dtype, lse_dtype = self.dtypes
        return self.out.to(out_dtype), self.lse.squeeze(-1).to(lse_dtype)


def _all_gather(buffer: torch.Tensor, size: int) -> torch.Tensor:
    """``_AllGatherRotater``: one all-gather of the rank's key and value, read back block by block."""
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(buffer.contiguous(), size, GROUP)
    return torch.ops._c10d_functional.wait_tensor(gathered)


def _permute(buffer: torch.Tensor, size: int) -> torch.Tensor:
    """``_AllToAllRotater``: ``permute_tensor`` to the next rank, an all-to-all of the whole buffer."""
    buffer = buffer.contiguous()
    splits = [buffer.numel()] + [0] * (size - 1)
    moved = torch.ops._c10d_functional.all_to_all_single(buffer, splits, splits, GROUP)
    return torch.ops._c10d_functional.wait_tensor(moved)


def ring_forward(kernel: _Kernel, rank: int, size: int, q, k, v, is_causal: bool, scale: float | None):
    """``_templated_ring_attention`` with load balancing and the all-gather rotater."""
    key, value = k.contiguous(), v.contiguous()
    merger, rest = _Merger(), ()
    gathered = None
    for i in range(size):
        if i > 0:
            block = gathered.chunk(size)[rank - i]
            key = block[: key.numel()].reshape(key.shape)
            value = block[key.numel() :].reshape(value.shape)
        if i < size - 1:  # concatenated every block; gathered the first time only
            concatenated = torch.cat([key.flatten(), value.flatten()])
            gathered = _all_gather(concatenated, size) if gathered is None else gathered
            del concatenated
        causal = _causal_behavior(rank, size, i, is_causal)
        if i == 0 or not is_causal:
            block_q, block_k, block_v, partial = q, key, value, False
        elif i <= rank:
            block_q, partial = q, False
            block_k = key.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[0]
            block_v = value.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[0]
        else:
            block_q, block_k, block_v, partial = q.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[1], key, value, True
        out, lse, rest = kernel.forward(block_q, block_k, block_v, causal, scale)
        merger.step(out, lse, partial)
    out, lse = merger.results()
    return out, lse, rest


def ring_backward(kernel: _Kernel, rank: int, size: int, grad_out, q, k, v, out, lse, rest, is_causal, scale):
    """``_templated_ring_attention_backward`` with load balancing, its variables kept as long as it keeps them: the
    key and value gathered once (each block's concatenation held until the next one's), the key/value gradients
    passed around the ring by an all-to-all each block (the rotater holding the last)."""
    grad_query = torch.zeros_like(q, dtype=torch.float32)
    grad_key = torch.zeros_like(k, dtype=torch.float32)
    grad_value = torch.zeros_like(v, dtype=torch.float32)
    key, value = k.contiguous(), v.contiguous()
    gathered, next_kv, passed = None, None, None
    for i in range(size):
        if i > 0:
            block = gathered.chunk(size)[rank - i]
            key = block[: key.numel()].reshape(key.shape)
            value = block[key.numel() : key.numel() + value.numel()].reshape(value.shape)
        if i != size - 1:
            next_kv = torch.cat([key.flatten(), value.flatten()])
            gathered = _all_gather(next_kv, size) if gathered is None else gathered
        causal = _causal_behavior(rank, size, i, is_causal)
        if i == 0 or not is_causal:  # torch's names; each held until the next block rebinds it
            q_, k_, v_, out_, dout, lse_ = (q, key, value, out, grad_out, lse)
        elif i <= rank:
            q_, out_, dout, lse_ = q, out, grad_out, lse
            k_, v_ = key.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[0], value.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[0]
        else:
            q_, out_, dout = (t.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[1] for t in (q, out, grad_out))
            k_, v_, lse_ = key, value, lse.chunk(ROUND_ROBIN_CYCLE, dim=SEQ_DIM)[1].contiguous()
        grad_q_, grad_k_, grad_v_ = kernel.backward(dout, q_, k_, v_, out_, lse_, rest, causal, scale)[:3]
        if i == 0:
            grad_key += grad_k_
            grad_value += grad_v_
        else:
            next_grad_kv = passed
            grad_key = next_grad_kv[: grad_key.numel()].reshape(grad_key.shape)
            grad_value = next_grad_kv[grad_key.numel() :].reshape(grad_value.shape)
            if i <= rank:
                grad_key = _partial_update(grad_key, grad_k_, idx=0, add=True)
                grad_value = _partial_update(grad_value, grad_v_, idx=0, add=True)
            else:
                grad_key += grad_k_
                grad_value += grad_v_
        next_grad_kv = torch.cat([grad_key.flatten(), grad_value.flatten()])
        passed = _permute(next_grad_kv, size)
        if i <= rank:
            grad_query += grad_q_
        else:
            grad_query = _partial_update(grad_query, grad_q_, idx=1, add=True)
    grad_query = grad_query.to(q.dtype)
    next_grad_kv = passed.to(k.dtype)
    grad_key = next_grad_kv[: grad_key.numel()].reshape(grad_key.shape)
    grad_value = next_grad_kv[grad_key.numel() :].reshape(grad_value.shape)
    return grad_query, grad_key, grad_value


class _RingAttention(torch.autograd.Function):
    """The flash kernel's autograd node over the ring: it saves the local query, key and value, the merged output
    and log-sum-exp (and the kernel's seeds), as the native node does for the DTensors the dispatcher passes."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: _Kernel, rank: int, size: int, is_causal: bool, scale: float | None):
        out, lse, rest = ring_forward(kernel, rank, size, q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rest, ctx.kernel, ctx.rank, ctx.size, ctx.is_causal, ctx.scale = rest, kernel, rank, size, is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = ring_backward(
            ctx.kernel, ctx.rank, ctx.size, grad_out, q, k, v, out, lse, ctx.rest, ctx.is_causal, ctx.scale
        )
        return (*grads, None, None, None, None, None)


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What autocast does to attention's inputs before the dispatcher sees them (``scaled_dot_product_attention`` is
    a lower-precision op): floating ones cast to the autocast dtype."""
    if not torch.is_autocast_enabled("cpu"):  # the trace's autocast, CUDA's policies included, is CPU's
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


@contextmanager
def ring_attention(degree: int, rank: int, cuda: bool) -> Iterator[None]:
    """While active, ``F.scaled_dot_product_attention`` is ring attention over ``degree`` ranks, as rank ``rank``."""
    kernel = _Kernel(cuda)
    original: Callable = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p:
            raise UserError(
                "--cp runs attention as torch's ring attention, which takes no attention mask and no dropout: this "
                "model's attention passes one (a sliding window, a bias, packed sequences or attention dropout)."
            )
        query, key, value = autocast_inputs(query, key, value)
        return _RingAttention.apply(query, key, value, kernel, rank, degree, is_causal, scale)

    with patch.object(F, "scaled_dot_product_attention", sdpa):
        yield
    del original
