"""``analyze`` on a GPU made full, against steps an H100 and an H200 ran under ``set_per_process_memory_fraction``
(benchmarks/ground_truth/cases.py's capacities, between each step's allocated and reserved peaks): where a
``cudaMalloc`` fails, PyTorch's allocator releases its cached segments and retries, and the step fits if what it
allocates does; where fragmentation leaves no room even then, it runs out of memory. The allocator model alone
replays these runs' recorded traces exactly (tests/test_allocator_traces.py); here the whole estimate, from the
traced step, is checked."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from benchmarks.accuracy import compare
from benchmarks.ground_truth.cases import result_key

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "ground_truth" / "data"
CASES = sorted(path for path in DATA.glob("*/*__capacity-*.json") if not path.name.endswith(".trace.json.gz"))

# The H100's harness built the model on the GPU (it now builds on the meta device), where Qwen2.5's output layer
# is allocated (519 MiB) before it is tied to the embedding and freed; the freed block stays cached. The estimate,
# like from_pretrained, never allocates it.
# Taking that pair of events out of the recorded unbounded run gives 13.633 GiB reserved, against the
# estimate's 13.631 and the run's 13.053; under 11 GiB the run released three times, the estimate twice.
HARNESS_BUILD_TEMPORARY = {"nvidia-h100-80gb-hbm3/qwen2.5-0.5b__b4-s512__amp-bf16-ckpt__capacity-11g"}
# The H200's run of the same step, the model built on the meta device, ran out of memory under 11 GiB in its second
# step, at the loss, before any gradient sum, after a plain first step. The estimate runs out too, its gradient sums
# in place as that plain step made them (tracer/gradient_sums.py); with them out of place, as the recorder made
# them, it fitted after two releases (benchmarks/accuracy.py: _recorded_peaks).


@cache
def _compared(path: Path) -> dict:
    return compare(json.loads(path.read_text()))


@pytest.mark.skipif(not CASES, reason="no step measured under an allocator capacity yet")
@pytest.mark.parametrize("path", CASES, ids=result_key)
def test_the_estimate_fits_where_the_run_fitted_and_runs_out_where_it_ran_out(path):
    row = _compared(path)
    assert row["ours_fits"] == (row["measured"] is not None)


def _retries_case(path: Path):
    if result_key(path) not in HARNESS_BUILD_TEMPORARY:
        return path
    reason = "the harness's build caches a freed output layer the estimate never allocates (see above)"
    return pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=reason))


FITTED = [path for path in CASES if "out_of_memory" not in json.loads(path.read_text())]


@pytest.mark.skipif(not FITTED, reason="no step measured under an allocator capacity yet")
@pytest.mark.parametrize("path", [_retries_case(path) for path in FITTED], ids=result_key)
def test_the_measured_step_releases_the_cache_as_often_as_the_run(path):
    row = _compared(path)
    assert row["ours_retries"] == row["measured_retries"]
    assert row["ours_reserved"] == pytest.approx(row["measured_reserved"], rel=0.005)
    assert row["ours"] == pytest.approx(row["measured"], rel=0.005)
