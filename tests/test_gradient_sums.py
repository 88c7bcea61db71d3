"""How the autograd engine sums a tensor's gradients, in the run users launch and under a dispatch mode.

A weight used twice (a tied embedding and output layer) gets two gradients, which the engine adds in its input
buffer (``InputBuffer::accumulate``): in place into one of them when it holds the last reference and neither is
"tensor-subclass-like", out of place otherwise. ``at::isTensorSubclassLike`` is true for every tensor while a
``TorchDispatchMode`` is active, and for FakeTensors: so the estimate's trace (FakeTensorMode) and every
measurement under a recording mode (``analysis.measure``'s recorder) add out of place, one gradient-sized block
more than a plain run holds at that moment. On an H200 this is Llama-3.2-1B's ZeRO-1 rank, +4.62%: its harness
runs the step plainly, and its peak falls at the sum of the tied embedding's gradients (docs/limits.md).
"""

from __future__ import annotations

import torch
from tiny_models import tiny_model
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

VOCAB = 8192


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _embedding_sized_allocations(under_a_mode: bool) -> int:
    """The float32 embedding-sized blocks the backward of a tied tiny Llama allocates, under bf16 autocast."""
    config = tiny_model("llama", vocab_size=VOCAB, tie_word_embeddings=True).config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        if under_a_mode:
            with _PassThrough():
                loss.backward()
        else:
            loss.backward()
    sizes = [event.nbytes() for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    return sum(size == VOCAB * config.hidden_size * 4 for size in sizes)


def test_a_plain_run_sums_a_tied_weights_gradients_in_place():
    # the output layer's gradient (cast to float32) and the embedding's; the sum is made in the first
    assert _embedding_sized_allocations(under_a_mode=False) == 2


def test_under_a_dispatch_mode_the_sum_is_a_new_tensor():
    assert _embedding_sized_allocations(under_a_mode=True) == 3
