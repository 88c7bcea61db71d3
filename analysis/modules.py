"""Where the memory live at one op was made: per module (cut to a depth), and the largest storages."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tabulate import tabulate

from analysis.liveness import lifetimes
from tracer.graph import StepGraph
from tracer.units import format_bytes

TOP_STORAGES = 10
BEFORE_THE_STEP = "(before the step)"


def module_table(step: StepGraph, index: int, depth: int) -> dict[str, Any]:
    """Bytes live at op ``index`` by the module that made them (path cut to ``depth`` parts; storages that
    existed before the step by their role), and the ``TOP_STORAGES`` largest live storages."""
    by_module: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    live = []
    for span in lifetimes(step):
        if not span.first <= index <= span.last:
            continue
        row = step.storages[span.storage_id]
        where = _module_at_depth(row.module, depth) if row.producer is not None else BEFORE_THE_STEP
        by_module[where][span.role.value] += span.bytes
        live.append((span.bytes, row))
    total = sum(bytes_ for bytes_, _ in live) or 1
    modules = [
        {
            "module": module,
            "bytes": sum(roles.values()),
            "share": sum(roles.values()) / total,
            "by_category": dict(roles),
        }
        for module, roles in by_module.items()
    ]
    modules.sort(key=lambda entry: entry["bytes"], reverse=True)
    largest = [
        {
            "bytes": bytes_,
            "category": row.role.value,
            "shape": list(row.shape),
            "dtype": row.dtype,
            "made_by": step.ops[row.producer].target if row.producer is not None else BEFORE_THE_STEP,
            "module": row.module or (row.name if row.producer is None else "(top level)"),
        }
        for bytes_, row in sorted(live, key=lambda item: item[0], reverse=True)[:TOP_STORAGES]
    ]
    return {"depth": depth, "op_index": index, "modules": modules, "largest_storages": largest}


def _module_at_depth(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth]) or "(top level)"


def render_module_table(table: dict[str, Any]) -> str:
    rows = [
        (
            entry["module"],
            format_bytes(entry["bytes"]),
            f"{100 * entry['share']:.1f}%",
            ", ".join(f"{role} {format_bytes(value)}" for role, value in entry["by_category"].items()),
        )
        for entry in table["modules"]
    ]
    storages = [
        (format_bytes(s["bytes"]), s["category"], "x".join(map(str, s["shape"])), s["dtype"], s["made_by"], s["module"])
        for s in table["largest_storages"]
    ]
    return "\n".join(
        [
            f"At the peak, by module (depth {table['depth']}):",
            tabulate(rows, headers=["module", "memory", "share", "categories"], colalign=("left", "right", "right")),
            "",
            f"The {len(storages)} largest storages live at the peak:",
            tabulate(
                storages, headers=["memory", "category", "shape", "dtype", "made by", "module"], colalign=("right",)
            ),
        ]
    )
