"""Inference: estimate vs. ``model.generate()`` itself, run eagerly on CPU, for every architecture family, the
caches generate() makes, prefill- and decode-bound generations, quantized weights, sampling and device maps.

    python -m benchmarks.inference_accuracy [--markdown] [--weights fp32 ...] [--caches dynamic ...] [--tp 2 [--ep]]
    python -m benchmarks.inference_accuracy --device-map 3 [--caches dynamic static offloaded]
    python -m benchmarks.inference_accuracy --sampling

Both sides run the same CPU kernels: ``analyze --target cpu`` traces on fake tensors; ``measure --target cpu``
runs ``generate()`` (greedy, no stop token) with real tensors and counts live storages, as in
``benchmarks.cpu_accuracy``. With ``--tp N``, rank 0 of transformers' own tensor parallelism: a checkpoint loaded
with ``from_pretrained(tp_plan="auto", tp_size=N)`` on a fake process group runs ``generate()``, and the CPU
allocator's allocations are counted (``tests/runtimes.py``), for every family whose TP plan is modelled. With
``--ep`` too, the MoE families' experts are expert-parallel over the same ranks
(``DistributedConfig(tp_size=N, ep_size=N)``).

Where host memory or several GPUs must be told apart (the offloaded caches, ``--device-map N``), generate() runs on
GPUs a CPU stands in for (``tests/generate_runtimes.py``): with ``--device-map``, the model dispatched over N of them
by accelerate's own ``dispatch_model`` as ``from_pretrained(device_map="auto")`` places it, each GPU's peak compared
with the estimate's; eager attention, dense families, 4 decoder layers. ``--sampling`` runs generate(do_sample=True)
against the CPU allocator, which also sees what ``torch.multinomial`` allocates inside itself.
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

from generate_runtimes import allocator_phase_peaks, auto_device_map, generate_peaks
from runtimes import transformers_tp_generate_peak
from test_inference import DECODE_PEAK, PREFILL_PEAK, TP_HEADS, tp_heads
from tiny_models import FAMILIES, deep_tiny_model, tiny_model

from analysis.device_map import estimate_device_map
from analysis.estimate import analyze
from analysis.measure import measure
from strategies.layout import Layout
from tracer.device_map import free_memory
from tracer.errors import UserError
from tracer.gpus import find_gpu
from tracer.training import CACHES, DeviceMap, Sampling, Target, TrainingSetup

GENERATIONS: dict[str, dict] = {
    "prompt 48, 8 new": PREFILL_PEAK,
    "prompt 16, 200 new": DECODE_PEAK,
}
# generate() on GPUs a CPU stands in for dispatches every op in Python: a shorter decode-bound generation
STAND_IN_GENERATIONS: dict[str, dict] = {
    "prompt 48, 8 new": PREFILL_PEAK,
    "prompt 16, 40 new": {"seq_len": 16, "max_new_tokens": 40},
}
SAMPLINGS: dict[str, Sampling] = {
    "defaults (top-k 50)": Sampling(),
    "temperature 0.7, top-k 20, top-p 0.9": Sampling(temperature=0.7, top_k=20, top_p=0.9),
}
SAMPLING_VOCAB = 8192  # the processors' batch x vocabulary tensors among the largest
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
        "--caches", nargs="+", choices=CACHES, default=["dynamic", "static"], help="caches (default: dynamic static)"
    )
    parser.add_argument(
        "--tp", type=int, choices=sorted(TP_HEADS), default=1, help="rank 0 of transformers' tensor parallelism"
    )
    parser.add_argument(
        "--ep", action="store_true", help="with --tp: the MoE families' experts expert-parallel over the same ranks"
    )
    parser.add_argument("--device-map", type=int, default=None, metavar="GPUS", help="device_map='auto' over GPUS")
    parser.add_argument("--sampling", action="store_true", help="generate(do_sample=True), fp32, dynamic cache")
    args = parser.parse_args()
    if args.ep and args.tp == 1:
        parser.error("--ep needs --tp 2 or 4")
    transformers.logging.set_verbosity_error()
    start = time.time()
    if args.device_map:
        rows = list(_device_map_rows(args.device_map, args.caches))
    elif args.sampling:
        rows = list(_sampling_rows())
    else:
        rows = list(_rows(args))
    errors = [abs(row[-1]) for row in rows]
    headers = ["architecture", "cache", "generation", "weights", "peak in", "measured bytes", "predicted bytes"]
    if args.device_map:
        headers.insert(3, "GPU")
    table = [(*row[:-1], f"{100 * row[-1]:+.3f}%") for row in rows]
    print(tabulate(table, headers=[*headers, "error"], tablefmt="github" if args.markdown else "simple"))
    print(
        f"\n{len(errors)} cases, median |error| {100 * statistics.median(errors):.3f}%, "
        f"max {100 * max(errors):.3f}% ({time.time() - start:.0f} s)"
    )


def _rows(args):
    """One GPU, or rank 0 of transformers' tensor parallelism, against generate() on the CPU."""
    layout = Layout(gpus=args.tp, tp=args.tp, ep=args.tp if args.ep else 1)
    for family in FAMILIES:
        model = tiny_model(family, **(tp_heads(family, args.tp) if args.tp > 1 else {}))
        for cache in args.caches:
            generations = STAND_IN_GENERATIONS if cache.startswith("offloaded") else GENERATIONS
            for generation, lengths in generations.items():
                for weights in args.weights:
                    options = WEIGHTS[weights] | ({"attn": "eager"} if cache.startswith("offloaded") else {})
                    if cache == "quantized":
                        options |= {"cache_backend": "fp8"}
                    setup = TrainingSetup(
                        target=Target.CPU, mode="inference", batch_size=2, cache=cache, **lengths, **options
                    )
                    try:
                        estimate = analyze(model, setup, layout)
                    except UserError:  # no modelled TP plan (or EP plan), or a cache the model refuses
                        continue
                    if args.tp > 1:
                        measured = transformers_tp_generate_peak(model, setup, args.tp, expert_parallel=args.ep)
                    elif cache.startswith("offloaded"):
                        try:
                            measured = max(peaks[0] for peaks in generate_peaks(model, setup).values())
                        except NotImplementedError:  # MoE experts' GPU-only ops (histc of integers)
                            continue
                    else:
                        measured = measure(model, setup).peak_bytes
                    error = (estimate.peak_bytes - measured) / measured
                    yield family, cache, generation, weights, estimate.peak_phase, measured, estimate.peak_bytes, error


