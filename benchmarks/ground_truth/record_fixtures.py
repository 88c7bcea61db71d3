"""Record CUDA traces of tiny models as fixtures, on a GPU machine.

    python -m benchmarks.ground_truth.record_fixtures [--out tests/fixtures/cuda]

FakeTensorMode can trace with ``device="cuda"`` only where CUDA is available; there the real CUDA dispatch
decisions show: CUDA autocast's dtypes, the SDPA kernel chosen and what it saves, cross-entropy's buffers.
Each fixture keeps, per op, its target, phase and the storages it created (bytes, dtype, shape), and the peak
of the step; tests/test_cuda_fixtures.py compares ``analyze --target cuda`` (the emulation that runs on CPU)
with them. Nothing is allocated: the tensors are fake.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from tiny_models import TINY_CONFIGS, tiny_model
from torch._subclasses.fake_tensor import FakeTensorMode

from analysis.peak import find_peak, timeline
from tracer.baseline import register_baseline
from tracer.graph import build_graph
from tracer.meta_fixes import MetaFixes
from tracer.modules import ModuleScope
from tracer.recorder import StepRecorder
from tracer.step import TrainingStep, build_model, build_optimizer, make_batch
from tracer.trace import Trace
from tracer.tracing import as_eager
from tracer.training import TrainingSetup

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "cuda"
FAMILIES = ("llama", "qwen2", "gpt2", "gpt_neox", "gemma2", "opt")
SETUPS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"dtype": "bf16"},
    "amp-bf16": {"mixed_precision": "bf16"},
    "amp-bf16-eager": {"mixed_precision": "bf16", "attn": "eager"},
    "amp-bf16-ckpt": {"mixed_precision": "bf16", "grad_checkpointing": "full"},
}
BATCH, SEQ = 2, 64


def trace_on_cuda(family: str, setup: TrainingSetup) -> Trace:
    """The training step under FakeTensorMode with every tensor on the CUDA device: no emulation."""
    model = tiny_model(family)
    with FakeTensorMode(), MetaFixes(), as_eager(), torch.device("cuda"):
        net = build_model(model.config, setup)
        batch = make_batch(model.config, setup, "cuda")
        autocast = partial(torch.autocast, "cuda", dtype=setup.autocast_dtype) if setup.autocast_dtype else None
        # foreach, as torch picks it for real CUDA parameters; under FakeTensorMode its check of the tensor type
        # fails and it would pick the per-parameter loop no real run takes
        optimizer = build_optimizer(net, setup, foreach=True)
        step = TrainingStep(net, optimizer, **({"autocast": autocast} if autocast else {}))
        step.prime(batch)
        recorder = StepRecorder(ModuleScope(net), device_type="cuda")
        register_baseline(recorder, step, batch, step_counters_on_host=True)
        with recorder.recording():
            step.run(batch, on_phase=recorder.enter)
    return recorder.trace()


def fixture(family: str, setup_name: str) -> dict[str, Any]:
    setup = TrainingSetup(batch_size=BATCH, seq_len=SEQ, **SETUPS[setup_name])
    trace = trace_on_cuda(family, setup)
    step = build_graph(trace)
    ops = []
    for op in trace.ops:
        created = [trace.storages[s] for s in op.outputs if trace.storages[s].created_at == op.index]
        ops.append(
            {
                "target": op.target,
                "phase": op.phase.value,
                "outputs": [[s.nbytes, s.dtype, list(s.shape)] for s in created if s.on_device],
            }
        )
    return {
        "family": family,
        "config": TINY_CONFIGS[family],
        "setup": SETUPS[setup_name],
        "batch_size": BATCH,
        "seq_len": SEQ,
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peak_bytes": find_peak(timeline(step)).bytes,
        "ops": ops,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES, help="folder for the fixtures (default %(default)s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        message = "recording CUDA fixtures needs a CUDA GPU (FakeTensorMode traces device='cuda' only there)"
        print(f"error: {message}.", file=sys.stderr)
        return 2
    transformers.logging.set_verbosity_error()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for family in FAMILIES:
        for setup_name in SETUPS:
            path = args.out / f"{family}__{setup_name}.json"
            try:
                recorded = fixture(family, setup_name)
            except Exception as error:  # one family's failure must not cost the others' fixtures
                failed.append(path.stem)
                print(f"{path.stem} failed: {type(error).__name__}: {error}", file=sys.stderr)
                continue
            path.write_text(json.dumps(recorded, separators=(",", ":")))
            print(f"wrote {path}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
