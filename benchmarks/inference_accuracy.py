"""Inference: estimate vs. ``model.generate()`` itself, run eagerly on CPU, for every architecture family, both
caches, prefill- and decode-bound generations, and quantized weights.

    python -m benchmarks.inference_accuracy [--markdown] [--weights fp32 ...] [--tp 2 [--ep]]

Both sides run the same CPU kernels: ``analyze --target cpu`` traces on fake tensors; ``measure --target cpu``
runs ``generate()`` (greedy, no stop token) with real tensors and counts live storages, as in
``benchmarks.cpu_accuracy``. With ``--tp N``, rank 0 of transformers' own tensor parallelism: a checkpoint loaded
with ``from_pretrained(tp_plan="auto", tp_size=N)`` on a fake process group runs ``generate()``, and the CPU
allocator's allocations are counted (``tests/runtimes.py``), for every family whose TP plan is modelled. With
``--ep`` too, the MoE families' experts are expert-parallel over the same ranks
(``DistributedConfig(tp_size=N, ep_size=N)``).
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

from runtimes import transformers_tp_generate_peak
from test_inference import DECODE_PEAK, PREFILL_PEAK, TP_HEADS, tp_heads
from tiny_models import FAMILIES, tiny_model

from analysis.estimate import analyze
from analysis.measure import measure
from strategies.layout import Layout
from tracer.errors import UserError
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
    parser.add_argument(
        "--tp", type=int, choices=sorted(TP_HEADS), default=1, help="rank 0 of transformers' tensor parallelism"
    )
    parser.add_argument(
        "--ep", action="store_true", help="with --tp: the MoE families' experts expert-parallel over the same ranks"
    )
    args = parser.parse_args()
    if args.ep and args.tp == 1:
        parser.error("--ep needs --tp 2 or 4")
    transformers.logging.set_verbosity_error()
    rows, errors, start = [], [], time.time()
    layout = Layout(gpus=args.tp, tp=args.tp, ep=args.tp if args.ep else 1)
    for family in FAMILIES:
        model = tiny_model(family, **(tp_heads(family, args.tp) if args.tp > 1 else {}))
        for cache in ("dynamic", "static"):
            for generation, lengths in GENERATIONS.items():
                for weights in args.weights:
                    options = WEIGHTS[weights]
                    setup = TrainingSetup(
                        target=Target.CPU, mode="inference", batch_size=2, cache=cache, **lengths, **options
                    )
                    try:
                        estimate = analyze(model, setup, layout)
                    except UserError:  # no modelled TP plan (or EP plan)
                        continue
                    if args.tp > 1:
                        measured = transformers_tp_generate_peak(model, setup, args.tp, expert_parallel=args.ep)
                    else:
                        measured = measure(model, setup).peak_bytes
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
