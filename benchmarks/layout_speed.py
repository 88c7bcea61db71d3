"""Time to evaluate one more parallel layout on an existing trace: the transforms, the timeline and the
peak, for every distinct rank, without tracing again.

    python -m benchmarks.layout_speed [--model meta-llama/Llama-2-7b-hf] [--batch-size 1] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import os
import time

from tabulate import tabulate

from analysis.peak import find_peak, timeline
from strategies.layout import Layout, prepare
from tracer.graph import build_graph
from tracer.resolve import resolve_model
from tracer.tracing import trace_step
from tracer.training import TrainingSetup

LAYOUTS = (
    Layout(gpus=8),
    Layout(gpus=8, zero=1),
    Layout(gpus=8, zero=2),
    Layout(gpus=8, zero=3),
    Layout(gpus=8, tp=8),
    Layout(gpus=8, tp=8, sequence_parallel=True),
    Layout(gpus=8, tp=8, tp_output="gathered"),
    Layout(gpus=16, tp=4, zero=3),
    Layout(gpus=16, tp=8, zero=1, sequence_parallel=True),
    Layout(gpus=8, zero=1, engine="deepspeed"),
    Layout(gpus=8, zero=2, engine="deepspeed"),
    Layout(gpus=8, zero=3, engine="deepspeed"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    setup = TrainingSetup(batch_size=args.batch_size, seq_len=args.seq_len)
    start = time.perf_counter()
    model = resolve_model(args.model)
    step = build_graph(trace_step(model, setup))
    traced = time.perf_counter() - start
    rows = []
    for layout in LAYOUTS:
        start = time.perf_counter()
        prepared = prepare(layout, setup, model.config)
        distinct = prepared.ranks(step)
        peak = max(find_peak(timeline(prepared.rank_step(step, rank))).bytes for rank in distinct)
        seconds = time.perf_counter() - start
        rows.append((layout.describe(), len(distinct), f"{peak / 1024**3:.2f}", f"{seconds:.2f}"))
    print(tabulate(rows, headers=["layout", "ranks", "peak GiB", "seconds"]))
    shape = f"batch {args.batch_size}, sequence {args.seq_len}, fp32 AdamW"
    size = f"{len(step.ops):,} ops, {len(step.storages):,} storages"
    print(f"\n{args.model}, {shape}: trace {traced:.1f} s ({size});")
    print(f"each row is one more layout on that trace, every distinct rank included; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
