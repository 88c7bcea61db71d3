"""``serve --engine sglang`` against published SGLang start-up logs: the weights each rank loads and
``max_total_num_tokens``, case by case, with the error of each.

    python -m benchmarks.sglang_published [--markdown]

Each log (SGLang v0.4.x, January to April 2025 and one of 2026) prints "Load weight begin. avail mem" (the free
memory before loading, the one figure given as input: as ``--gpu-memory`` with no ``--non-torch-memory``), "Load
weight end. avail mem" (the weights: before less after) and ``max_total_num_tokens`` or "KV Cache is allocated.
#tokens"; its server_args give ``mem_fraction_static`` and the tensor-parallel degree. SGLang's "GB" are GiB
(``get_available_gpu_memory`` divides by ``1 << 30``). Nothing is fitted to the logs.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from tabulate import tabulate

from analysis.sglang import SglangSetup, sglang_startup
from tracer.resolve import resolve_model
from tracer.units import GIB

# QwQ-32B is Qwen2.5-32B's architecture (hidden 5120, 27648 intermediate, 64 layers, 40 heads, 8 key/value
# heads, vocabulary 152064, untied), with the 131072 positions its log's context_len shows
QWQ_32B = {
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
}


@dataclass(frozen=True)
class Logged:
    """One start-up log: where it was published, what was run, and what it printed (GiB as printed)."""

    url: str
    model: str  # the bundled config of the served checkpoint's architecture
    served: str
    gpu: str
    tp: int
    mem_fraction_static: float
    before: float  # "Load weight begin. avail mem"
    after: float  # "Load weight end. avail mem"
    tokens: int  # max_total_num_tokens
    overrides: dict | None = None  # the served checkpoint's dimensions where they differ from ``model``'s


CASES = [
    Logged(
        "https://docs.sglang.ai/start/send_request.html (notebook output of 2025-01-23)",
        "meta-llama/Llama-3.1-8B",
        "meta-llama/Meta-Llama-3.1-8B-Instruct",
        "80 GB (H100)",
        1,
        0.88,
        before=78.81,
        after=63.72,
        tokens=444500,
    ),
    Logged(
        "https://github.com/jerryzsj/my-deepseek-r1 README (2025-02-04)",
        "Qwen/Qwen2.5-7B",
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "RTX 3090",
        1,
        0.88,
        before=22.76,
        after=8.37,
        tokens=105531,
    ),
    Logged(
        "QwQ-32B on an AWS g6.12xlarge, SGLang start sequence in a public ECS deployment guide (2025-03-08)",
        "Qwen/Qwen2.5-7B",
        "Qwen/QwQ-32B",
        "4x L4",
        4,
        0.85,
        before=21.63,
        after=6.09,
        tokens=46611,
        overrides=QWQ_32B,
    ),
    Logged(
        "PD-disaggregation prefill server log in a public SGLang walkthrough (2026-04-14, --mem-fraction-static 0.15)",
        "Qwen/Qwen2.5-0.5B",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "16 GB",
        1,
        0.15,
        before=14.70,
        after=13.72,
        tokens=107319,
    ),
]


def run_case(case: Logged) -> dict:
    config = resolve_model(case.model).config
    if case.overrides:  # rebuilt, so that the per-layer attention types follow the new depth
        config = type(config)(**(config.to_dict() | case.overrides | {"layer_types": None}))
    setup = SglangSetup(
        gpu_memory_bytes=int(case.before * GIB),
        tensor_parallel_size=case.tp,
        mem_fraction_static=case.mem_fraction_static,
    )
    startup = sglang_startup(config, setup)
    return {
        "served": case.served,
        "gpu": case.gpu,
        "tp": case.tp,
        "mem_fraction_static": case.mem_fraction_static,
        "weights_logged_gib": round(case.before - case.after, 2),
        "weights_gib": round(startup.loaded_bytes / GIB, 2),
        "tokens_logged": case.tokens,
        "tokens": startup.max_total_num_tokens,
        "error_pct": round(100 * (startup.max_total_num_tokens - case.tokens) / case.tokens, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = [run_case(case) for case in CASES]
    print(tabulate(rows, headers="keys", tablefmt="github" if args.markdown else "simple"))
    errors = [abs(row["error_pct"]) for row in rows]
    print(f"\nmax_total_num_tokens: median |error| {statistics.median(errors):.2f}%, max {max(errors):.2f}%")


if __name__ == "__main__":
    main()
