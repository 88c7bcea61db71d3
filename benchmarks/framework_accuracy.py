"""``--recipe`` against the frameworks' own loops run on CPU: the Hugging Face Trainer (``Trainer.train``)
and the loop of accelerate's examples, every case of tests/test_recipes.py.

    python -m benchmarks.framework_accuracy [--markdown]

Each case writes a tiny config.json, takes the setup the command line gives with ``--recipe`` and the case's
flags, and compares its estimate with the peak PyTorch's MemTracker measures in the framework's third step.
Tensor bytes as the tracker counts them (``--target cpu``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import transformers
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from runtimes import accelerate_loop_peak, trainer_peak
from test_recipes import BACKWARD_PEAK, LOGITS_PEAK, TRAINER_RUNS, estimate_and_runtime


def _cases():
    for case in TRAINER_RUNS:
        shape, stored, arguments, flags = getattr(case, "values", case)
        yield (
            "trainer",
            shape,
            stored,
            flags,
            lambda model, setup, arguments=arguments: trainer_peak(model, setup, **arguments),
            ", ".join(f"{k}={v}" for k, v in arguments.items()) or "defaults",
        )
    for shape in (BACKWARD_PEAK, LOGITS_PEAK):
        for stored, precision in (("fp32", "no"), ("bf16", "bf16"), ("fp32", "bf16")):
            flags = ("--mixed-precision", "off") if precision == "no" else ()
            yield (
                "accelerate-loop",
                shape,
                stored,
                flags,
                lambda model, setup, precision=precision: accelerate_loop_peak(model, setup, precision),
                f"mixed_precision={precision}",
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as directory:
        for recipe, shape, stored, flags, run, run_setup in _cases():
            estimate, runtime = estimate_and_runtime(shape, stored, recipe, flags, run, Path(directory))
            error = (estimate - runtime) / runtime
            errors.append(abs(error))
            peak = "backward" if shape.get("vocab_size") == 32 else "logits"
            rows.append((recipe, peak, stored, run_setup, " ".join(flags) or "-", runtime, estimate, f"{error:+.2%}"))
    headers = ["--recipe", "peak in", "checkpoint", "framework run", "flags", "framework bytes", "estimate", "error"]
    print(tabulate(rows, headers, tablefmt="github" if args.markdown else "simple"))
    print(
        f"\n{len(rows)} cases, max |error| {max(errors):.2%}, mean {statistics.mean(errors):.2%}; "
        f"transformers {transformers.__version__}"
    )


if __name__ == "__main__":
    main()
