"""The estimate: resolve the model, trace one step without memory, transform it for each rank of the
layout, and read each rank's peak off its step."""

from __future__ import annotations

from analysis.peak import find_peak, timeline
from analysis.report import MemoryReport, build_report
from strategies.apply import apply, check_layout, ranks, runtime_assumptions, traced_setup
from strategies.layout import Layout
from tracer.graph import build_graph
from tracer.resolve import ResolvedModel, resolve_model
from tracer.tracing import Progress, trace_step
from tracer.training import TrainingSetup

SINGLE_GPU = Layout()


def analyze(
    model: str | ResolvedModel,
    setup: TrainingSetup,
    layout: Layout = SINGLE_GPU,
    progress: Progress | None = None,
) -> MemoryReport:
    """Predicted peak allocated GPU memory of one steady-state training step, on the most loaded GPU."""
    model = resolve_model(model) if isinstance(model, str) else model
    check_layout(layout, setup, model.config)
    traced, recipe = traced_setup(setup, layout)
    trace = trace_step(model, traced, progress)
    if recipe:
        trace.assumptions["mixed_precision_recipe"] = recipe
    trace.assumptions.update(runtime_assumptions(layout))
    step = build_graph(trace)
    reports = []
    for rank in ranks(layout, step):
        rank_step = apply(step, layout, setup, rank)
        line = timeline(rank_step)
        reports.append(build_report(model.model_id, setup, trace, rank_step, line, find_peak(line), layout, rank))
    worst = max(reports, key=lambda report: report.peak_bytes)
    if not layout.plain:
        worst.ranks = reports
    return worst
