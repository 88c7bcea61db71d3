"""Expert parallelism in training (``--ep``): the busiest rank's estimate against torchtitan's token dispatcher run
for that rank with PyTorch's own ``all_to_all_single`` on a fake process group, alone, under DDP and under FSDP2 as
torchtitan's ``apply_fsdp`` applies it.

    python -m benchmarks.expert_parallel_accuracy [--markdown]

Each case traces the rank's step (its experts, the exchange on the assumed routing), alone, under DDP with the
experts left out, or under torchtitan's FSDP2 (``--zero 2/3``: the experts sharded over the GPUs holding them, on a
2-D mesh) (``strategies.layout.prepare``), and compares the peak with tests/ep_runtime.py's: real CPU tensors, the
router forced to the same routing, every storage counted (``--target cpu``). Tiny configs of four layers and a
vocabulary of 32, whose peak falls in the MoE layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from ep_runtime import expert_parallel_fsdp_step, expert_parallel_peak
from tiny_models import deep_tiny_model

from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next")
SHAPE = {"target": Target.CPU, "batch_size": 2, "seq_len": 32}
VARIANTS = {
    "bf16": {"dtype": "bf16"},
    "bf16 mixed precision": {"mixed_precision": "bf16"},  # autocast; FSDP2's MixedPrecisionPolicy under --zero 2/3
    "full checkpointing": {"grad_checkpointing": "full"},
}


@dataclass(frozen=True)
class Case:
    family: str
    gpus: int
    ep: int
    zero: int | None  # None: the step alone, no data-parallel runtime; 0: DDP; 2, 3: torchtitan's FSDP2
    imbalance: float = 1.0
    variant: str = "fp32"
    rank: int = 0

    @property
    def setup(self) -> TrainingSetup:
        return TrainingSetup(**SHAPE, **VARIANTS.get(self.variant, {}))

    @property
    def runtime(self) -> str:
        if self.zero is None:
            return "alone"
        return "DDP, experts left out" if self.zero == 0 else f"FSDP2 --zero {self.zero}"


def cases() -> list[Case]:
    found = [
        Case(family, 2, 2, zero, imbalance)
        for family in FAMILIES
        for imbalance, zero in ((1.0, None), (1.0, 0), (2.0, 0))
    ]
    found += [Case("qwen3_moe", 4, 4, 0, imbalance) for imbalance in (1.0, 1.5, 2.0)]
    found += [Case("qwen3_moe", 2, 2, 0, 1.5, variant) for variant in VARIANTS]
    # FSDP2: the experts' group of one GPU (2 over 2), Shard(0) over 2 (4 over 2), Shard(1) over 4 (8 over 2)
    found += [Case(family, gpus, 2, zero) for family in FAMILIES for gpus in (2, 4, 8) for zero in (3, 2)]
    found += [Case("qwen3_moe", gpus, 4, zero) for gpus in (4, 8) for zero in (3, 2)]
    found += [
        Case(family, gpus, ep, zero, variant=variant)
        for variant in VARIANTS
        for family, gpus, ep, zero in (("qwen3_moe", 4, 2, 3), ("qwen3_moe", 8, 4, 2), ("gpt_oss", 8, 2, 3))
    ]
    found += [Case("qwen3_moe", 4, 2, 3, 2.0), Case("qwen3_moe", 8, 4, 2, 2.0)]
    found += [Case("qwen3_moe", 4, 2, 3, 1.5, rank=3), Case("gpt_oss", 8, 2, 3, rank=7)]  # the last ranks
    return found


def measured_peak(model, case: Case) -> int:
    setup = case.setup
    if case.zero in (None, 0):
        return expert_parallel_peak(model, setup, case.ep, case.imbalance, ddp=case.zero == 0)
    step = expert_parallel_fsdp_step(model, setup, case.gpus, case.ep, case.imbalance, case.zero == 3, case.rank)
    return find_peak(timeline(step, rounded=False)).bytes


def estimate_peak(model, case: Case) -> int:
    layout = Layout(gpus=case.gpus, ep=case.ep, zero=case.zero or 0, routing_imbalance=case.imbalance)
    prepared = prepare(layout, case.setup, model.config)
    step = build_graph(trace_step(model, prepared.traced))
    if case.zero is not None:
        step = prepared.rank_step(step, Rank(dp=case.rank))
    return find_peak(timeline(step, rounded=False)).bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args()
    start = time.perf_counter()
    rows, errors = [], []
    for case in cases():
        model = deep_tiny_model(case.family, 4, vocab_size=32)
        measured = measured_peak(model, case)
        estimated = estimate_peak(model, case)
        error = (estimated - measured) / measured
        errors.append(abs(error))
        layout = f"{case.gpus} GPUs, ep {case.ep}" + (f", rank {case.rank}" if case.rank else "")
        rows.append(
            [
                case.family,
                layout,
                f"{case.imbalance:g}",
                case.runtime,
                case.variant,
                measured,
                estimated,
                f"{error:+.3%}",
            ]
        )
    headers = ["family", "layout", "imbalance", "runtime", "setup", "runtime bytes", "estimate bytes", "error"]
    print(tabulate(rows, headers, tablefmt="github" if args.markdown else "simple", intfmt=","))
    elapsed = time.perf_counter() - start
    print(
        f"\n{len(rows)} cases, max |error| {max(errors):.3%}, median {statistics.median(errors):.3%}, {elapsed:.0f} s "
        f"(torch {torch.__version__}, transformers {transformers.__version__})"
    )


if __name__ == "__main__":
    main()
