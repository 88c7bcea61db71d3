"""Inference over a device map: one trace of ``generate()`` with accelerate's placement and hooks
(tracer/device_map.py), read per GPU. Each GPU's step is the trace's ops with that GPU's storages only: its modules'
weights, its layers' cache, what its layers compute, the copies its hooks receive, and, on the first GPU, generate()'s
own tensors."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from analysis.estimate import StepResult, busiest, rank_estimate
from strategies.layout import Layout, Rank
from tracer.errors import UserError
from tracer.graph import build_graph
from tracer.published import counted_as_published, quant_method
from tracer.resolve import Model, as_model
from tracer.trace import Trace
from tracer.tracing import Progress, trace_step
from tracer.training import TrainingSetup


@dataclass(frozen=True)
class DeviceMapLayout(Layout):
    """The GPUs of a device map, each a stage of the model run one after another (``Rank.pp`` is the GPU)."""

    strategy: str = "auto"

    def describe(self) -> str:
        return (
            f'{self.gpus} GPUs: accelerate device_map="{self.strategy}" (whole layers on each GPU, run one GPU '
            "after another)"
        )

    def to_json(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "device_map": self.strategy}


def estimate_device_map(model: str | Model, setup: TrainingSetup, progress: Progress | None = None) -> StepResult:
    """The busiest GPU's result under ``setup.device_map``, carrying every GPU's report."""
    model = as_model(model)
    device_map = setup.device_map
    if device_map is None or setup.mode != "inference":
        raise UserError("A device map places a model for generation: give --mode inference --device-map auto.")
    _refuse_quantized(model, setup)
    trace = trace_step(model, setup, progress, every_gpu=True)
    layout = DeviceMapLayout(gpus=device_map.gpus, pp=device_map.gpus, strategy=device_map.strategy)
    estimates = []
    for device in range(device_map.gpus):
        if progress is not None:
            progress("each GPU's peak", device, device_map.gpus)
        on_device = gpu_trace(trace, device)
        step = build_graph(on_device)
        estimates.append(rank_estimate(model.model_id, setup, layout, on_device, Rank(pp=device), step))
    return busiest(estimates, layout)


def _refuse_quantized(model: Model, setup: TrainingSetup) -> None:
    """Quantized weights change how from_pretrained sizes modules and GPUs for the placement (its quantizer's
    ``param_element_size`` and ``adjust_max_memory``), which is not modelled."""
    config = getattr(model, "config", None)
    published = counted_as_published(config, setup)
    if setup.quantize or published:
        what = "--quantize" if setup.quantize else f"the checkpoint's {quant_method(config)} weights"
        fix = "drop --quantize" if setup.quantize else "add --dequantize"
        raise UserError(
            f"--device-map with {what} is not modelled: transformers' quantizer sizes the modules it places "
            f"(param_element_size, adjust_max_memory); {fix}, or use --tp."
        )


def gpu_trace(trace: Trace, device: int) -> Trace:
    """The trace with the storages of GPU ``device`` only (and the host copies it made)."""
    storages = {key: storage for key, storage in trace.storages.items() if storage.device == device}
    return dataclasses.replace(trace, storages=storages)
