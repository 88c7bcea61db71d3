"""The estimated step as files to look at: per-op rows (CSV, JSON), a plot (PNG) and a snapshot in the format
of ``torch.cuda.memory._snapshot`` for PyTorch's memory viewer (pickle). The interactive page is
analysis/report_page.py."""

from __future__ import annotations

import csv
import json
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

from analysis.allocator import AllocatorConfig, block_size
from analysis.liveness import holds_memory
from analysis.peak import Timeline
from analysis.replay import replay_step
from tracer.graph import StepGraph
from tracer.roles import Role
from tracer.training import TrainingSetup
from tracer.units import GIB

FORMATS = (".png", ".html", ".csv", ".json", ".pickle")

# One colour per category in every plot and page, so that a category looks the same from one run to the next
# (Tableau 10, then greys for what is rarely large).
ROLE_COLOURS = {
    Role.PARAMETER: "#4e79a7",
    Role.BUFFER: "#bab0ac",
    Role.GRADIENT: "#f28e2b",
    Role.OPTIMIZER_STATE: "#e15759",
    Role.INPUT: "#9c755f",
    Role.ACTIVATION: "#76b7b2",
    Role.TEMPORARY: "#edc948",
    Role.WORKSPACE: "#b07aa1",
    Role.COMMUNICATION: "#ff9da7",
    Role.KV_CACHE: "#59a14f",
    Role.ALLOCATOR_SLACK: "#d3d3d3",
}
# About half the plot area's width in pixels (12 inches at 120 dpi): each column is 2 pixels wide, so a spike shows.
PNG_COLUMNS = 600


def timeline_rows(step: StepGraph, line: Timeline) -> list[dict[str, Any]]:
    """One row per op: what it allocated and what was freed after it (bytes as the allocator rounds them),
    and the live bytes per category once it has produced its outputs."""
    allocated: dict[int, int] = defaultdict(int)
    freed: dict[int, int] = defaultdict(int)
    for row in step.storages.values():
        size = block_size(row.nbytes)
        if not row.on_device or size == 0 or not holds_memory(row):
            continue
        if row.producer is not None:
            allocated[row.producer] += size
        if row.freed_after is not None:
            freed[row.freed_after] += size
    rows = []
    for op in step.ops:
        live = line.breakdown(op.index)
        rows.append(
            {
                "index": op.index,
                "phase": op.phase.value,
                "op": op.target,
                "module": op.module,
                "allocated": allocated[op.index],
                "freed": freed[op.index],
                "live": sum(live.values()),
                **{role.value: live[role] for role in Role},
            }
        )
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def write_json(rows: list[dict[str, Any]], path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps({"summary": summary, "ops": rows}))


def setup_summary(setup: TrainingSetup) -> str:
    """The setup in a few words, for a title: "batch 4 x 1024 tokens, fp32 + bf16 autocast, adamw, full
    checkpointing"."""
    if setup.mode == "inference":
        precision = setup.quantize or setup.dtype
        return f"inference, batch {setup.batch_size} x {setup.seq_len} tokens + {setup.max_new_tokens} new, {precision}"
    precision = f"{setup.dtype} + {setup.mixed_precision} autocast" if setup.mixed_precision else setup.dtype
    parts = [f"batch {setup.batch_size} x {setup.seq_len} tokens", precision, setup.optimizer]
    if setup.grad_checkpointing:
        parts.append(f"{setup.grad_checkpointing} checkpointing")
    if setup.lora:
        parts.append(f"{'QLoRA' if setup.quantize == 'nf4' else 'LoRA'} r{setup.lora.r}")
    if setup.grad_accum > 1:
        parts.append(f"accumulation {setup.grad_accum}")
    return ", ".join(parts)


