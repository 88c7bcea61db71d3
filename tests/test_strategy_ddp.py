"""DDP, and DDP with ZeroRedundancyOptimizer (PyTorch's ZeRO-1), as transforms of the single-GPU trace, against
the runtimes themselves run for one rank of N."""

from __future__ import annotations

import pytest
import torch
from runtimes import ddp_peak, fake_process_group
from tiny_models import tiny_model
from torch.distributed.optim import ZeroRedundancyOptimizer

from analysis.peak import find_peak, timeline
from strategies.ddp import BUCKET_CAP_BYTES, FIRST_BUCKET_BYTES, bucket_sizes, ddp
from strategies.zero_redundancy import partition, zero_redundancy
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

TOLERANCE = 0.01
MIB = 1024**2


# Wide enough for 30-80 MiB of fp32 gradients: the first bucket, 25 MiB ones, and a last partial one.
WIDE = {"vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": 6}


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow), "falcon", "opt"])
def test_ddp_matches_the_runtime(family):
    model = tiny_model(family, **WIDE)
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32)
    runtime = ddp_peak(model, setup, world=4)
    estimate = find_peak(timeline(ddp(build_graph(trace_step(model, setup))), rounded=False)).bytes
    assert abs(estimate - runtime) / runtime <= TOLERANCE, (estimate, runtime)


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow), "opt"])
@pytest.mark.parametrize("rank", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_zero_redundancy_optimizer_matches_the_runtime(family, rank):
    """ZeRO-1 in PyTorch: each rank keeps the optimizer states of the whole parameters assigned to it."""
    model = tiny_model(family, **WIDE)
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32)
    runtime = ddp_peak(model, setup, world=4, rank=rank, zero_redundancy=True)
    step = zero_redundancy(ddp(build_graph(trace_step(model, setup))), world=4, rank=rank)
    estimate = find_peak(timeline(step, rounded=False)).bytes
    assert abs(estimate - runtime) / runtime <= TOLERANCE, (estimate, runtime)


@pytest.mark.parametrize("rank", [0, 2])
def test_zero_redundancy_partitions_the_trained_parameters_only(rank):
    """Under LoRA the optimizer is given the adapters alone; the frozen base weights must not weigh in the
    partition. A wrong partition moves whole state tensors between ranks (8 KiB here, under 1% of the peak), so
    the bytes must be equal, not close. Eight layers and a vocabulary of 32 put the peak in backward."""
    model = tiny_model("llama", num_hidden_layers=8, vocab_size=32, num_attention_heads=8, num_key_value_heads=8)
    lora = LoraSetup(r=4, alpha=8, targets=("q_proj", "v_proj"))
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, lora=lora)
    runtime = ddp_peak(model, setup, world=4, rank=rank, zero_redundancy=True)
    step = zero_redundancy(ddp(build_graph(trace_step(model, setup))), world=4, rank=rank)
    assert find_peak(timeline(step, rounded=False)).bytes == runtime


def test_zero_redundancy_partition_is_torchs():
    sizes = [("a", 10), ("b", 40), ("c", 30), ("d", 30), ("e", 5), ("f", 30)]
    params = {name: torch.nn.Parameter(torch.zeros(numel)) for name, numel in sizes}
    names = {id(param): name for name, param in params.items()}
    with fake_process_group(3, 0):
        optimizer = ZeroRedundancyOptimizer(list(params.values()), torch.optim.SGD, lr=0.1)
        torchs = [
            [names[id(p)] for group in rank for p in group["params"]] for rank in optimizer._partition_parameters()
        ]
    assert partition(sizes, 3) == torchs


def test_buckets_close_at_1_mib_then_25_mib_per_dtype():
    grads = [("float32", MIB // 2)] * 3 + [("float32", 10 * MIB)] * 3 + [("bfloat16", 2 * MIB)]
    assert sorted(bucket_sizes(grads)) == [
        ("bfloat16", 2 * MIB),  # each dtype's first bucket closes at 1 MiB
        ("float32", FIRST_BUCKET_BYTES),
        ("float32", MIB // 2 + 30 * MIB),  # later ones once they reach 25 MiB
    ]
    assert BUCKET_CAP_BYTES == 25 * MIB
