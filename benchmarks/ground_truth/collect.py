"""Measure the ground-truth matrix on this machine's GPU: one JSON per case.

    python -m benchmarks.ground_truth.collect [--matrix quick|full] [--only TEXT] [--out DIR] [--force]
                                              [--jobs N] [--deadline-s S]

Each case runs ``benchmarks.ground_truth.run_case`` in a fresh process (the caching allocator keeps what
earlier cases reserved) and writes ``DIR/<case>.json``: the case, device, driver, CUDA, torch and
transformers versions, ``max_memory_allocated``, ``max_memory_reserved``, the device memory in use, and the
allocator's alloc/free trace. The default DIR is benchmarks/ground_truth/data/<device>/. Cases already
collected are skipped unless --force. ``python -m benchmarks.accuracy`` reads the files.

``--jobs N`` runs N cases at once on the one GPU: each process's allocator counters are its own, so the
measurements do not change; a case that runs out of memory beside the others is measured again alone at the
end. ``--deadline-s`` starts no case after that many seconds, so a lent GPU's time is not overrun. Cases with an
allocator capacity (``--matrix capacity``) run after the others, in waves whose capacities fit the GPU together:
their out-of-memory errors are results, so the GPU itself must never be what runs out.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.ground_truth.cases import Case, matrix

DATA = Path(__file__).resolve().parent / "data"
CASE_TIMEOUT_S = 1800
CONTEXT_ALLOWANCE = 2 * 1024**3  # a process's CUDA context and what it allocates outside the caching allocator


def device_slug() -> str:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _short_of_memory(stderr: str) -> bool:
    """The case ran out of device memory (cuBLAS too, making its handle's workspace), or measure() refused it for
    want of free memory."""
    return any(sign in stderr for sign in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "is free on this machine"))


def run_case(case: Case, target: Path, device: str, shared_device: bool) -> subprocess.CompletedProcess | None:
    """Measure one case in a fresh process; None if it timed out."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
        json.dump(case.to_json(), spec)
        spec.flush()
        command = [sys.executable, "-m", "benchmarks.ground_truth.run_case", spec.name, str(target)]
        command += ["--target", device] + (["--shared-device"] if shared_device else [])
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None


def _waves(cases: list[Case], device_bytes: int, jobs: int) -> list[list[Case]]:
    """The capacity cases in groups of at most ``jobs`` whose capacities, each with a CUDA context, fit the device
    together (one at a time where ``device_bytes`` is 0: no GPU)."""
    waves: list[list[Case]] = []
    room = 0
    for case in cases:
        need = case.allocator_capacity + CONTEXT_ALLOWANCE
        if not waves or len(waves[-1]) == jobs or need > room:
            waves.append([])
            room = device_bytes
        waves[-1].append(case)
        room -= need
    return waves


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--matrix", choices=("quick", "full", "capacity"), default="quick", help="which cases (default quick)"
    )
    parser.add_argument("--only", default="", help="only cases whose name contains this text")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default data/<device>/)")
    parser.add_argument("--force", action="store_true", help="measure cases that already have a file again")
    parser.add_argument(
        "--target", choices=("cuda", "cpu"), default="cuda", help="cpu runs the harness without a GPU (a check)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="cases measured at once on the one GPU (default 1)")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no case after this many seconds")
    args = parser.parse_args()
    if args.target == "cuda" and not torch.cuda.is_available():
        message = "no CUDA GPU here; the ground truth needs one (--target cpu only checks the harness)"
        print(f"error: {message}.", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"error: --jobs must be at least 1 (got {args.jobs}).", file=sys.stderr)
        return 2
    out = args.out or DATA / device_slug()
    out.mkdir(parents=True, exist_ok=True)
    cases = [case for case in matrix(args.matrix) if args.only in case.name]
    todo = [case for case in cases if args.force or not (out / f"{case.name}.json").exists()]
    start = time.time()
    measured = 0
    failed: list[str] = []
    out_of_memory: list[Case] = []

    def measure(case: Case, shared_device: bool) -> None:
        nonlocal measured
        if args.deadline_s is not None and time.time() - start > args.deadline_s:
            return
        print(f"{case.name} ({time.time() - start:.0f} s so far)", file=sys.stderr, flush=True)
        done = run_case(case, out / f"{case.name}.json", args.target, shared_device)
        if done is not None and done.returncode == 0:
            measured += 1
        elif shared_device and done is not None and _short_of_memory(done.stderr):
            out_of_memory.append(case)
        else:
            failed.append(case.name)
            why = f"timed out after {CASE_TIMEOUT_S} s" if done is None else done.stderr[-2000:]
            print(f"  {case.name} failed:\n{why}", file=sys.stderr, flush=True)

    capped = [case for case in todo if case.allocator_capacity]
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda case: measure(case, args.jobs > 1), [case for case in todo if case not in capped]))
    for case in out_of_memory:
        measure(case, False)
    device_bytes = torch.cuda.get_device_properties(0).total_memory if args.target == "cuda" else 0
    for wave in _waves(capped, device_bytes, args.jobs):
        shared = len(wave) > 1
        with ThreadPoolExecutor(len(wave)) as pool:
            list(pool.map(lambda case, shared=shared: measure(case, shared), wave))
    skipped = len(todo) - measured - len(failed)
    print(
        f"{measured} of {len(todo)} cases measured in {out} ({time.time() - start:.0f} s); {len(failed)} failed"
        + (f", {skipped} not started before the deadline" if skipped else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
