"""The estimate: resolve the model, trace one step without memory, transform it for each rank of the
layout, and read each rank's peak off its step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from analysis.allocator import AllocatorConfig
from analysis.peak import Timeline, find_peak, timeline
from analysis.replay import replay_step
from analysis.report import MemoryReport, build_report
from strategies.apply import Rank, apply, check_layout, ranks, runtime_assumptions, traced_setup
from strategies.layout import Layout
from tracer.gpus import find_gpu
from tracer.graph import StepGraph, build_graph
from tracer.resolve import ResolvedModel, resolve_model
from tracer.trace import Trace
from tracer.tracing import Progress, trace_step
from tracer.training import Target, TrainingSetup

SINGLE_GPU = Layout()


@dataclass(frozen=True)
class StepResult:
    """A report with the step it was read from: an estimated rank's step after the layout's transforms, or
    a measured step (on CPU, every storage's real lifetime)."""

    report: MemoryReport
    step: StepGraph
    line: Timeline  # live bytes per category at every op (on CUDA estimates, as the allocator counts them)


def analyze(
    model: str | ResolvedModel,
    setup: TrainingSetup,
    layout: Layout = SINGLE_GPU,
    progress: Progress | None = None,
) -> MemoryReport:
    """Predicted peak allocated GPU memory of one steady-state training step, on the most loaded GPU.

    On CUDA the allocations are replayed through the caching allocator model: its allocated bytes (whole
    blocks) are the peak, and its reserved bytes plus the CUDA context what ``nvidia-smi`` shows."""
    return estimate(model, setup, layout, progress).report


def estimate(
    model: str | ResolvedModel,
    setup: TrainingSetup,
    layout: Layout = SINGLE_GPU,
    progress: Progress | None = None,
) -> StepResult:
    """:func:`analyze`, keeping the busiest rank's step and timeline (for timelines and per-module tables)."""
    model = resolve_model(model) if isinstance(model, str) else model
    check_layout(layout, setup, model.config)
    trace = trace_for_layout(model, setup, layout, progress)
    step = build_graph(trace)
    distinct = ranks(layout, step)
    estimates = []
    for done, rank in enumerate(distinct):
        if progress is not None:
            progress("each rank's step and peak", done, len(distinct))
        estimates.append(rank_estimate(model.model_id, setup, layout, trace, rank, apply(step, layout, setup, rank)))
    return busiest(estimates, layout)


def trace_for_layout(
    model: ResolvedModel, setup: TrainingSetup, layout: Layout, progress: Progress | None = None
) -> Trace:
    """The single-GPU step every rank of the layout is a transform of, with what the layout assumes."""
    traced, recipe = traced_setup(setup, layout)
    return with_layout_assumptions(trace_step(model, traced, progress), layout, recipe)


def with_layout_assumptions(trace: Trace, layout: Layout, recipe: str | None) -> Trace:
    recipe_note = {"mixed_precision_recipe": recipe} if recipe else {}
    return dataclasses.replace(trace, assumptions=trace.assumptions | recipe_note | runtime_assumptions(layout))


def rank_estimate(
    model_id: str, setup: TrainingSetup, layout: Layout, trace: Trace, rank: Rank, rank_step: StepGraph
) -> StepResult:
    """The report of one rank from its step: its timeline, and on CUDA the caching allocator's replay."""
    line = timeline(rank_step)
    replay = None
    if setup.target is Target.CUDA:
        replay = replay_step(rank_step, allocator_config(setup))
        line = line.with_allocator_slack(replay.allocated_at)
    report = build_report(model_id, setup, trace, rank_step, line, find_peak(line), layout, rank)
    if replay is not None:
        report.set_device_memory(replay.peak_reserved, find_gpu(setup.gpu).context_bytes)
    return StepResult(report, rank_step, line)


def busiest(estimates: list[StepResult], layout: Layout) -> StepResult:
    """The rank with the highest peak, carrying every rank's report when there are several."""
    top = max(estimates, key=lambda estimate: estimate.report.peak_bytes)
    if not layout.plain:
        top.report.ranks = [estimate.report for estimate in estimates]
    return top


def allocator_config(setup: TrainingSetup) -> AllocatorConfig:
    return AllocatorConfig(expandable_segments=setup.expandable_segments)
