"""The result of an estimate or a measurement: the peak, where it happens, what it is made of."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tabulate import tabulate

from analysis.liveness import lifetimes
from analysis.peak import Peak, Timeline, host_peak
from strategies.layout import Layout, Rank
from tracer.graph import DEVICE_TO_HOST, HOST_TO_DEVICE, StepGraph, Transfer
from tracer.roles import Phase, Role
from tracer.trace import Trace
from tracer.training import Target, TrainingSetup
from tracer.units import format_bytes, format_count

TOP_GROUPS = 8
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")
PHASE_NUMBER = {phase: number for number, phase in enumerate(Phase)}


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
    layout: Layout = field(default_factory=Layout)
    rank: Rank = field(default_factory=Rank)
    ranks: list[MemoryReport] = field(default_factory=list)  # every distinct rank, for parallel layouts
    host_peak_bytes: int = 0  # host memory the offloaded storages need
    transfers: list[Transfer] = field(default_factory=list)  # host <-> device copies per step (offloading)
    reserved_bytes: int | None = None  # max_memory_reserved (CUDA only)
    device_total_bytes: int | None = None  # reserved plus the CUDA context: what nvidia-smi shows
    # Times per step the caching allocator found the GPU full, released its cached segments and retried
    # (memory_stats' num_alloc_retries): the step runs, each time waiting for the release.
    allocator_retries: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def set_device_memory(self, reserved_bytes: int, context_bytes: int) -> None:
        self.reserved_bytes = reserved_bytes
        self.device_total_bytes = reserved_bytes + context_bytes

    def pcie(self) -> dict[str, Any]:
        """Bytes per step each way over the host link and the time they take at ``setup.pcie_gbps``."""
        per_direction = {
            direction: sum(t.nbytes for t in self.transfers if t.direction == direction)
            for direction in (HOST_TO_DEVICE, DEVICE_TO_HOST)
        }
        rate = self.setup.pcie_gbps * 1e9
        return {
            "link_gb_per_s": self.setup.pcie_gbps,
            "host_to_device_bytes": per_direction[HOST_TO_DEVICE],
            "device_to_host_bytes": per_direction[DEVICE_TO_HOST],
            "host_to_device_seconds": per_direction[HOST_TO_DEVICE] / rate,
            "device_to_host_seconds": per_direction[DEVICE_TO_HOST] / rate,
            "transfers": [
                {
                    "phase": t.phase.value,
                    "direction": t.direction,
                    "bytes": t.nbytes,
                    "seconds": t.nbytes / rate,
                    "what": t.what,
                    "overlaps_with": t.overlaps or None,
                }
                for t in self.transfers
            ],
        }

    def to_json(self) -> dict[str, Any]:
        data = self._rank_json() | {"setup": {**self.setup.to_json(), **self.assumptions}, **self.extra}
        if not self.layout.plain:
            data["layout"] = self.layout.to_json()
            data["ranks"] = [report._rank_json() for report in self.ranks]
        return data

    def _rank_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.model_id,
            "rank": {
                "global": self.rank.global_rank(self.layout),
                "dp": self.rank.dp,
                "tp": self.rank.tp,
                "pp_stage": self.rank.pp,
                "pp_stages": self.layout.rank_stages(self.rank),
            },
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "allocator_retries": self.allocator_retries,
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
        } | (
            {"host_peak_bytes": self.host_peak_bytes, "pcie": self.pcie()}
            if self.layout.offload
            else {"host_peak_bytes": self.host_peak_bytes}
            if self.setup.mode == "inference" and self.host_peak_bytes
            else {}
        )


def build_report(
    model_id: str,
    setup: TrainingSetup,
    trace: Trace,
    step: StepGraph,
    line: Timeline,
    peak: Peak,
    layout: Layout | None = None,
    rank: Rank | None = None,
    kind: str = "estimate",
) -> MemoryReport:
    op = step.ops[peak.index]
    phases = np.fromiter((PHASE_NUMBER[o.phase] for o in step.ops), dtype=np.int64, count=len(step.ops))
    phase_peaks = {}
    for phase in Phase:
        totals = line.totals[phases == PHASE_NUMBER[phase]]
        if totals.size:
            phase_peaks[phase.value] = int(totals.max())
    return MemoryReport(
        model_id=model_id,
        setup=setup,
        assumptions=trace.assumptions,
        peak_bytes=peak.bytes,
        peak_op=op.target,
        peak_module=op.module,
        peak_phase=op.phase.value,
        peak_op_index=peak.index,
        op_count=len(step.ops),
        breakdown={role.value: peak.breakdown.get(role, 0) for role in Role},
        phase_peaks=phase_peaks,
        largest_at_peak=live_groups(step, peak.index)[:TOP_GROUPS],
        parameter_count=trace.parameter_count,
        trainable_parameter_count=trace.trainable_parameter_count,
        kind=kind,
        layout=layout or Layout(),
        rank=rank or Rank(),
        host_peak_bytes=host_peak(step),
        transfers=list(step.transfers),
    )


def live_groups(step: StepGraph, index: int) -> list[dict[str, Any]]:
    """Storages live at op ``index``, grouped by what made them, largest group first.

    Storages made during the step group by role, producing op and module (layer numbers folded into
    ``*``); those that existed before it group by role and the kind of tensor (``weight``, ``exp_avg``...).
    """
    groups: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for span in lifetimes(step):
        if not span.first <= index <= span.last:
            continue
        row = step.storages[span.storage_id]
        if row.producer is None:
            key = (span.role.value, "(before the step)", row.name.rpartition(".")[2])
        else:  # storages a strategy inserts carry the name of what they are
            made_by = _LAYER_INDEX.sub(".*", row.name) if row.name else step.ops[row.producer].target
            key = (span.role.value, made_by, _LAYER_INDEX.sub(".*", row.module))
        groups[key][0] += span.bytes
        groups[key][1] += 1
    rows = [
        {"bytes": total, "count": count, "role": role, "made_by": made_by, "where": where}
        for (role, made_by, where), (total, count) in groups.items()
    ]
    return sorted(rows, key=lambda row: row["bytes"], reverse=True)


def _offload_lines(report: MemoryReport) -> list[str]:
    pcie = report.pcie()
    rate = pcie["link_gb_per_s"]
    grouped: dict[tuple[str, str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for transfer in report.transfers:  # one row per kind of copy, layers folded
        key = (transfer.phase.value, transfer.direction, _LAYER_INDEX.sub(".*", transfer.what), transfer.overlaps)
        grouped[key][0] += transfer.nbytes
        grouped[key][1] += 1
    rows = [
        (phase, direction, count, format_bytes(nbytes), f"{nbytes / (rate * 1e9):.3f} s", what, overlaps or "no")
        for (phase, direction, what, overlaps), (nbytes, count) in grouped.items()
    ]
    return [
        f"Host memory for the offloaded storages: {format_bytes(report.host_peak_bytes)} (pinned)",
        f"Host link per step at {rate:g} GB/s each way: {format_bytes(pcie['host_to_device_bytes'])} to the GPU "
        f"({pcie['host_to_device_seconds']:.3f} s), {format_bytes(pcie['device_to_host_bytes'])} to the host "
        f"({pcie['device_to_host_seconds']:.3f} s)",
        tabulate(rows, headers=["phase", "direction", "copies", "bytes", "time", "what", "overlaps with"]),
    ]


def _device_lines(report: MemoryReport) -> list[str]:
    if report.reserved_bytes is None:
        return []
    lines = [
        f"{'Estimated' if report.kind == 'estimate' else 'Measured'} peak reserved memory: "
        f"{format_bytes(report.reserved_bytes)} ({report.reserved_bytes:,} bytes; the caching allocator's segments)"
    ]
    if report.device_total_bytes is not None:
        context = report.device_total_bytes - report.reserved_bytes
        lines.append(
            f"Device memory in use (as nvidia-smi shows it): {format_bytes(report.device_total_bytes)}, with "
            f"{format_bytes(context)} of CUDA context"
        )
    if report.allocator_retries:
        times = "once" if report.allocator_retries == 1 else f"{report.allocator_retries} times"
        lines.append(
            f"The caching allocator fills the GPU {times} per step and releases its cached segments to go on "
            "(cudaMalloc retries: memory_stats' num_alloc_retries): the step runs, slower for each release; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (--expandable-segments) fragments less"
        )
    return lines


def _ranks_table(report: MemoryReport) -> str:
    categories = [role for role in Role if any(r.breakdown.get(role.value, 0) for r in report.ranks)]
    rows = [
        (
            r.rank.global_rank(report.layout),
            ",".join(map(str, report.layout.rank_stages(r.rank))),
            r.rank.dp,
            r.rank.tp,
            format_bytes(r.peak_bytes),
            r.peak_phase,
            *(format_bytes(r.breakdown.get(role.value, 0)) for role in categories),
        )
        for r in report.ranks
    ]
    headers = ["rank", "pp stage", "dp", "tp", "peak", "phase", *(role.value for role in categories)]
    return tabulate(rows, headers=headers, colalign=("right", "right", "right", "right"))


def render_text(report: MemoryReport, verdict: str | None = None) -> str:
    """The report as text; ``verdict`` (whether it fits the GPU, analysis/budget.py) follows the peak."""
    where = report.peak_module or "(model top level)"
    title = "Estimated" if report.kind == "estimate" else "Measured"
    layout = report.layout
    device = "the CPU" if report.setup.target is Target.CPU else "one GPU"
    scope = f"on {device}" if layout.plain else f"per GPU, {layout.describe()}"
    setup = report.setup
    if setup.mode == "inference":
        what = f"inference (prefill of {setup.seq_len:,} tokens, decode up to {setup.max_new_tokens:,} more)"
        counts = f"{format_count(report.parameter_count)} parameters"
    else:
        what = "one fine-tuning step"
        counts = (
            f"{format_count(report.parameter_count)} parameters, "
            f"{format_count(report.trainable_parameter_count)} trainable"
        )
    lines = [f"{report.model_id}: {what} {scope} ({counts})", ""]
    if len(report.ranks) > 1:
        lines += ["Distinct ranks (breakdown at each one's peak):", _ranks_table(report), ""]
        lines += [f"The busiest rank is rank {report.rank.global_rank(layout)}:"]
    lines += [
        f"{title} peak allocated memory: {format_bytes(report.peak_bytes)} ({report.peak_bytes:,} bytes)",
        f"  at {report.peak_op} in {where}, {report.peak_phase} (op {report.peak_op_index + 1:,} of "
        f"{report.op_count:,})",
        "  per phase: " + ", ".join(f"{phase} {format_bytes(value)}" for phase, value in report.phase_peaks.items()),
        *_device_lines(report),
        *([verdict] if verdict else []),
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
        lines += ["", "What is live at the peak (largest groups):"]
        rows = [
            (format_bytes(row["bytes"]), row["count"], row["role"], row["made_by"], row["where"] or "(top level)")
            for row in report.largest_at_peak
        ]
        lines.append(tabulate(rows, headers=["memory", "tensors", "category", "made by", "where"], colalign=("right",)))
    if report.layout.offload:
        lines += ["", *_offload_lines(report)]
    elif report.setup.mode == "inference" and report.host_peak_bytes:  # an offloaded cache's layers
        lines += ["", f"Host memory for what generate() offloads: {format_bytes(report.host_peak_bytes)}"]
    lines += ["", "Assumptions:"]
    assumed = report.to_json()["setup"]
    if assumed.get("optimizer_impl", "") is None:  # torch's choice, which optimizer_implementation names
        del assumed["optimizer_impl"]
    lines.append(
        tabulate([(key, "none" if value is None else value) for key, value in assumed.items()], tablefmt="plain")
    )
    for key, value in report.extra.items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)
