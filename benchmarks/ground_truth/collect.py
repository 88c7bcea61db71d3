"""Measure the ground-truth matrix on this machine's GPU: one JSON per case.

    python -m benchmarks.ground_truth.collect [--matrix quick|full] [--only TEXT] [--out DIR] [--force]

Each case runs ``benchmarks.ground_truth.run_case`` in a fresh process (the caching allocator keeps what
earlier cases reserved) and writes ``DIR/<case>.json``: the case, device, driver, CUDA, torch and
transformers versions, ``max_memory_allocated``, ``max_memory_reserved``, the device memory in use, and the
allocator's alloc/free trace. The default DIR is benchmarks/ground_truth/data/<device>/. Cases already
collected are skipped unless --force. ``python -m benchmarks.accuracy`` reads the files.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.ground_truth.cases import matrix

DATA = Path(__file__).resolve().parent / "data"
CASE_TIMEOUT_S = 1800


def device_slug() -> str:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", choices=("quick", "full"), default="quick", help="which cases (default quick)")
    parser.add_argument("--only", default="", help="only cases whose name contains this text")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default data/<device>/)")
    parser.add_argument("--force", action="store_true", help="measure cases that already have a file again")
    parser.add_argument(
        "--target", choices=("cuda", "cpu"), default="cuda", help="cpu runs the harness without a GPU (a check)"
    )
    args = parser.parse_args()
    if args.target == "cuda" and not torch.cuda.is_available():
        message = "no CUDA GPU here; the ground truth needs one (--target cpu only checks the harness)"
        print(f"error: {message}.", file=sys.stderr)
        return 2
    out = args.out or DATA / device_slug()
    out.mkdir(parents=True, exist_ok=True)
    cases = [case for case in matrix(args.matrix) if args.only in case.name]
    failures = 0
    start = time.time()
    for number, case in enumerate(cases, 1):
        target = out / f"{case.name}.json"
        if target.exists() and not args.force:
            continue
        print(f"[{number}/{len(cases)}] {case.name} ({time.time() - start:.0f} s so far)", file=sys.stderr, flush=True)
        with tempfile.NamedTemporaryFile("w", suffix=".json") as spec:
            json.dump(case.to_json(), spec)
            spec.flush()
            command = [sys.executable, "-m", "benchmarks.ground_truth.run_case", spec.name, str(target)]
            command += ["--target", args.target]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=CASE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"  timed out after {CASE_TIMEOUT_S} s", file=sys.stderr)
                failures += 1
                continue
        if done.returncode != 0:
            failures += 1
            print(f"  failed:\n{done.stderr[-2000:]}", file=sys.stderr)
    print(f"{len(cases) - failures} of {len(cases)} cases in {out} ({time.time() - start:.0f} s)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
