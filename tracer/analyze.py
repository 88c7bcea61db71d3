"""The estimate: resolve the model, trace one step without memory, transform it for each rank of the
layout, and read each rank's peak off its step."""

from __future__ import annotations

from dataclasses import dataclass

from analysis.allocator import AllocatorConfig
from analysis.gpus import find_gpu
from analysis.peak import Timeline, find_peak, timeline
from analysis.replay import replay_step
from analysis.report import MemoryReport, build_report
from strategies.apply import apply, check_layout, ranks, runtime_assumptions, traced_setup
from strategies.layout import Layout
from tracer.graph import StepGraph, build_graph
from tracer.resolve import ResolvedModel, resolve_model
from tracer.tracing import Progress, trace_step
from tracer.training import Target, TrainingSetup

SINGLE_GPU = Layout()


@dataclass(frozen=True)
class RankEstimate:
    report: MemoryReport
    step: StepGraph  # the rank's step, after the layout's transforms
    line: Timeline  # live bytes per category at every op, as the allocator counts them on CUDA


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
) -> RankEstimate:
    """:func:`analyze`, keeping the busiest rank's step and timeline (for timelines and per-module tables)."""
    model = resolve_model(model) if isinstance(model, str) else model
    check_layout(layout, setup, model.config)
    traced, recipe = traced_setup(setup, layout)
    trace = trace_step(model, traced, progress)
    if recipe:
        trace.assumptions["mixed_precision_recipe"] = recipe
    trace.assumptions.update(runtime_assumptions(layout))
    step = build_graph(trace)
    estimates = []
    for rank in ranks(layout, step):
        rank_step = apply(step, layout, setup, rank)
        line = timeline(rank_step)
        replay = None
        if setup.target is Target.CUDA:
            replay = replay_step(rank_step, allocator_config(setup))
            line = line.with_allocator_slack(replay.allocated_at)
        report = build_report(model.model_id, setup, trace, rank_step, line, find_peak(line), layout, rank)
        if replay is not None:
            report.set_device_memory(replay.peak_reserved, find_gpu(setup.gpu).context_bytes)
        estimates.append(RankEstimate(report, rank_step, line))
    busiest = max(estimates, key=lambda estimate: estimate.report.peak_bytes)
    if not layout.plain:
        busiest.report.ranks = [estimate.report for estimate in estimates]
    return busiest


def allocator_config(setup: TrainingSetup) -> AllocatorConfig:
    return AllocatorConfig(expandable_segments=setup.expandable_segments)
