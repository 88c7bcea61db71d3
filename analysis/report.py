"""The result of an estimate or a measurement: the peak, where it happens, what it is made of."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tabulate import tabulate

from analysis.peak import Peak, Timeline
from analysis.units import format_bytes
from tracer.roles import Phase, Role
from tracer.trace import Trace
from tracer.training import TrainingSetup

TOP_STORAGES = 8


@dataclass
class MemoryReport:
    model_id: str
    setup: TrainingSetup
    assumptions: dict[str, Any]
    peak_bytes: int
    peak_op: str
    peak_module: str
    peak_phase: str
    peak_op_index: int
    op_count: int
    breakdown: dict[str, int]
    phase_peaks: dict[str, int]
    largest_at_peak: list[dict[str, Any]] = field(default_factory=list)
    parameter_count: int = 0
    trainable_parameter_count: int = 0
    kind: str = "estimate"  # or "measurement"
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.model_id,
            "peak_bytes": self.peak_bytes,
            "peak_op": self.peak_op,
            "peak_module": self.peak_module,
            "peak_phase": self.peak_phase,
            "peak_op_index": self.peak_op_index,
            "op_count": self.op_count,
            "breakdown": self.breakdown,
            "phase_peaks": self.phase_peaks,
            "largest_at_peak": self.largest_at_peak,
            "parameter_count": self.parameter_count,
            "trainable_parameter_count": self.trainable_parameter_count,
            "setup": {**self.setup.to_json(), **self.assumptions},
            **self.extra,
        }


def build_report(
    model_id: str, setup: TrainingSetup, trace: Trace, line: Timeline, peak: Peak, kind: str = "estimate"
) -> MemoryReport:
    op = trace.ops[peak.index]
    phase_peaks = {}
    for phase in Phase:
        totals = [line.total(o.index) for o in trace.ops if o.phase is phase]
        if totals:
            phase_peaks[phase.value] = max(totals)
    return MemoryReport(
        model_id=model_id,
        setup=setup,
        assumptions=trace.assumptions,
        peak_bytes=peak.bytes,
        peak_op=op.target,
        peak_module=op.module,
        peak_phase=op.phase.value,
        peak_op_index=peak.index,
        op_count=len(trace.ops),
        breakdown={role.value: peak.breakdown.get(role, 0) for role in Role},
        phase_peaks=phase_peaks,
        largest_at_peak=_largest_at(trace, peak.index),
        parameter_count=trace.parameter_count,
        trainable_parameter_count=trace.trainable_parameter_count,
        kind=kind,
    )


def _largest_at(trace: Trace, index: int) -> list[dict[str, Any]]:
    from analysis.liveness import lifetimes

    live = [span for span in lifetimes(trace) if span.first <= index <= span.last]
    live.sort(key=lambda span: span.bytes, reverse=True)
    rows = []
    for span in live[:TOP_STORAGES]:
        storage = trace.storages[span.storage_id]
        made_by = trace.ops[storage.created_at] if storage.created_at is not None else None
        rows.append(
            {
                "bytes": span.bytes,
                "role": span.role.value,
                "shape": list(storage.shape),
                "dtype": storage.dtype,
                "name": storage.name,
                "op": made_by.target if made_by else "",
                "module": made_by.module if made_by else "",
            }
        )
    return rows


def render_text(report: MemoryReport) -> str:
    where = report.peak_module or "(model top level)"
    title = "Estimated" if report.kind == "estimate" else "Measured"
    lines = [
        f"{report.model_id}: one fine-tuning step on one GPU ({report.parameter_count / 1e9:.2f}B parameters,"
        f" {report.trainable_parameter_count / 1e9:.2f}B trainable)",
        "",
        f"{title} peak allocated memory: {format_bytes(report.peak_bytes)} ({report.peak_bytes:,} bytes)",
        f"  at {report.peak_op} in {where}, {report.peak_phase} (op {report.peak_op_index + 1:,} of "
        f"{report.op_count:,})",
        "  per phase: " + ", ".join(f"{phase} {format_bytes(value)}" for phase, value in report.phase_peaks.items()),
        "",
        "Breakdown at the peak:",
    ]
    rows = [
        (role, format_bytes(value), f"{100 * value / report.peak_bytes:.1f}%")
        for role, value in report.breakdown.items()
        if value
    ]
    lines.append(tabulate(rows, headers=["category", "memory", "share"], colalign=("left", "right", "right")))
    if report.largest_at_peak:
        lines += ["", "Largest allocations live at the peak:"]
        rows = [
            (
                format_bytes(row["bytes"]),
                row["role"],
                f"{row['dtype']}{row['shape']}",
                row["name"] or f"{row['op']} in {row['module'] or '(top level)'}",
            )
            for row in report.largest_at_peak
        ]
        lines.append(tabulate(rows, headers=["memory", "category", "tensor", "made by"]))
    lines += ["", "Assumptions:"]
    setup = report.to_json()["setup"]
    lines.append(tabulate([(key, value) for key, value in setup.items()], tablefmt="plain"))
    for key, value in report.extra.items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)
