"""Whether each layout's peak grows by the same bytes with every decoder layer: the question behind composing a
layout from per-layer slices instead of transforming and replaying the whole step (issue 18's planner speed).

    python -m benchmarks.depth_linearity [--model meta-llama/Llama-3.1-70B] [--depths 6,8,10,80] [--seq-len 8192]
        [--grad-checkpointing full]

The model is traced with each number of layers (its config cut to its first layers by ``tracer.layers.cut_to``,
then traced and stamped as any run is); every layout's ranks are built, their allocated peak read and the caching
allocator replayed. The line through the first two depths predicts the others; the table gives each prediction's
error, in bytes.
"""

from __future__ import annotations

import argparse
import dataclasses

from tabulate import tabulate

from analysis.estimate import allocator_config
from analysis.peak import find_peak, timeline
from analysis.replay import replay_step
from benchmarks.layout_speed import LAYOUTS
from strategies.layout import prepare
from tracer.graph import build_graph
from tracer.layers import cut_to
from tracer.resolve import ResolvedModel, resolve_model
from tracer.tracing import trace_step
from tracer.training import TrainingSetup


def peaks_by_depth(
    model: ResolvedModel, depths: list[int], setup: TrainingSetup
) -> dict[str, dict[int, tuple[int, int]]]:
    """Layout -> depth -> (allocated peak, reserved peak) of its busiest rank."""
    peaks: dict[str, dict[int, tuple[int, int]]] = {}
    for depth in depths:
        cut = dataclasses.replace(model, config=cut_to(model.config, depth))
        step = build_graph(trace_step(cut, setup))
        for layout in LAYOUTS:
            prepared = prepare(layout, setup, cut.config)
            ranks = [prepared.rank_step(step, rank) for rank in prepared.ranks(step)]
            allocated = max(find_peak(timeline(rank)).bytes for rank in ranks)
            reserved = max(replay_step(rank, allocator_config(setup)).peak_reserved for rank in ranks)
            peaks.setdefault(layout.describe(), {})[depth] = (allocated, reserved)
    return peaks


def errors(by_depth: dict[int, int]) -> tuple[float, list[int]]:
    """The bytes per layer between the first two depths, and the line's error at each further depth."""
    (first, at_first), (second, at_second), *rest = sorted(by_depth.items())
    slope = (at_second - at_first) / (second - first)
    return slope, [round(at_first + slope * (depth - first)) - peak for depth, peak in rest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-3.1-70B")
    parser.add_argument("--depths", default="6,8,10,80", help="decoder layers, at least three, comma-separated")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--grad-checkpointing", choices=("none", "full"), default="full")
    args = parser.parse_args()
    depths = sorted({int(depth) for depth in args.depths.split(",")})
    if len(depths) < 3:
        parser.error("--depths needs at least three different depths: two for the line, one to check it")
    model = resolve_model(args.model)
    if depths[-1] > model.config.num_hidden_layers:
        parser.error(f"--depths goes up to the model's {model.config.num_hidden_layers} layers")
    setup = TrainingSetup(
        seq_len=args.seq_len,
        mixed_precision="bf16",
        grad_checkpointing=None if args.grad_checkpointing == "none" else args.grad_checkpointing,
    )
    rows = []
    for layout, by_depth in peaks_by_depth(model, depths, setup).items():
        allocated_slope, allocated_errors = errors({depth: peaks[0] for depth, peaks in by_depth.items()})
        _, reserved_errors = errors({depth: peaks[1] for depth, peaks in by_depth.items()})
        rows.append((layout, f"{allocated_slope:,.0f}", *(f"{e:,}" for e in allocated_errors + reserved_errors)))
    checked = [f"at {depth}" for depth in depths[2:]]
    headers = ["layout", "allocated bytes per layer", *(f"allocated {c}" for c in checked)]
    headers += [f"reserved {c}" for c in checked]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    print(
        f"\n{args.model}, batch 1, sequence {args.seq_len}, bf16 mixed precision, AdamW, checkpointing "
        f"{args.grad_checkpointing}: each error is the line through {depths[0]} and {depths[1]} layers less the peak."
    )


if __name__ == "__main__":
    main()
