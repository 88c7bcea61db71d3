"""Peaks over a grid of batch sizes, sequence lengths and generation lengths, and which of them fit a GPU."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tabulate import tabulate

from analysis.budget import MemoryBudget, default_allocator_capacity
from analysis.device_map import estimate_device_map
from analysis.estimate import LayoutEstimate, StepSource
from analysis.report import MemoryReport
from strategies.layout import Layout, prepare
from tracer.errors import UserError
from tracer.gpus import Gpu
from tracer.resolve import Model
from tracer.training import TrainingSetup
from tracer.units import format_bytes

# --sweep axis name -> the TrainingSetup field it sets
AXES = {"batch": "batch_size", "seq-len": "seq_len", "max-new-tokens": "max_new_tokens"}
_ALIASES = {"batch-size": "batch"}


@dataclass(frozen=True)
class SweepPoint:
    values: dict[str, int]  # axis -> value
    report: MemoryReport


@dataclass(frozen=True)
class Sweep:
    axes: dict[str, tuple[int, ...]]
    points: list[SweepPoint]
    gpu: Gpu | None  # None: no GPU to fit (--target cpu)

    @cached_property
    def budget(self) -> MemoryBudget | None:
        """The planner's rule (analysis/budget.py): reserved memory plus the CUDA context against the GPU."""
        return MemoryBudget(self.gpu.memory_bytes) if self.gpu else None

    def fits(self, point: SweepPoint) -> bool:
        return self.budget is not None and self.budget.fits(point.report)

    def largest_fitting(self, axis: str) -> list[tuple[dict[str, int], int | None]]:
        """For every combination of the other axes, the largest swept value of ``axis`` that fits."""
        others = [name for name in self.axes if name != axis]
        best: dict[tuple[int, ...], int | None] = {}
        for point in self.points:
            key = tuple(point.values[name] for name in others)
            best.setdefault(key, None)
            if self.fits(point) and (best[key] is None or point.values[axis] > best[key]):
                best[key] = point.values[axis]
        return [(dict(zip(others, key, strict=True)), value) for key, value in best.items()]


def parse_sweep(items: Sequence[str], mode: str) -> dict[str, tuple[int, ...]]:
    """``["seq-len=512,2048", "batch=1,8"]`` -> ``{"seq-len": (512, 2048), "batch": (1, 8)}``."""
    usage = f"--sweep takes AXIS=V1,V2,... with AXIS one of {', '.join(AXES)}"
    axes: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, _, values = item.partition("=")
        name = _ALIASES.get(name.strip(), name.strip())
        if name not in AXES or not values:
            raise UserError(f"{usage} (got {item!r}).")
        if name in axes:
            raise UserError(f"--sweep names {name} twice; give all its values at once: {name}=V1,V2,...")
        if name == "max-new-tokens" and mode != "inference":
            raise UserError("--sweep max-new-tokens applies to --mode inference.")
        try:
            numbers = sorted({int(value) for value in values.split(",") if value.strip()})
        except ValueError:
            raise UserError(f"{usage}, the values whole numbers (got {item!r}).") from None
        if not numbers or numbers[0] < 1:
            raise UserError(f"--sweep {name} values must be at least 1 (got {values!r}).")
        axes[name] = tuple(numbers)
    return axes


def run_sweep(
    model: Model,
    setup: TrainingSetup,
    layout: Layout,
    axes: dict[str, tuple[int, ...]],
    gpu: Gpu | None,
    on_point: Callable[[int, int, dict[str, int]], None] = lambda done, total, values: None,
) -> Sweep:
    """One estimate per combination of the axes' values. Each step (a sequence length, and in inference a
    generation length) is traced at batch sizes 2 and 3 (and 1 when swept), and every other batch size is read off
    the line through them, as the planner reads it (analysis/batch_line.py), once the line has reproduced the
    step traced at the largest batch swept (else each is traced): where that takes fewer traces than one per batch
    size. A device map's points are traced each."""
    combinations = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    capacity = default_allocator_capacity(gpu)
    sources: dict[TrainingSetup, StepSource] = {}
    batches = set(axes.get("batch", (setup.batch_size,)))
    first = StepSource.LINE_FIRST
    line_traces = {first, first + 1, max(batches)} | {b for b in batches if b < first}
    lines = len(line_traces) < len(batches)  # fewer traces than a trace per batch size
    points = []
    for done, values in enumerate(combinations):
        on_point(done, len(combinations), values)
        point_setup = dataclasses.replace(setup, **{AXES[name]: value for name, value in values.items()})
        if point_setup.device_map is not None:
            report = estimate_device_map(model, point_setup).report
        else:
            prepared = prepare(layout, point_setup, model.config)
            key = dataclasses.replace(prepared.traced, batch_size=1)
            if key not in sources:
                sources[key] = StepSource(model, key, lines=lines)
                sources[key].keep_line_if_it_reaches(max(batches))
            source = sources[key]
            estimate = LayoutEstimate(model.model_id, prepared, source, capacity=capacity)
            report = estimate.evaluate(point_setup.batch_size).report
        points.append(SweepPoint(values, report))
    return Sweep(axes, points, gpu)


def render_sweep(sweep: Sweep, model_id: str) -> str:
    first = sweep.points[0].report
    inference = first.setup.mode == "inference"
    what = "inference" if inference else "one fine-tuning step"
    scope = "on one GPU" if first.layout.plain else f"per GPU, {first.layout.describe()}"
    headers = [*sweep.axes, "peak", "phase"] + (["kv_cache at peak"] if inference else [])
    rows = []
    for point in sweep.points:
        report = point.report
        row = [*point.values.values(), format_bytes(report.peak_bytes), report.peak_phase]
        if inference:
            row.append(format_bytes(report.breakdown.get("kv_cache", 0)))
        if sweep.budget:
            row += [format_bytes(sweep.budget.needed_bytes(report)), "yes" if sweep.fits(point) else "no"]
        rows.append(row)
    lines = [f"{model_id}: {what}, estimated peak allocated memory {scope}", ""]
    if sweep.gpu:
        headers += ["GPU memory", f"fits {sweep.gpu.name}"]
    lines.append(tabulate(rows, headers=headers, colalign=("right",) * len(sweep.axes)))
    if sweep.gpu:
        lines += ["", *_fit_lines(sweep)]
    return "\n".join(lines)


def _fit_lines(sweep: Sweep) -> list[str]:
    gpu = sweep.gpu
    lines = [f"Fits the {gpu.description}: {sweep.budget.describe()}"]
    for axis in sweep.axes:
        if len(sweep.axes[axis]) < 2:
            continue
        for others, value in sweep.largest_fitting(axis):
            where = ", ".join(f"{name} {number:,}" for name, number in others.items())
            if value is None:
                found = f"none of {', '.join(map(str, sweep.axes[axis]))}"
            else:
                found = f"{value:,}" + (
                    " (the largest tried: try larger values)" if value == max(sweep.axes[axis]) else ""
                )
            lines.append(f"  largest {axis} that fits{' at ' + where if where else ''}: {found}")
    return lines


def sweep_json(sweep: Sweep) -> dict[str, Any]:
    return {
        "axes": {name: list(values) for name, values in sweep.axes.items()},
        "gpu": sweep.gpu.name if sweep.gpu else None,
        "usable_bytes": sweep.budget.usable_bytes if sweep.budget else None,
        "points": [
            {**point.values, "fits": sweep.fits(point) if sweep.gpu else None, **point.report.to_json()}
            for point in sweep.points
        ],
    }
