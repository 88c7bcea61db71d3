"""Expert parallelism in training (``--ep``): the busiest rank's estimate against torchtitan's token dispatcher run
for that rank with PyTorch's own ``all_to_all_single`` on a fake process group.

    python -m benchmarks.expert_parallel_accuracy [--markdown]

Each case traces the rank's step (its experts, the exchange on the assumed routing), alone or under DDP with the
experts left out (``strategies.layout.prepare``), and compares the peak with tests/ep_runtime.py's: real CPU
tensors, the router forced to the same routing, every storage counted (``--target cpu``). Tiny configs of four
layers and a vocabulary of 32, whose peak falls in the MoE layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ep_runtime import expert_parallel_peak
from tiny_models import deep_tiny_model

from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next")
SETUP = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32)


def cases() -> list[tuple[str, int, float, bool, TrainingSetup, str]]:
    """(family, ranks, imbalance, under DDP, setup, what varies)."""
    found = [
        (family, 2, imbalance, ddp, SETUP, "fp32")
        for family in FAMILIES
        for imbalance, ddp in ((1.0, False), (1.0, True), (2.0, True))
    ]
    found += [("qwen3_moe", 4, imbalance, True, SETUP, "fp32") for imbalance in (1.0, 1.5, 2.0)]
    for what, options in (
        ("bf16", {"dtype": "bf16"}),
        ("bf16 autocast", {"mixed_precision": "bf16"}),
        ("full checkpointing", {"grad_checkpointing": "full"}),
    ):
        found.append(
            ("qwen3_moe", 2, 1.5, True, TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, **options), what)
        )
    return found


def estimate_peak(model, setup: TrainingSetup, ranks: int, imbalance: float, ddp: bool) -> int:
    prepared = prepare(Layout(gpus=ranks, ep=ranks, routing_imbalance=imbalance), setup, model.config)
    step = build_graph(trace_step(model, prepared.traced))
    return find_peak(timeline(prepared.rank_step(step, Rank()) if ddp else step, rounded=False)).bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()
    start = time.perf_counter()
    rows, errors = [], []
    for family, ranks, imbalance, ddp, setup, what in cases():
        model = deep_tiny_model(family, 4, vocab_size=32)
        measured = expert_parallel_peak(model, setup, ranks, imbalance, ddp)
        estimated = estimate_peak(model, setup, ranks, imbalance, ddp)
        error = (estimated - measured) / measured
        errors.append(abs(error))
        runtime = "DDP, experts left out" if ddp else "alone"
        rows.append([family, ranks, f"{imbalance:g}", runtime, what, measured, estimated, f"{error:+.3%}"])
    headers = ["family", "ranks", "imbalance", "runtime", "setup", "runtime bytes", "estimate bytes", "error"]
    print(tabulate(rows, headers, tablefmt="github" if args.markdown else "simple", intfmt=","))
    elapsed = time.perf_counter() - start
    print(
        f"\n{len(rows)} cases, max |error| {max(errors):.3%}, median {statistics.median(errors):.3%}, {elapsed:.0f} s "
        f"(torch {torch.__version__}, transformers {transformers.__version__})"
    )


if __name__ == "__main__":
    main()
