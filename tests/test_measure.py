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


def test_a_cuda_measurement_runs_its_plain_step_before_the_recorded_one(monkeypatch):
    """The plain step's peaks are read before the recorder runs its step: the segments the recorded step adds to the
    cache (its gradient sums out of place) would otherwise stay in the plain step's reserved peak, which no user's
    run has. Checked with CPU tensors, the CUDA counters and device stood in for."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    import analysis.measure as measure

    model = tiny_model("llama")
    setup = TrainingSetup(batch_size=1, seq_len=8, target=Target.CPU)
    net = build_model(model.config, setup)
    step = TrainingStep(net, build_optimizer(net, setup, foreach=None))
    batch = make_batch(model.config, setup, "cpu")
    runs = []

    def run(batch, on_phase=lambda phase: None, micro_steps=1):
        runs.append("recorded" if _get_current_dispatch_mode() is not None else "plain")
        TrainingStep.run(step, batch, on_phase, micro_steps)

    def plain_peaks(setup, step, batch):
        step.run(batch)
        return 7, 11, 0

    monkeypatch.setattr(step, "run", run)
    monkeypatch.setattr(measure, "_plain_step_peaks", plain_peaks)
    monkeypatch.setattr(measure, "_device_name", lambda device: "a stand-in GPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1, 3))
    result = measure._measure_step(model, setup, step, batch, torch.device("cuda"))
    assert runs == ["plain", "recorded"]
    assert (result.report.peak_bytes, result.report.reserved_bytes, result.report.device_total_bytes) == (7, 11, 2)