def phase_spans(rows: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    spans: list[tuple[str, int, int]] = []
    for row in rows:
        if spans and spans[-1][0] == row["phase"]:
            spans[-1] = (row["phase"], spans[-1][1], row["index"])
        else:
            spans.append((row["phase"], row["index"], row["index"]))
    return spans


def column_maxima(rows: list[dict[str, Any]], columns: int) -> list[dict[str, Any]]:
    """At most ``columns`` rows: of each run of consecutive ops one column wide, the op with the most live
    memory, so that a one-op spike (the optimizer's temporaries, a logits copy) is drawn, not sampled away."""
    if len(rows) <= columns:
        return rows
    width = len(rows) / columns
    return [
        max(rows[int(column * width) : int((column + 1) * width)], key=lambda row: row["live"])
        for column in range(columns)
    ]


def write_png(rows: list[dict[str, Any]], path: Path, title: str, capacity: int | None = None) -> None:
    """Stacked live bytes by category over the op index (each pixel column the largest of its ops), phases
    shaded, the peak marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [role for role in Role if any(row[role.value] for row in rows)]
    roles = [role.value for role in present]
    drawn = column_maxima(rows, PNG_COLUMNS)
    x = [row["index"] for row in drawn]
    figure, axes = plt.subplots(figsize=(12, 5.5), dpi=120)
    axes.stackplot(
        x,
        *[[row[role] / GIB for row in drawn] for role in roles],
        labels=roles,
        colors=[ROLE_COLOURS[role] for role in present],
        alpha=0.85,
        step="post",
    )
    shades = ("#f2f2f2", "#ffffff")
    for number, (phase, first, last) in enumerate(phase_spans(rows)):
        axes.axvspan(first, last + 1, color=shades[number % 2], zorder=-1)
        axes.text((first + last) / 2, 1.0, phase, transform=axes.get_xaxis_transform(), ha="center", va="bottom")
    peak = max(rows, key=lambda row: row["live"])
    axes.scatter([peak["index"]], [peak["live"] / GIB], color="black", zorder=5)
    axes.annotate(
        f"peak {peak['live'] / GIB:.2f} GiB\n{peak['op']}\n{peak['module'] or '(top level)'}",
        (peak["index"], peak["live"] / GIB),
        xytext=(10, -40),
        textcoords="offset points",
        fontsize=8,
        arrowprops={"arrowstyle": "->"},
    )
    if capacity:
        axes.axhline(capacity / GIB, color="red", linestyle="--", linewidth=1, label="GPU memory")
    axes.set_xlabel("op index")
    axes.set_ylabel("live memory (GiB)")
    axes.set_xlim(0, len(rows))
    axes.set_title(title, pad=18)
    axes.legend(loc="upper left", fontsize=8, ncol=2)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def memory_snapshot(step: StepGraph, config: AllocatorConfig) -> dict[str, Any]:
    """The measured step as ``torch.cuda.memory._snapshot()`` would record it: ``device_traces`` with an
    ``alloc`` for every block live when the step starts and then every alloc and free of the step (addresses
    and block sizes from the allocator model; one frame per event naming the op and module), and
    ``segments`` as the allocator holds them at the end."""
    events: list[dict[str, Any]] = []

    def observe(index: int, storage_id: int, block, allocated: bool) -> None:
        row = step.storages[storage_id]
        if index >= 0:
            op = step.ops[index]
            frame = {"filename": op.module or "(top level)", "line": index, "name": op.target}
        else:
            frame = {"filename": row.name or row.role.value, "line": 0, "name": "(before the step)"}
        actions = ("alloc",) if allocated else ("free_requested", "free_completed")
        for action in actions:
            events.append(
                {
                    "action": action,
                    "addr": block.address,
                    "size": block.size,
                    "stream": 0,
                    "time_us": len(events),
                    "frames": [frame],
                }
            )

    replay = replay_step(step, config, observe)
    segments = []
    for segment in replay.segments:
        blocks = [
            {
                "address": block.address,
                "size": block.size,
                "requested_size": block.requested if block.allocated else 0,
                "state": "active_allocated" if block.allocated else "inactive",
                "frames": [],
            }
            for block in segment.blocks()
        ]
        total = sum(block["size"] for block in blocks)
        allocated = sum(block["size"] for block in blocks if block["state"] == "active_allocated")
        segments.append(
            {
                "device": 0,
                "address": segment.address,
                "total_size": total,
                "allocated_size": allocated,
                "active_size": allocated,
                "requested_size": sum(block["requested_size"] for block in blocks),
                "stream": segment.stream,
                "segment_type": "small" if segment.small else "large",
                "segment_pool_id": (0, 0),
                "is_expandable": segment.expandable,
                "frames": [],
                "blocks": blocks,
            }
        )
    return {"segments": segments, "device_traces": [events], "allocator_settings": {}}


def write_snapshot(step: StepGraph, path: Path, config: AllocatorConfig) -> None:
    with path.open("wb") as handle:
        pickle.dump(memory_snapshot(step, config), handle)
