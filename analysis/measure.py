"""The reference measurement: run the same step with real tensors and watch what it allocates.

On CUDA it reports ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of a steady-state step run
as users run it, before the recorded one: a recording's dispatch mode changes how autograd sums gradients, and the
segments its step adds to the cache would stay in the reserved peak of any step after it. On
CPU it counts every storage from its allocation to the moment its last reference dies, as
``torch.distributed._tools.mem_tracker`` does, with each allocation rounded as the CUDA caching allocator
rounds it, and reports the largest total at any op of the recorded step, with the gradient sums a run without the
recorder makes in place made so (tracer/gradient_sums.py; tests/test_gradient_sums.py checks each against the
run without it). CPU kernels' own scratch buffers, which never leave the op, are not counted: they are not the
GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from analysis.allocator import block_size
from analysis.estimate import StepResult, analyze
from analysis.peak import find_peak, timeline
from analysis.report import MemoryReport, build_report
from tracer.baseline import register_baseline
from tracer.errors import UserError
from tracer.gradient_sums import as_run
from tracer.graph import build_graph
from tracer.inference import generation_config
from tracer.modules import ModuleScope, count_parameters, model_structure
from tracer.recorder import StepRecorder
from tracer.resolve import Model, as_model
from tracer.roles import Phase
from tracer.step import TrainingStep, build_optimizer
from tracer.trace import Storage
from tracer.training import Target, TrainingSetup
from tracer.units import format_bytes

# Keep this much memory free beyond the predicted peak before running a real step.
HEADROOM_FRACTION = 0.10
HEADROOM_BYTES = 1024**3
# fp16 steps whose gradients overflow are skipped by the GradScaler (it halves its scale instead);
# the steady state, and the step measured, are ones where the optimizer really steps.
MAX_SKIPPED_STEPS = 30


class LiveBytesMeter:
    """Running total of live device bytes, updated at every allocation and free, and its maximum."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def allocated(self, storage: Storage) -> None:
        if storage.on_device:
            self.live += block_size(storage.nbytes)
            self.peak = max(self.peak, self.live)

    def freed(self, storage: Storage) -> None:
        if storage.on_device:
            self.live -= block_size(storage.nbytes)


def require_device(target: Target) -> None:
    if target is Target.CUDA and not torch.cuda.is_available():
        raise UserError("--target cuda needs a CUDA GPU on this machine; use --target cpu to measure on CPU.")


def measure(model: str | Model, setup: TrainingSetup, check_fits: bool = True) -> MemoryReport:
    """Run two real training steps (or generations) and report the memory of the second."""
    return measure_step(model, setup, check_fits).report


def measure_step(model: str | Model, setup: TrainingSetup, check_fits: bool = True) -> StepResult:
    """:func:`measure`, keeping the recorded step and its timeline. ``check_fits`` first asks the estimate
    whether the step fits the free memory; ground truth goes without, so that no estimator fault stops it."""
    require_device(setup.target)
    cuda = setup.target is Target.CUDA
    if not cuda and setup.mode == "inference" and setup.cache.startswith("offloaded"):
        raise UserError(
            f"--cache {setup.cache} moves the cache between a GPU and host memory, which a CPU run cannot tell "
            "apart: measure it with --target cuda on a GPU."
        )
    model = as_model(model)
    if check_fits:
        _refuse_if_too_large(model, setup)
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{setup.expandable_segments}")
    torch.manual_seed(0)
    net = model.load(setup, device)
    batch = model.batch(setup, device)
    if setup.mode == "inference":
        step = Generation(net, setup)
        step.run(batch)  # warm up as for training: first-call allocations are not the steady state
        return _measure_step(model, setup, step, batch, device)
    optimizer = build_optimizer(net, setup, foreach=None)
    autocast = partial(torch.autocast, device.type, dtype=setup.autocast_dtype) if setup.autocast_dtype else None
    scaler = torch.amp.GradScaler(device.type) if setup.mixed_precision == "fp16" else None
    step = TrainingStep(
        net,
        optimizer,
        scaler=scaler,
        keep_outputs=setup.keep_outputs,
        fp32_outputs=setup.fp32_outputs,
        loss_fn=model.loss_fn,
        **({"autocast": autocast} if autocast else {}),
    )
    micro_steps = setup.grad_accum
    if not any(_stepped(lambda: step.run(batch, micro_steps=micro_steps), scaler) for _ in range(MAX_SKIPPED_STEPS)):
        raise UserError(_SKIPPED_MESSAGE)
    for _ in range(MAX_SKIPPED_STEPS):
        result = _measure_step(model, setup, step, batch, device)
        if result is not None:
            return result
    raise UserError(_SKIPPED_MESSAGE)


_SKIPPED_MESSAGE = (
    f"The fp16 GradScaler skipped {MAX_SKIPPED_STEPS} steps in a row (inf/NaN gradients from the random "
    "weights), so no steady-state step could be measured. Measure with --mixed-precision bf16 instead."
)


