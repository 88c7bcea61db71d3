"""generate() with a static cache on a GPU compiles its decode step into CUDA graphs (analysis/cudagraphs.py): the
mechanism, read off the allocator traces recorded on an H200 (benchmarks/ground_truth/data/nvidia-h200), and the
replay that follows it.

In those traces (torch 2.11, transformers 5.17) a run of ``segment_free`` (``empty_cache``) comes right before the
first allocation on a stream other than the compute stream: CUDA graph trees' own stream and private pool. The
pool's segments are never freed, and include one of the cuBLAS workspace's size (``clear_cublas_manager`` freed
the caller's workspace just before) and one of the GPU's L2 cache size (the autotuner's flush buffer). The run's
``max_memory_reserved`` counts them.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from unittest.mock import patch

import pytest
from transformers import Gemma2ForCausalLM

from analysis.allocator import CachingAllocator
from analysis.cudagraphs import compiled_decode, writes_in_place
from analysis.estimate import analyze
from benchmarks.ground_truth.cases import Case
from benchmarks.ground_truth.run_case import setup_of
from tracer.cuda.workspaces import cublas_workspace_bytes
from tracer.gpus import find_gpu
from tracer.resolve import resolve_model
from tracer.training import Target, TrainingSetup

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "ground_truth" / "data" / "nvidia-h200"
STATIC = sorted(DATA.glob("*generate-static.json"))


def _events(case: Path) -> list:
    with gzip.open(case.with_suffix(".trace.json.gz"), "rt") as file:
        return json.load(file)["events"]


@pytest.mark.skipif(not STATIC, reason="no generate() trace from a GPU")
@pytest.mark.parametrize("case", STATIC, ids=lambda path: path.stem)
def test_recorded_pool_follows_the_mechanism(case):
    events = _events(case)
    result = json.loads(case.read_text())
    h200 = find_gpu("h200")
    first_pool = next(i for i, event in enumerate(events) if event[0] == "alloc" and event[3] != 0)
    pool_stream = events[first_pool][3]
    # torch.cuda.graph.__enter__ empties the cache before the tree manager's first capture
    frees = [i for i, event in enumerate(events[:first_pool]) if event[0] == "segment_free"]
    assert frees and all(events[i][0] in ("segment_free", "segment_alloc") for i in range(frees[0], first_pool))
    # clear_cublas_manager: the caller's workspace is freed on the compute stream, then one made in the pool
    workspace = cublas_workspace_bytes(h200)
    freed = {events[i][2] for i in range(first_pool, first_pool + 8) if events[i][0] == "free_completed"}
    assert workspace in freed
    pool = [event for event in events if event[0].startswith("segment") and event[3] == pool_stream]
    assert all(event[0] == "segment_alloc" for event in pool)  # never given back
    sizes = [event[2] for event in pool]
    assert workspace in sizes and h200.l2_cache_bytes in sizes
    allocs = [event[2] for event in events if event[0] == "alloc" and event[3] == pool_stream]
    assert allocs.count(h200.l2_cache_bytes) > 1  # the flush buffer, once per autotuned kernel
    # the pool stays reserved to the end, and the measured reserved peak includes it
    reserved = sum(e[2] if e[0] == "segment_alloc" else -e[2] for e in events if e[0].startswith("segment"))
    assert reserved == result["reserved_at_end"] == result["max_memory_reserved"]


def test_compiled_decode_follows_transformers_criteria():
    h200 = find_gpu("h200")
    setup = TrainingSetup(mode="inference", cache="static", max_new_tokens=8, target=Target.CUDA)
    assert compiled_decode(setup, h200, "GPT2LMHeadModel").l2_cache_bytes == 60 * 1024**2
    assert compiled_decode(setup, h200, "Llama4ForCausalLM") is None  # get_compiled_call stays eager
    dynamic = TrainingSetup(mode="inference", cache="dynamic", max_new_tokens=8, target=Target.CUDA)
    assert compiled_decode(dynamic, h200, "GPT2LMHeadModel") is None
    on_cpu = TrainingSetup(mode="inference", cache="static", max_new_tokens=8, target=Target.CPU)
    assert compiled_decode(on_cpu, h200, "GPT2LMHeadModel") is None
    assert writes_in_place("aten.index_copy_.default") and not writes_in_place("aten.index_copy.default")


def test_empty_cache_keeps_a_private_pool():
    allocator = CachingAllocator()
    allocator.free(allocator.malloc(30 * 1024**2, stream=0))
    allocator.free(allocator.malloc(30 * 1024**2, stream=1))
    allocator.empty_cache(keep_streams=frozenset({1}))
    assert [segment.stream for segment in allocator.segments] == [1]


def _estimated_as_run(case: Path):
    """A Gemma 2 case runs where transformers has Gemma 2's SDPA path, as 5.17 on the GPU did; 5.24 runs it with
    eager attention only (``_supports_sdpa = False``), whose allocated peak is 0.43% higher."""
    if "gemma-2" not in case.name or getattr(Gemma2ForCausalLM, "_supports_sdpa", False):
        return case
    reason = "this transformers runs Gemma 2 with eager attention only; the GPU's ran SDPA"
    return pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=reason))


@pytest.mark.skipif(not STATIC, reason="no generate() trace from a GPU")
@pytest.mark.parametrize("case", [_estimated_as_run(case) for case in STATIC], ids=lambda path: path.stem)
def test_estimate_holds_the_graphs_pool(case):
    """The estimate of the measured run (torch 2.11's kernel choices, as benchmarks/accuracy.py makes it): with the
    pool and the emptied cache, reserved memory within 5% of what the H200 measured (10.6% and 17.6% under
    without); the allocated peak, which the graphs do not change, as close as before (0.25%)."""
    result = json.loads(case.read_text())
    spec = Case(**result["case"])
    setup = dataclasses.replace(setup_of(spec, Target.CUDA), gpu="h200")
    with patch("tracer.cuda.kernels.installed_torch_version", lambda: (2, 11)):
        report = analyze(resolve_model(spec.model), setup)
    assert report.reserved_bytes == pytest.approx(result["max_memory_reserved"], rel=0.05)
    assert report.peak_bytes == pytest.approx(result["max_memory_allocated"], rel=0.0025)
