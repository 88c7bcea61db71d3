"""The caching allocator model fed the alloc/free sequence PyTorch's allocator recorded on a real GPU
(benchmarks/ground_truth/data/, ``torch.cuda.memory._record_memory_history``): same reserved peak.

The replay applies, besides each ``alloc`` and ``free_completed``, two things of the recorded run that are not
the allocator's rules and that the model could not know from the alloc/free sequence alone:

* where ``cudaMalloc`` put each segment. Among free blocks of equal size a request takes the one at the lowest
  address (``BlockComparatorSize``), so the addresses decide which segment gets split, and with it how many
  segments a step ends up holding. The driver's choice of addresses is not PyTorch's: the replay gives each
  new segment of the model the address of the ``segment_alloc`` recorded just before the same ``alloc``
  (when the model asks for a segment the real allocator did not, or of another size, the model chooses).
  ``test_reserved_peak_with_the_models_own_addresses`` checks the model's own choice (top-down) as well;
* ``torch.cuda.empty_cache``, which frees every cached segment with no block in use (``emptyCache`` calls
  ``release_cached_blocks``). The model only gives memory back when ``cudaMalloc`` fails, and in the replay
  (no capacity) it never fails, so every recorded ``segment_free`` comes from an ``empty_cache`` of the
  run: ``torch.cuda.graph`` calls one before each CUDA graph capture, which ``generate()`` with a static cache
  does when it compiles the decoding step (mode "reduce-overhead"). The first ``segment_free`` of a run of
  them is replayed as ``CachingAllocator.empty_cache``.

A case measured under an allocator capacity (``set_per_process_memory_fraction``) is replayed under the same
limit: there its ``segment_free`` events are the allocator's own releases after a failed ``cudaMalloc``, which the
model must make at the same allocations, and its ``oom`` event a request the model must fail too.

The traces hold no ``free_requested`` (a block freed while other streams still use it): ``free_completed`` is
when the block went back to the pool, which is when the model must free it. ``recorded_peak`` sums the
``segment_alloc`` and ``segment_free`` sizes from the first allocation on (the history is recorded from the
start of the process), which is ``max_memory_reserved`` unless the run reset its peaks.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from analysis.allocator import AllocatorConfig, CachingAllocator, OutOfMemory
from benchmarks.ground_truth.cases import result_key

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "ground_truth" / "data"
TOLERANCE = 0.005


def _recorded(path: Path) -> list:
    """The events of a trace ``benchmarks.ground_truth.run_case`` wrote: [action, address, bytes, stream]."""
    with gzip.open(path, "rt") as file:
        return json.load(file)["events"]


@dataclass
class Replayed:
    ours: int  # the model's reserved peak
    recorded: int
    retries: int = 0  # the model's releases after a failed cudaMalloc
    out_of_memory: list[bool] = field(default_factory=list)  # per recorded oom event: did the model fail too


def replay_recorded(trace: list, recorded_addresses: bool = True, capacity: int | None = None) -> Replayed:
    new_segments: list[tuple[int, int]] = []  # segment_alloc events since the last alloc: (address, bytes)

    def address_of_new_segment(nbytes: int) -> int | None:
        if new_segments and new_segments[-1][1] == nbytes:
            return new_segments.pop()[0]
        return None

    config = AllocatorConfig(capacity=capacity)
    allocator = CachingAllocator(config, addresses=address_of_new_segment if recorded_addresses else None)
    blocks = {}
    reserved = recorded_peak = 0
    out_of_memory = []
    previous = None
    for action, address, size, stream in trace:
        if action == "alloc":
            blocks[address] = allocator.malloc(size, stream)
            new_segments.clear()
        elif action == "free_completed" and address in blocks:
            allocator.free(blocks.pop(address))
        elif action in ("segment_alloc", "segment_map"):
            new_segments.append((address, size))
            reserved += size
            recorded_peak = max(recorded_peak, reserved)
        elif action in ("segment_free", "segment_unmap"):
            if capacity is None and previous not in ("segment_free", "segment_unmap"):
                allocator.empty_cache()
            reserved -= size
        elif action == "oom":
            try:
                allocator.malloc(size, stream)
                out_of_memory.append(False)
            except OutOfMemory:
                out_of_memory.append(True)
        previous = action
    return Replayed(allocator.peak_reserved, recorded_peak, allocator.retries, out_of_memory)


CASES = sorted(DATA.rglob("*.trace.json.gz"))
CAPPED = [path for path in CASES if "__capacity-" in path.name]
CASES = [path for path in CASES if path not in CAPPED]


# Where the model's own, top-down, addresses break a tie between equal-size free blocks otherwise than the
# driver's did: in these runs cudaMalloc put consecutive segments upward, into a hole of its address space,
# so the real allocator split the older segment where the model splits the newer one.
DRIVER_PUT_SEGMENTS_UPWARD = {
    "nvidia-h100-80gb-hbm3/gpt2__b4-s512__generate-static",  # 12 MiB segments at 0x..afc00000, 0x..b0800000, ...
    "nvidia-h100-80gb-hbm3/opt-350m__b1-s512__fp32-sgd",  # a 16 MiB segment at 0x..65000000 after one at 0x..64000000
}
# The H200's run of 2026-11-27 (models built on the meta device), where the model's own addresses end elsewhere
# than the driver's: Gemma-2 LoRA +10%, OPT -2.5%, GPT-2 +0.7%, Gemma-2's generate() -1.08%, and Pythia under a
# limit +0.05%. Not yet examined.
OWN_ADDRESSES_APART = {
    "nvidia-h200/gemma-2-2b__b4-s512__bf16-lora",
    "nvidia-h200/opt-350m__b4-s512__amp-bf16-ckpt",
    "nvidia-h200/gpt2__b1-s512__amp-bf16-ckpt",
    "nvidia-h200/gemma-2-2b__b4-s512__generate-static",
}
# Replayed with the driver's own addresses and still apart: Gemma-2's generate() with a static cache, -1.08%.
DRIVER_ADDRESSES_APART = {"nvidia-h200/gemma-2-2b__b4-s512__generate-static"}
CAPPED_OWN_ADDRESSES_APART = {"nvidia-h200/pythia-410m__b2-s2048__amp-bf16-ckpt__capacity-8.5g"}


def _xfails(path: Path, apart: set[str], reason: str) -> list:
    return [pytest.mark.xfail(strict=True, reason=reason)] if result_key(path) in apart else []


def _driver_addresses_case(path: Path):
    reason = "replayed with the driver's addresses and apart: not explained"
    return pytest.param(path, marks=_xfails(path, DRIVER_ADDRESSES_APART, reason))


def _own_addresses_case(path: Path):
    marks = _xfails(path, DRIVER_PUT_SEGMENTS_UPWARD, "cudaMalloc placed these segments upward (see above)")
    marks += _xfails(path, OWN_ADDRESSES_APART, "the model's own addresses end elsewhere: not yet examined")
    return pytest.param(path, marks=marks)


def _capped_cases() -> list:
    reason = "the model's own addresses end elsewhere: not yet examined"
    return [
        pytest.param(path, recorded, id=f"{result_key(path)}-{'driver' if recorded else 'own'}-addresses", marks=marks)
        for path in CAPPED
        for recorded, marks in ((True, []), (False, _xfails(path, CAPPED_OWN_ADDRESSES_APART, reason)))
    ]


@pytest.mark.skipif(not CASES, reason="no allocator trace from a GPU yet: run benchmarks.ground_truth.collect on one")
@pytest.mark.parametrize("path", [_driver_addresses_case(path) for path in CASES], ids=result_key)
def test_reserved_peak_of_a_recorded_run(path):
    replayed = replay_recorded(_recorded(path))
    assert replayed.ours == pytest.approx(replayed.recorded, rel=TOLERANCE)


@pytest.mark.skipif(not CASES, reason="no allocator trace from a GPU yet: run benchmarks.ground_truth.collect on one")
@pytest.mark.parametrize("path", [_own_addresses_case(path) for path in CASES], ids=result_key)
def test_reserved_peak_with_the_models_own_addresses(path):
    """What an estimate does: the model chooses the segments' addresses (``empty_cache`` is still replayed)."""
    replayed = replay_recorded(_recorded(path), recorded_addresses=False)
    assert replayed.ours == pytest.approx(replayed.recorded, rel=TOLERANCE)


@pytest.mark.skipif(not CAPPED, reason="no trace measured under an allocator capacity yet")
@pytest.mark.parametrize(("path", "recorded_addresses"), _capped_cases())
def test_a_full_gpu_releases_and_retries_where_the_recorded_run_did(path, recorded_addresses):
    """Under the recorded run's limit the model releases its cache as often, reaches the same reserved peak, and
    fails the request the run failed (and only that one)."""
    result = json.loads(path.with_name(path.name.replace(".trace.json.gz", ".json")).read_text())
    replayed = replay_recorded(_recorded(path), recorded_addresses, capacity=result["allocator_limit_bytes"])
    assert replayed.retries == result["allocator_retries_since_start"]  # a release may free nothing: still a retry
    assert replayed.ours == replayed.recorded
    assert replayed.out_of_memory == ([True] if "out_of_memory" in result else [])
