"""The estimate: resolve the model, trace one step without memory, and read the peak off the trace."""

from __future__ import annotations

from analysis.peak import find_peak, timeline
from analysis.report import MemoryReport, build_report
from tracer.graph import build_graph
from tracer.resolve import ResolvedModel, resolve_model
from tracer.tracing import Progress, trace_step
from tracer.training import TrainingSetup


def analyze(model: str | ResolvedModel, setup: TrainingSetup, progress: Progress | None = None) -> MemoryReport:
    """Predicted peak allocated GPU memory of one steady-state training step."""
    model = resolve_model(model) if isinstance(model, str) else model
    trace = trace_step(model, setup, progress)
    step_graph = build_graph(trace)
    line = timeline(step_graph)
    return build_report(model.model_id, setup, trace, step_graph, line, find_peak(line))
