"""Estimate vs. eager CPU measurement for every architecture family, shape and setup.

    python -m benchmarks.cpu_accuracy [--markdown]

Both sides run the same CPU kernels (``analyze --target cpu`` traces on fake tensors, ``measure --target cpu``
runs real tensors and counts live storages), so the error isolates what the trace gets wrong.
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

from test_accuracy_cpu import SETUPS, SHAPES
from tiny_models import FAMILIES, tiny_model

from analysis.estimate import analyze
from analysis.measure import measure
from tracer.training import Target, TrainingSetup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows, errors = [], []
    start = time.time()
    for family in FAMILIES:
        for shape_name, (batch, seq) in SHAPES.items():
            for setup_name, options in SETUPS.items():
                setup = TrainingSetup(batch_size=batch, seq_len=seq, target=Target.CPU, **options)
                model = tiny_model(family)
                predicted = analyze(model, setup).peak_bytes
                measured = measure(model, setup).peak_bytes
                error = 100 * (predicted - measured) / measured
                errors.append(abs(error))
                rows.append((family, shape_name, setup_name, measured, predicted, f"{error:+.3f}%"))
    headers = ["architecture", "shape", "setup", "measured bytes", "predicted bytes", "error"]
    print(tabulate(rows, headers=headers, tablefmt="github" if args.markdown else "simple"))
    print(
        f"\n{len(rows)} cases, median |error| {statistics.median(errors):.3f}%, max |error| {max(errors):.3f}%"
        f" ({time.time() - start:.0f} s)"
    )


if __name__ == "__main__":
    main()
