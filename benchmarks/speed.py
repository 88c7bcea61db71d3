"""Wall time and peak resident memory of ``python -m tracer analyze`` on large models.

    python -m benchmarks.speed [--batch-size 1] [--seq-len 2048] [MODEL ...]

Each model runs in a fresh process, so the peak RSS is that run's alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from tabulate import tabulate

DEFAULT_MODELS = ("meta-llama/Llama-2-7b-hf", "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-70B")


def run(model: str, batch_size: int, seq_len: int, extra: list[str]) -> tuple[float, int, bool]:
    command = [
        sys.executable,
        "-m",
        "tracer",
        "analyze",
        model,
        "--batch-size",
        str(batch_size),
        "--seq-len",
        str(seq_len),
        "--json",
        *extra,
    ]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    return seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    args, extra = parser.parse_known_args()
    rows = []
    for model in args.models:
        seconds, rss, ok = run(model, args.batch_size, args.seq_len, extra)
        rows.append((model, f"{seconds:.1f}", f"{rss / 1024**3:.2f}", "ok" if ok else "FAILED"))
    print(tabulate(rows, headers=["model", "wall s", "peak RSS GiB", "status"]))
    print(f"\nbatch {args.batch_size}, sequence {args.seq_len}, {os.cpu_count()} CPUs, {' '.join(extra) or 'defaults'}")


if __name__ == "__main__":
    main()
