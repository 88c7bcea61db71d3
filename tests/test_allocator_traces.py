"""The caching allocator model fed the alloc/free sequence PyTorch's allocator recorded on a real GPU
(benchmarks/ground_truth/data/, ``torch.cuda.memory._record_memory_history``): same reserved peak."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from analysis.allocator import CachingAllocator

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "ground_truth" / "data"
TOLERANCE = 0.005


def _recorded(path: Path) -> list:
    """The events of a trace ``benchmarks.ground_truth.run_case`` wrote: [action, address, bytes, stream]."""
    with gzip.open(path, "rt") as file:
        return json.load(file)["events"]


def replayed_and_recorded_reserved_peak(trace: list) -> tuple[int, int]:
    allocator = CachingAllocator()
    blocks = {}
    reserved = recorded_peak = 0
    for action, address, size, stream in trace:
        if action == "alloc":
            blocks[address] = allocator.malloc(size, stream)
        elif action == "free_completed" and address in blocks:
            allocator.free(blocks.pop(address))
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
            recorded_peak = max(recorded_peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
    return allocator.peak_reserved, recorded_peak


CASES = sorted(DATA.rglob("*.trace.json.gz"))


@pytest.mark.skipif(not CASES, reason="no allocator trace from a GPU yet: run benchmarks.ground_truth.collect on one")
@pytest.mark.parametrize("path", CASES, ids=lambda path: path.stem)
def test_reserved_peak_of_a_recorded_run(path):
    ours, recorded = replayed_and_recorded_reserved_peak(_recorded(path))
    assert ours == pytest.approx(recorded, rel=TOLERANCE)
