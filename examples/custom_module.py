"""Estimate a model that is no transformers id: a torchtitan-style Llama, built by a factory and trained with the
loss of your own loop, under FSDP2 over 8 GPUs with torchtitan's per-op selective checkpointing.

Any ``nn.Module`` works the same way: the factory runs on fake tensors (nothing is allocated, no weights are
read), ``loss_fn(model, batch)`` is your loop's forward and loss, and the tool runs ``loss.backward()``,
``optimizer.step()`` and ``optimizer.zero_grad()`` after it. ``python examples/custom_module.py``
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from analysis.estimate import analyze
from strategies.layout import Layout
from tracer.custom import CustomModel
from tracer.step import Batch
from tracer.training import TrainingSetup
from tracer.units import format_bytes


@dataclass(frozen=True)
class LlamaArgs:
    """torchtitan's TransformerModelArgs, the fields that set memory (Llama 3.1 8B's values)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_dim: int = 14336
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


def rotary_frequencies(head_dim: int, positions: int, theta: float) -> torch.Tensor:
    """RoPE as complex rotations, one row per position (torchtitan's precompute_freqs_cis, without scaling)."""
    frequencies = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(positions).float(), frequencies)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = pairs * frequencies[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(rotated).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.repeats = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of them
        q = self.wq(x).view(batch, length, -1, self.head_dim)
        k = self.wk(x).view(batch, length, -1, self.head_dim)
        v = self.wv(x).view(batch, length, -1, self.head_dim)
        q, k = rotate(q, frequencies), rotate(k, frequencies)
        k, v = (t.repeat_interleave(self.repeats, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), frequencies)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """torchtitan's layout: ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict``), ``norm`` and ``output``."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(index): TransformerBlock(args) for index in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        frequencies = rotary_frequencies(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("freqs_cis", frequencies, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def cross_entropy_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """torchtitan's forward and loss: ``pred = model(inputs); loss = loss_fn(pred, labels); del pred``."""
    pred = model(batch.input_ids)
    return F.cross_entropy(pred.flatten(0, 1).float(), batch.labels.flatten(0, 1))


# torchtitan's tensor-parallel plan for the blocks (parallelize_llama's apply_tp), in transformers' notation.
TP_PLAN = {
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
}


def titan_llama(args: LlamaArgs, name: str = "torchtitan-style Llama") -> CustomModel:
    return CustomModel(
        name, partial(Transformer, args), cross_entropy_loss, vocab_size=args.vocab_size, tp_plan=TP_PLAN
    )


if __name__ == "__main__":
    model = titan_llama(LlamaArgs(), "torchtitan-style Llama 3.1 8B")
    setup = TrainingSetup(batch_size=1, seq_len=8192, mixed_precision="bf16", grad_checkpointing="op")
    report = analyze(model, setup, Layout(gpus=8, zero=3))
    print(f"{model.name}, FSDP2 over 8 GPUs, bf16, batch 1 x 8192, per-op selective checkpointing:")
    print(f"  peak {format_bytes(report.peak_bytes)} allocated at {report.peak_op} ({report.peak_phase})")
    print(f"  {format_bytes(report.reserved_bytes)} reserved by the caching allocator")
