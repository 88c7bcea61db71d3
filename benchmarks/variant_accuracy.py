"""Fine-tuning variants: estimate vs. eager measurement on CPU, for every architecture family.

    python -m benchmarks.variant_accuracy [--markdown]

Both sides run the same CPU kernels (``analyze --target cpu`` traces on fake tensors, ``measure --target cpu``
runs real tensors and counts live storages), as in ``benchmarks.cpu_accuracy``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import transformers
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_variants import ATTENTION
from tiny_models import FAMILIES, tiny_model

from analysis.estimate import analyze
from analysis.measure import measure
from tracer.training import LoraSetup, Target, TrainingSetup

VARIANTS: dict[str, dict] = {
    "checkpointing full": {"grad_checkpointing": "full"},
    "checkpointing full, reentrant": {"grad_checkpointing": "full", "reentrant": True},
    "checkpointing selective": {"grad_checkpointing": "selective"},
    "LoRA r8 attention": {"lora": LoraSetup(r=8, alpha=16, targets=ATTENTION)},
    "LoRA r8, bf16, checkpointing": {
        "lora": LoraSetup(r=8, alpha=16, targets=ATTENTION),
        "dtype": "bf16",
        "grad_checkpointing": "full",
    },
    "gradient accumulation 4": {"grad_accum": 4},
    "Adafactor": {"optimizer": "adafactor"},
    "AdamW fused": {"optimizer_impl": "fused"},
    "AdamW foreach": {"optimizer_impl": "foreach"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows, errors, start = [], {name: [] for name in VARIANTS}, time.time()
    for family in FAMILIES:
        for name, options in VARIANTS.items():
            setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, **options)
            try:
                measured = measure(tiny_model(family), setup).peak_bytes
                estimated = analyze(tiny_model(family), setup).peak_bytes
            except Exception as error:  # a variant the family does not support (peft targets, checkpointing)
                rows.append((family, name, "", "", f"n/a: {str(error).splitlines()[0][:60]}"))
                continue
            error = (estimated - measured) / measured
            errors[name].append(abs(error))
            rows.append((family, name, measured, estimated, f"{100 * error:+.3f}%"))
    headers = ["architecture", "variant", "measured bytes", "predicted bytes", "error"]
    print(tabulate(rows, headers=headers, tablefmt="github" if args.markdown else "simple"))
    summary = [(name, len(found), f"{100 * max(found):.3f}%") for name, found in errors.items() if found]
    print()
    print(
        tabulate(summary, headers=["variant", "cases", "max |error|"], tablefmt="github" if args.markdown else "simple")
    )
    every = [e for found in errors.values() for e in found]
    print(
        f"\n{len(every)} cases, median |error| {100 * statistics.median(every):.3f}%, max {100 * max(every):.3f}%"
        f" ({time.time() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
