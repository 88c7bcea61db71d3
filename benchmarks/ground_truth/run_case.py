"""Measure one ground-truth case in this (fresh) process and write its JSON.

    python -m benchmarks.ground_truth.run_case CASE_JSON OUT_JSON [--target cuda|cpu]

A fresh process per case, because the caching allocator keeps what earlier cases reserved. On CUDA the
allocator's own trace (``torch.cuda.memory._record_memory_history``) is on from the first allocation, so the
file holds the whole alloc/free sequence (model build, warm-up step, measured step) compactly. One rank of a
parallel layout runs with a fake process group: real tensors and real memory, collectives that move nothing.
On CPU the same code runs (to check the harness itself); only CUDA cases are measurements.
"""

from __future__ import annotations

import argparse
import json
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
# The allocator trace, one row per event: [action, address, bytes, stream]. Actions as PyTorch names them.
TRACE_ACTIONS = ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom")


def setup_of(case: Case, target: Target) -> TrainingSetup:
    options = dict(case.setup)
    lora_r = options.pop("lora_r", None)
    return TrainingSetup(
        batch_size=case.batch_size,
        seq_len=case.seq_len,
        target=target,
        lora=LoraSetup(r=lora_r) if lora_r else None,
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
    return [[e["action"], e["addr"], e["size"], e["stream"]] for e in events if e["action"] in TRACE_ACTIONS]


def run(case: Case, target: Target) -> dict[str, Any]:
    cuda = target is Target.CUDA
    if cuda:
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=MAX_TRACE_ENTRIES
        )
    setup = setup_of(case, target)
    result: dict[str, Any] = {"case": case.to_json(), "environment": environment(), "target": target.value}
    if case.layout:
        from benchmarks.ground_truth.distributed import measure_rank0

        result |= measure_rank0(resolve_model(case.model), setup, case.layout, target)
    else:
        report = measure(case.model, setup)
        result |= {
            "max_memory_allocated": report.peak_bytes,
            "max_memory_reserved": report.reserved_bytes,
            "device_used_bytes": report.device_total_bytes,
        }
    if cuda:
        result["allocator_trace_actions"] = list(TRACE_ACTIONS)
        result["allocator_trace"] = allocator_trace()
        torch.cuda.memory._record_memory_history(enabled=None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", type=Path, help="a case as JSON (benchmarks/ground_truth/cases.py)")
    parser.add_argument("out", type=Path, help="where to write the result JSON")
    parser.add_argument("--target", choices=[t.value for t in Target], default=Target.CUDA.value)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    case = Case(**json.loads(args.case.read_text()))
    result = run(case, Target(args.target))
    args.out.write_text(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
