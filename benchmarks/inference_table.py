"""Estimated inference peaks of bundled models at common context lengths, in bf16, int8 and 4-bit weights.

    python -m benchmarks.inference_table [--markdown]

Batch 1, a context of the given length (the prompt, then 256 new tokens), DynamicCache, the prefill keeping the last
position's logits as ``generate()`` does (``--logits-to-keep 1``), H100 kernels.
"""

from __future__ import annotations

import argparse
import time

import transformers
from tabulate import tabulate

from analysis.estimate import analyze
from tracer.resolve import resolve_model
from tracer.training import TrainingSetup
from tracer.units import GIB

MODELS = (
    "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.1-8B",
    "mistralai/Mistral-7B-v0.1",
    "google/gemma-2-9b",
    "bigcode/starcoder",
    "meta-llama/Llama-3.1-70B",
)
CONTEXTS = (2048, 8192, 32768)
WEIGHTS = {"bf16": None, "int8": "int8", "int4 (nf4)": "nf4"}
NEW_TOKENS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows, start = [], time.time()
    for model in MODELS:
        limit = resolve_model(model).config.max_position_embeddings
        for context in CONTEXTS:
            row = [model, f"{context:,}"]
            if context > limit:
                rows.append(row + [f"beyond its {limit:,} positions"] + [""] * (len(WEIGHTS) - 1))
                continue
            for quantize in WEIGHTS.values():
                setup = TrainingSetup(
                    mode="inference",
                    dtype="bf16",
                    quantize=quantize,
                    seq_len=context - NEW_TOKENS,
                    max_new_tokens=NEW_TOKENS,
                    logits_to_keep=1,
                )
                row.append(f"{analyze(model, setup).peak_bytes / GIB:.2f}")
            rows.append(row)
    headers = ["model", "context", *(f"{name} GiB" for name in WEIGHTS)]
    print(tabulate(rows, headers=headers, tablefmt="github" if args.markdown else "simple", disable_numparse=True))
    print(f"\n{sum(1 for row in rows if row[-1]) * len(WEIGHTS)} estimates in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
