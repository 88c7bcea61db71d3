"""Inference: estimate vs. ``model.generate()`` itself, run eagerly on CPU, for every architecture family, both
caches, prefill- and decode-bound generations, and quantized weights.

    python -m benchmarks.inference_accuracy [--markdown] [--weights fp32 ...]

Both sides run the same CPU kernels: ``analyze --target cpu`` traces on fake tensors; ``measure --target cpu``
runs ``generate()`` (greedy, no stop token) with real tensors and counts live storages, as in
``benchmarks.cpu_accuracy``.
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

from test_inference import DECODE_PEAK, PREFILL_PEAK
from tiny_models import FAMILIES, tiny_model

from analysis.estimate import analyze
from analysis.measure import measure
from tracer.training import Target, TrainingSetup

GENERATIONS: dict[str, dict] = {
    "prompt 48, 8 new": PREFILL_PEAK,
    "prompt 16, 200 new": DECODE_PEAK,
}
WEIGHTS: dict[str, dict] = {
    "fp32": {},
    "bf16": {"dtype": "bf16"},
    "bf16, nf4": {"dtype": "bf16", "quantize": "nf4"},
    "fp16, int8": {"dtype": "fp16", "quantize": "int8"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    parser.add_argument(
        "--weights", nargs="+", choices=WEIGHTS, default=list(WEIGHTS), help="weight formats to run (default: all)"
    )
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows, errors, start = [], [], time.time()
    for family in FAMILIES:
        for cache in ("dynamic", "static"):
            for generation, lengths in GENERATIONS.items():
                for weights in args.weights:
                    options = WEIGHTS[weights]
                    setup = TrainingSetup(
                        target=Target.CPU, mode="inference", batch_size=2, cache=cache, **lengths, **options
                    )
                    measured = measure(tiny_model(family), setup).peak_bytes
                    estimate = analyze(tiny_model(family), setup)
                    error = (estimate.peak_bytes - measured) / measured
                    errors.append(abs(error))
                    predicted, share = estimate.peak_bytes, f"{100 * error:+.3f}%"
                    rows.append((family, cache, generation, weights, estimate.peak_phase, measured, predicted, share))
    headers = ["architecture", "cache", "generation", "weights", "peak in", "measured bytes", "predicted bytes"]
    print(tabulate(rows, headers=[*headers, "error"], tablefmt="github" if args.markdown else "simple"))
    print(
        f"\n{len(errors)} cases, median |error| {100 * statistics.median(errors):.3f}%, "
        f"max {100 * max(errors):.3f}% ({time.time() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
