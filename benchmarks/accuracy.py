"""Ground truth from real GPUs against our estimate and the analytic formulas people use.

    python -m benchmarks.accuracy [--data DIR] [--markdown]

Reads every case JSON that ``python -m benchmarks.ground_truth.collect`` wrote (benchmarks/ground_truth/data/
by default) and prints, per case: measured ``max_memory_allocated`` and ``max_memory_reserved``, our estimate
of both (``analyze`` with the same setup, for the GPU it ran on), and the formulas of analysis/formulas.py on
the same setup (the 16 bytes/parameter rule, DeepSpeed's model-state estimator, accelerate's estimate-memory,
LLMem); then the median and largest |error| of each against max_memory_allocated (ours reserved against
max_memory_reserved). Cases measured under an allocator capacity (a GPU made full) are estimated under the same
limit and listed again: whether the step fitted, how often the allocator released its cache and retried in the
measured step, and the reserved peak, measured and ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from unittest.mock import patch

import transformers
from tabulate import tabulate

from analysis.estimate import analyze
from analysis.formulas import formula_estimates, model_shape
from analysis.report import MemoryReport
from benchmarks.ground_truth.cases import Case
from benchmarks.ground_truth.collect import DATA
from benchmarks.ground_truth.run_case import PEAKS, PLAIN_AFTER_RECORDED, setup_of
from strategies.layout import Layout, Rank
from tracer.gpus import gpu_for_device_name
from tracer.resolve import resolve_model
from tracer.training import Target
from tracer.units import GIB

PEERS = ("16 B/param", "DeepSpeed", "accelerate", "LLMem")  # analysis/formulas.py's names


def load_results(data: Path) -> list[dict]:
    results = []
    for path in sorted(data.rglob("*.json")):
        result = json.loads(path.read_text())
        if result.get("target") == "cuda" and (result.get("max_memory_allocated") or "out_of_memory" in result):
            results.append(result)
    return results


def compare(result: dict) -> dict:
    case = Case(**result["case"])
    gpu = gpu_for_device_name(result["environment"]["device"])
    setup = setup_of(case, Target.CUDA)
    if gpu is not None:
        setup = dataclasses.replace(setup, gpu=gpu.name)
    if _recorded_peaks(result):
        setup = dataclasses.replace(setup, dispatch_mode=True)
    model = resolve_model(case.model)
    layout = Layout(**case.layout)
    # CUDA's kernel choices as the torch that ran the case makes them (cuDNN attention came first in 2.11)
    measured_torch = _minor_version(result["environment"]["torch"])
    limit = result.get("allocator_limit_bytes")
    with patch("tracer.cuda.kernels.installed_torch_version", lambda: measured_torch):
        report = _rank0(analyze(model, setup, layout, capacity=limit))
        reserved = report.reserved_bytes
        if result.get("peaks") == PLAIN_AFTER_RECORDED:  # a cache keeps its segments: the larger of the two steps'
            recorded = analyze(model, dataclasses.replace(setup, dispatch_mode=True), layout, capacity=limit)
            reserved = max(reserved, _rank0(recorded).reserved_bytes)
    row = {
        "case": case.name,
        "device": result["environment"]["device"],
        "measured": result.get("max_memory_allocated"),
        "measured_reserved": result.get("max_memory_reserved"),
        "ours": report.peak_bytes,
        "ours_reserved": reserved,
    }
    if limit is not None:
        # the estimate's replay goes on without the limit where even a release does not make room
        row |= {
            "limit": limit,
            "measured_retries": result.get("allocator_retries"),
            "ours_fits": report.reserved_bytes <= limit,
            "ours_retries": report.allocator_retries,
        }
    for formula in formula_estimates(model_shape(model, setup), setup, layout):
        if formula.name in PEERS:
            row[formula.name] = formula.total
    return row


def _rank0(report: MemoryReport) -> MemoryReport:
    """The rank the harness measures."""
    return next((rank for rank in report.ranks if rank.rank == Rank()), report)


def _recorded_peaks(result: dict) -> bool:
    """Whether the result's peaks are a recorded step's (run_case.PEAKS), whose dispatch mode summed gradients out of
    place: the estimate of that step is the one to compare. A step that ran out of memory is compared with the user's
    step: the harness ran a plain warm-up step before the recorded one. Of those steps only Qwen2.5-0.5B's under
    11 GiB on the H200 differs between the two estimates, and it ran out in the recorded step at its loss (the third
    logits-sized float32 block, allocation 7,452 of the run as of the plain step's 1,651), before backward sums any
    gradient: so far the mode changes nothing, and the cache is the one the plain step left."""
    return (
        not result["case"]["layout"]
        and "max_memory_allocated" in result
        and result.get("peaks") not in (PEAKS, PLAIN_AFTER_RECORDED)
    )


def _minor_version(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _error(estimate: int | None, measured: int) -> float | None:
    return None if estimate is None else 100 * (estimate - measured) / measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA, help="folder of case JSONs (default %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print GitHub markdown tables")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    results = load_results(args.data)
    if not results:
        print(
            f"No GPU measurements under {args.data}. Collect them on a GPU machine with "
            "`python -m benchmarks.ground_truth.collect`.",
            file=sys.stderr,
        )
        return 1
    compared = [compare(result) for result in results]
    rows = [row for row in compared if row["measured"] is not None]
    estimators = {"ours": "measured", "ours_reserved": "measured_reserved", **{peer: "measured" for peer in PEERS}}
    errors: dict[str, list[float]] = {name: [] for name in estimators}
    table = []
    for row in rows:
        line = [row["case"], row["measured"], row["measured_reserved"]]
        for name, truth in estimators.items():
            error = _error(row[name], row[truth])
            if error is not None:
                errors[name].append(abs(error))
            line.append("n/a" if error is None else f"{row[name]:,} ({error:+.2f}%)")
        table.append(line)
    fmt = "github" if args.markdown else "simple"
    headers = ["case", "max_memory_allocated", "max_memory_reserved", "ours", "ours (reserved)", *PEERS]
    print(tabulate(table, headers=headers, tablefmt=fmt))
    summary = [
        (name, len(values), f"{statistics.median(values):.2f}%", f"{max(values):.2f}%")
        for name, values in errors.items()
        if values
    ]
    print()
    print(tabulate(summary, headers=["estimator", "cases", "median |error|", "max |error|"], tablefmt=fmt))
    capped = [row for row in compared if "limit" in row]
    if capped:
        print()
        print(tabulate([_capacity_line(row) for row in capped], headers=CAPACITY_HEADERS, tablefmt=fmt))
    devices = sorted({row["device"] for row in compared})
    out_of_memory = f", {len(compared) - len(rows)} of them out of memory" if len(rows) < len(compared) else ""
    print(f"\n{len(compared)} cases measured on {', '.join(devices)}{out_of_memory}")
    return 0


CAPACITY_HEADERS = ["case under a capacity", "limit (GiB)", "measured", "ours", "reserved: measured / ours (GiB)"]


def _capacity_line(row: dict) -> list:
    def outcome(fits: bool, retries: int | None) -> str:
        return f"fits, {retries} retries" if fits else "out of memory"

    measured_fits = row["measured"] is not None
    reserved = f"{row['measured_reserved'] / GIB:.3f} / {row['ours_reserved'] / GIB:.3f}" if measured_fits else ""
    return [
        row["case"],
        f"{row['limit'] / GIB:.2f}",
        outcome(measured_fits, row["measured_retries"]),
        outcome(row["ours_fits"], row["ours_retries"]),
        reserved,
    ]


if __name__ == "__main__":
    sys.exit(main())