@dataclass
class Generation:
    """What users run: ``model.generate()`` itself, greedy or sampling, with the cache ``setup.cache`` names, for
    exactly ``setup.max_new_tokens`` tokens (no stop or pad token, so every sequence runs to the end). Each forward
    tells ``on_phase`` whether it is a prefill or a decode step."""

    model: nn.Module
    setup: TrainingSetup
    optimizer: None = None
    scaler: None = None
    kept_outputs: None = None

    def run(self, batch, on_phase=lambda phase: None, micro_steps: int = 1, recorder=None) -> None:
        generation = generation_config(self.model, self.setup)
        # generate() passes logits_to_keep=1 itself; any other choice is the caller's
        chosen = {"logits_to_keep": self.setup.logits_to_keep} if self.setup.logits_to_keep != 1 else {}
        forwards = 0

        def tell_phase(module, args, kwargs) -> None:
            nonlocal forwards
            ids = kwargs.get("input_ids")
            refill = ids is not None and ids.shape[1] > 1  # the whole sequence again (Phi-3: tracer/inference.py)
            on_phase(Phase.PREFILL if forwards == 0 or refill else Phase.DECODE)
            forwards += 1

        # generate() fills a None of the config it is given from the model's own generation config, which would
        # bring the stop token back: the model's config is the one given, for the call.
        own, self.model.generation_config = self.model.generation_config, generation
        handle = self.model.register_forward_pre_hook(tell_phase, with_kwargs=True)
        try:
            ids = self.model.generate(batch.input_ids, generation_config=generation, **chosen)
        finally:
            handle.remove()
            self.model.generation_config = own
        if ids.shape[1] != batch.input_ids.shape[1] + self.setup.max_new_tokens:
            raise RuntimeError(f"generate() made {ids.shape[1] - batch.input_ids.shape[1]} tokens, not the setup's")


def _stepped(run, scaler: torch.amp.GradScaler | None) -> bool:
    """Run one step; False if the GradScaler skipped the optimizer (it lowers its scale when it does)."""
    scale = scaler.get_scale() if scaler is not None else None
    run()
    return scaler is None or scaler.get_scale() >= scale


def _measure_step(model, setup: TrainingSetup, step: TrainingStep, batch, device) -> StepResult | None:
    """Measure one step; None if the GradScaler skipped its optimizer step (then it is not steady state)."""
    cuda = device.type == "cuda"
    if cuda:
        peaks = _plain_step_peaks(setup, step, batch)
        if peaks is None:
            return None
        free, total = torch.cuda.mem_get_info()
        device_used = total - free  # the whole device: other processes count too
    net = step.model
    meter = LiveBytesMeter()
    recorder = StepRecorder(ModuleScope(net), device_type=device.type, listener=meter)
    register_baseline(recorder, step, batch, step_counters_on_host=False)

    with recorder.recording():
        if setup.mode == "inference":
            step.run(batch, recorder.enter, recorder=recorder)
            stepped = True
        else:
            stepped = _stepped(lambda: step.run(batch, recorder.enter, setup.grad_accum), step.scaler)
    if not stepped:
        return None
    trace = recorder.trace()
    trace.parameter_count, trace.trainable_parameter_count = count_parameters(net)
    trace.structure = model_structure(net)
    trace.assumptions = {"model_source": model.source, "torch": torch.__version__, "device": _device_name(device)}
    step_graph = build_graph(as_run(trace, setup))
    line = timeline(step_graph)
    report = build_report(model.model_id, setup, trace, step_graph, line, find_peak(line), kind="measurement")
    report.extra["tracked_peak_bytes"] = meter.peak
    if cuda:
        report.peak_bytes, report.reserved_bytes, report.allocator_retries = peaks
        report.device_total_bytes = device_used
    return StepResult(report, step_graph, line)


def _plain_step_peaks(setup: TrainingSetup, step: TrainingStep, batch) -> tuple[int, int, int] | None:
    """``max_memory_allocated``, ``max_memory_reserved`` and the allocator's retries over one more step, run as users
    run it: without the recorder, whose dispatch mode makes autograd sum a tensor's gradients out of place where a
    plain run sums them in place (tests/test_gradient_sums.py), and before the recorded step, whose cache the
    reserved peak would otherwise carry. None if the GradScaler skipped its optimizer step."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # which leaves num_alloc_retries counting since the process began
    retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    if setup.mode == "inference":
        step.run(batch)
    elif not _stepped(lambda: step.run(batch, micro_steps=setup.grad_accum), step.scaler):
        return None
    torch.cuda.synchronize()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), retries


def _refuse_if_too_large(model: Model, setup: TrainingSetup) -> None:
    predicted = analyze(model, setup).peak_bytes
    available = _available_bytes(setup.target)
    needed = int(predicted * (1 + HEADROOM_FRACTION)) + HEADROOM_BYTES
    if available is not None and needed > available:
        raise UserError(
            f"Measuring needs about {format_bytes(needed)} but only {format_bytes(available)} is free on "
            f"this machine's {setup.target.value}. Use a smaller model, batch or sequence, or "
            "`python -m tracer analyze` for the estimate alone."
        )


def _available_bytes(target: Target) -> int | None:
    if target is Target.CUDA:
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
