"""DDP as a transform of the single-GPU trace, against DDP itself run for one rank of N."""

from __future__ import annotations

import pytest
from runtimes import ddp_peak
from tiny_models import tiny_model

from analysis.peak import find_peak, timeline
from strategies.ddp import BUCKET_CAP_BYTES, FIRST_BUCKET_BYTES, bucket_sizes, ddp
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup

TOLERANCE = 0.01
MIB = 1024**2


# Wide enough for 30-80 MiB of fp32 gradients: the first bucket, 25 MiB ones, and a last partial one.
WIDE = {"vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": 6}


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon", "opt"])
def test_ddp_matches_the_runtime(family):
    model = tiny_model(family, **WIDE)
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32)
    runtime = ddp_peak(model, setup, world=4)
    estimate = find_peak(timeline(ddp(build_graph(trace_step(model, setup))), rounded=False)).bytes
    assert abs(estimate - runtime) / runtime <= TOLERANCE, (estimate, runtime)


def test_buckets_close_at_1_mib_then_25_mib_per_dtype():
    grads = [("float32", MIB // 2)] * 3 + [("float32", 10 * MIB)] * 3 + [("bfloat16", 2 * MIB)]
    assert sorted(bucket_sizes(grads)) == [
        ("bfloat16", 2 * MIB),  # each dtype's first bucket closes at 1 MiB
        ("float32", FIRST_BUCKET_BYTES),
        ("float32", MIB // 2 + 30 * MIB),  # later ones once they reach 25 MiB
    ]
    assert BUCKET_CAP_BYTES == 25 * MIB
