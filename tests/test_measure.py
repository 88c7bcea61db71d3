"""The CPU measurement against PyTorch's own memory tracker, so the reference itself is checked."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from torch.distributed._tools.mem_tracker import MemTracker

from tracer.baseline import register_baseline
from tracer.modules import ModuleScope
from tracer.recorder import StepRecorder
from tracer.step import TrainingStep, build_model, build_optimizer, make_batch
from tracer.training import Target, TrainingSetup


def _peak_live_bytes(trace) -> int:
    """Largest sum of storage bytes alive at any op, computed directly from the recorded lifetimes."""
    count = len(trace.ops)
    live = [0] * count
    for storage in trace.storages.values():
        first = 0 if storage.created_at is None else storage.created_at
        last = count - 1 if storage.freed_after is None else storage.freed_after
        for index in range(first, last + 1):
            live[index] += storage.nbytes
    return max(live)


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon"])
def test_recorder_sees_what_memtracker_sees(family):
    model = tiny_model(family)
    setup = TrainingSetup(batch_size=2, seq_len=32, target=Target.CPU)
    torch.manual_seed(0)
    net = build_model(model.config, setup)
    optimizer = build_optimizer(net, setup, foreach=None)
    batch = make_batch(model.config, setup, "cpu")
    step = TrainingStep(net, optimizer)
    step.run(batch)

    tracker = MemTracker()
    tracker.track_external(net, optimizer, batch.input_ids, batch.labels)
    with tracker:
        step.run(batch)
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    recorder = StepRecorder(ModuleScope(net), device_type="cpu")
    register_baseline(recorder, step, batch, step_counters_on_host=False)
    with recorder.recording():
        step.run(batch, on_phase=recorder.enter)
    assert _peak_live_bytes(recorder.trace()) == theirs


def test_a_cuda_measurement_reads_a_plain_step(monkeypatch):
    """On CUDA the peaks come from one more step run without the recorder (analysis/measure.py): the step runs
    with no dispatch mode active, and the allocator's counters are read around it. Checked here with CPU tensors
    and the CUDA counters stood in for."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from analysis.measure import _plain_step_peaks

    counters = {"allocated": 7, "reserved": 11, "num_alloc_retries": 2}
    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: counters["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": counters["num_alloc_retries"]})
    model = tiny_model("llama")
    setup = TrainingSetup(batch_size=1, seq_len=8, target=Target.CPU)
    net = build_model(model.config, setup)
    step = TrainingStep(net, build_optimizer(net, setup, foreach=None))
    batch = make_batch(model.config, setup, "cpu")

    def run(batch, on_phase=lambda phase: None, micro_steps=1):
        modes.append(_get_current_dispatch_mode())
        counters["num_alloc_retries"] += 1
        TrainingStep.run(step, batch, on_phase, micro_steps)

    monkeypatch.setattr(step, "run", run)
    assert _plain_step_peaks(setup, step, batch) == (7, 11, 1)
    assert modes == [None]
