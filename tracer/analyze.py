"""The estimate: resolve the model, trace one step without memory, transform it for each rank of the
layout, and read each rank's peak off its step."""

from __future__ import annotations

from analysis.allocator import AllocatorConfig
from analysis.gpus import find_gpu
from analysis.peak import find_peak, timeline
from analysis.replay import replay_step
from analysis.report import MemoryReport, build_report
from strategies.apply import apply, check_layout, ranks, runtime_assumptions, traced_setup
from strategies.layout import Layout
from tracer.graph import build_graph
from tracer.resolve import ResolvedModel, resolve_model
from tracer.tracing import Progress, trace_step
from tracer.training import Target, TrainingSetup

SINGLE_GPU = Layout()


def analyze(
    model: str | ResolvedModel,
    setup: TrainingSetup,
    layout: Layout = SINGLE_GPU,
    progress: Progress | None = None,
) -> MemoryReport:
    """Predicted peak allocated GPU memory of one steady-state training step, on the most loaded GPU.

    On CUDA the allocations are replayed through the caching allocator model: its allocated bytes (whole
    blocks) are the peak, and its reserved bytes plus the CUDA context what ``nvidia-smi`` shows."""
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
        replay = None
        if setup.target is Target.CUDA:
            replay = replay_step(rank_step, AllocatorConfig(expandable_segments=setup.expandable_segments))
            line = line.with_allocator_slack(replay.allocated_at)
        report = build_report(model.model_id, setup, trace, rank_step, line, find_peak(line), layout, rank)
        if replay is not None:
            report.set_device_memory(replay.peak_reserved, find_gpu(setup.gpu).context_bytes)
        reports.append(report)
    worst = max(reports, key=lambda report: report.peak_bytes)
    if not layout.plain:
        worst.ranks = reports
    return worst
