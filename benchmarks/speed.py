"""Wall time and peak resident memory of ``python -m tracer analyze`` on large models.

    python -m benchmarks.speed [--repeat 3] [--batch-size 1] [--seq-len 2048] [MODEL ...]

Each run is a fresh process (imports included, as a user's run pays them), so its peak RSS is its own; the
table gives the median of ``--repeat`` runs. The first row is the floor no analysis can go under: a process
that only imports torch and transformers and loads a model class, and leaves as the command line does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from tabulate import tabulate

DEFAULT_MODELS = (
    "meta-llama/Llama-2-7b-hf",
    "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.1-405B",
    "deepseek-ai/DeepSeek-V3",
    "Qwen/Qwen3-235B-A22B",
)
IMPORTS_ONLY = (
    "import torch, transformers; from transformers import AutoConfig; "
    "from transformers.models.llama import modeling_llama; AutoConfig.for_model('llama'); "
    "import os; os._exit(0)"  # as the command line leaves: without the interpreter's teardown
)


def run(command: list[str]) -> tuple[float, int, bool]:
    """Seconds, peak RSS in bytes and success of one fresh process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    return seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status) == 0


def row(label: str, command: list[str], repeat: int) -> tuple[str, str, str, str]:
    runs = [run(command) for _ in range(repeat)]
    seconds = statistics.median(r[0] for r in runs)
    rss = max(r[1] for r in runs)
    ok = all(r[2] for r in runs)
    return label, f"{seconds:.1f}", f"{rss / 1024**3:.2f}", "ok" if ok else "FAILED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS, help="model ids (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per model; the median is reported")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=2048)
    args, extra = parser.parse_known_args()
    imports = [sys.executable, "-c", IMPORTS_ONLY]
    rows = [row("(imports only: torch, transformers, a model class)", imports, args.repeat)]
    for model in args.models:
        command = [sys.executable, "-m", "tracer", "analyze", model, "--batch-size", str(args.batch_size)]
        command += ["--seq-len", str(args.seq_len), "--json", *extra]
        rows.append(row(model, command, args.repeat))
    print(tabulate(rows, headers=["model", "wall s (median)", "peak RSS GiB", "status"]))
    print(
        f"\nbatch {args.batch_size}, sequence {args.seq_len}, {args.repeat} runs each, {os.cpu_count()} CPUs, "
        f"{' '.join(extra) or 'defaults'}"
    )


if __name__ == "__main__":
    main()
