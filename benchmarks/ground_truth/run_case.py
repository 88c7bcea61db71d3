"""Measure one ground-truth case in this (fresh) process and write its JSON.

    python -m benchmarks.ground_truth.run_case CASE_JSON OUT_JSON [--target cuda|cpu]

A fresh process per case, because the caching allocator keeps what earlier cases reserved. On CUDA the
allocator's own trace (``torch.cuda.memory._record_memory_history``) is on from the first allocation, so the
file holds the whole alloc/free sequence (model build, warm-up step, measured step) compactly. One rank of a
parallel layout runs with a fake process group: real tensors and real memory, collectives that move nothing.
On CPU the same code runs (to check the harness itself); only CUDA cases are measurements.

Several cases may share one GPU (``collect --jobs``): the allocator's counters are per process, but the device's
used memory is not, so ``--shared-device`` leaves ``device_used_bytes`` out. ``process_used_bytes`` (NVML's
memory of this process, where the driver reports it) and ``reserved_at_end`` give the CUDA context either way:
``process_used_bytes - reserved_at_end``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from analysis.measure import measure
from benchmarks.ground_truth.cases import Case
from tracer.resolve import resolve_model
from tracer.training import LoraSetup, Target, TrainingSetup

MAX_TRACE_ENTRIES = 2_000_000
# How the weights came to the device: since 2026-11-27 built on the meta device and materialized as from_pretrained and
# torchtitan do (tracer/materialize.py); earlier results, without the key, built every weight on the device first.
BUILD = "meta"
# Which step a single GPU's peaks are read off: one run without the recorder, as users run it, right after the
# warm-up (analysis/measure.py). Earlier results, without the key, read the recorded step's, whose dispatch mode
# makes autograd sum gradients out of place (tracer/gradient_sums.py); those of the H200's second run of
# 2026-11-27, "plain step" (PLAIN_AFTER_RECORDED), read a plain step run after the recorded one, whose reserved
# peak holds the segments the recorded step added. A parallel rank's step always ran plainly.
PEAKS = "plain step before the recorded one"
PLAIN_AFTER_RECORDED = "plain step"
# The allocator trace, one row per event: [action, address, bytes, stream]. Actions as PyTorch names them.
TRACE_ACTIONS = ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom")


def setup_of(case: Case, target: Target) -> TrainingSetup:
    options = dict(case.setup)
    lora_r = options.pop("lora_r", None)
    lora_targets = options.pop("lora_targets", None)
    return TrainingSetup(
        batch_size=case.batch_size,
        seq_len=case.seq_len,
        target=target,
        lora=LoraSetup(r=lora_r, targets=tuple(lora_targets) if lora_targets else None) if lora_r else None,
        **options,
    )


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info |= {
            "device": properties.name,
            "device_memory_bytes": properties.total_memory,
            "compute_capability": f"{properties.major}.{properties.minor}",
            "cuda": torch.version.cuda,
            "driver": _driver_version(),
        }
    else:
        info["device"] = "cpu"
    return info


def _driver_version() -> str | None:
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.run(query, capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def allocator_trace() -> list[list[int | str]]:
    snapshot = torch.cuda.memory._snapshot()
    events = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    # an "oom" event has the device's free bytes where the others have an address
    return [
        [e["action"], e.get("addr", e.get("device_free")), e["size"], e["stream"]]
        for e in events
        if e["action"] in TRACE_ACTIONS
    ]


def process_used_bytes() -> int | None:
    """The device memory NVML charges to this process: the CUDA context plus what the allocator reserved."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        used = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid()]
        return used[0] if used else None
    except Exception:  # no NVML, or a driver that does not report processes (containers): not measured
        return None


def run(case: Case, target: Target, shared_device: bool = False) -> dict[str, Any]:
    cuda = target is Target.CUDA
    if cuda:
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=MAX_TRACE_ENTRIES
        )
    setup = setup_of(case, target)
    result: dict[str, Any] = {
        "case": case.to_json(),
        "environment": environment(),
        "target": target.value,
        "build": BUILD,
    }
    if cuda and case.allocator_capacity:
        # the allocator's limit is int(fraction * the device's total memory), the total cudaMemGetInfo gives
        total = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(case.allocator_capacity / total)
        result["allocator_limit_bytes"] = int(case.allocator_capacity / total * total)
    if case.layout:
        from benchmarks.ground_truth.distributed import measure_rank0

        result |= measure_rank0(resolve_model(case.model), setup, case.layout, target)
    else:
        try:
            report = measure(case.model, setup, check_fits=False)
        except torch.OutOfMemoryError as error:
            if not case.allocator_capacity:
                raise
            result["out_of_memory"] = str(error).split("\n")[0]
        else:
            result |= {
                "peaks": PEAKS,
                "max_memory_allocated": report.peak_bytes,
                "max_memory_reserved": report.reserved_bytes,
                "device_used_bytes": report.device_total_bytes,
                "allocator_retries": report.allocator_retries,
            }
    if cuda:
        result["allocator_retries_since_start"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        torch.cuda.synchronize()
        result["reserved_at_end"] = torch.cuda.memory_reserved()
        result["process_used_bytes"] = process_used_bytes()
        if shared_device:
            result["device_used_bytes"] = None
        result["allocator_trace"] = {"actions": list(TRACE_ACTIONS), "events": allocator_trace()}
        torch.cuda.memory._record_memory_history(enabled=None)
    return result


def write(result: dict[str, Any], out: Path) -> None:
    """The result as ``out``, readable JSON; its allocator trace (most of its size) beside it, gzipped."""
    trace = result.pop("allocator_trace", None)
    if trace is not None:
        trace_path = out.with_suffix(".trace.json.gz")
        with gzip.open(trace_path, "wt", compresslevel=9) as file:
            json.dump(trace, file, separators=(",", ":"))
        result["allocator_trace_file"] = trace_path.name
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", type=Path, help="a case as JSON (benchmarks/ground_truth/cases.py)")
    parser.add_argument("out", type=Path, help="where to write the result JSON")
    parser.add_argument("--target", choices=[t.value for t in Target], default=Target.CUDA.value)
    parser.add_argument(
        "--shared-device", action="store_true", help="other cases run on the GPU too: leave device_used_bytes out"
    )
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    case = Case(**json.loads(args.case.read_text()))
    result = run(case, Target(args.target), args.shared_device)
    write(result, args.out)


if __name__ == "__main__":
    main()