def _device_map_rows(gpus: int, caches: list[str]):
    """Each GPU of device_map='auto' against generate() on accelerate's dispatched model."""
    free = free_memory(find_gpu("h100"))
    for family in FAMILIES:
        model = deep_tiny_model(family, 4)
        for cache in caches:
            for generation, lengths in STAND_IN_GENERATIONS.items():
                setup = TrainingSetup(
                    target=Target.CPU,
                    mode="inference",
                    batch_size=2,
                    attn="eager",
                    cache=cache,
                    cache_backend="fp8" if cache == "quantized" else None,
                    device_map=DeviceMap("auto", gpus),
                    **lengths,
                )
                try:
                    result = estimate_device_map(model, setup)
                except UserError:
                    continue
                placed = auto_device_map(model, setup, "auto", [free] * gpus)
                try:
                    peaks = generate_peaks(model, setup, placed)
                except NotImplementedError:  # MoE experts' GPU-only ops (histc of integers)
                    continue
                for report in result.report.ranks:
                    measured = max(by_phase[report.rank.pp] for by_phase in peaks.values())
                    error = (report.peak_bytes - measured) / measured
                    gpu = report.rank.pp
                    yield family, cache, generation, gpu, "fp32", report.peak_phase, measured, report.peak_bytes, error


def _sampling_rows():
    """generate(do_sample=True) against the CPU allocator; the column "weights" names the sampling settings."""
    for family in FAMILIES:
        model = tiny_model(family, vocab_size=SAMPLING_VOCAB)
        for generation, lengths in STAND_IN_GENERATIONS.items():  # the profiler slows each forward down
            for settings, sampling in SAMPLINGS.items():
                setup = TrainingSetup(target=Target.CPU, mode="inference", batch_size=2, sampling=sampling, **lengths)
                estimate = analyze(model, setup)
                measured = max(allocator_phase_peaks(model, setup).values())
                error = (estimate.peak_bytes - measured) / measured
                yield family, "dynamic", generation, settings, estimate.peak_phase, measured, estimate.peak_bytes, error


if __name__ == "__main__":
    main()
