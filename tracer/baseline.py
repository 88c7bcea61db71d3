"""Storages that exist before the recorded step starts: parameters, buffers, optimizer state, inputs."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers.utils import ModelOutput

from tracer.modules import decoder_blocks
from tracer.recorder import StepRecorder
from tracer.roles import Role
from tracer.step import Batch, TrainingStep, batch_tensors, output_slots

GRAD_SCALER_STATE = ("_scale", "_growth_tracker")


def register_baseline(recorder: StepRecorder, step: TrainingStep, batch: Batch, step_counters_on_host: bool) -> None:
    """Tell the recorder what lives before the step. ``step_counters_on_host`` keeps the optimizers'
    0-dim ``step`` tensors off the device, as on CUDA without ``capturable``/``fused``."""
    model, optimizer = step.model, step.optimizer
    names = {id(p): name for name, p in model.named_parameters()}
    for name, param in model.named_parameters():
        recorder.track_existing(param, Role.PARAMETER, name)
    for name, buffer in model.named_buffers():
        recorder.track_existing(buffer, Role.BUFFER, name)
    if step.scaler is not None:
        for name in GRAD_SCALER_STATE:
            recorder.track_existing(getattr(step.scaler, name), Role.OPTIMIZER_STATE, f"GradScaler.{name}")
    for param, state in optimizer.state.items() if optimizer is not None else ():
        param_name = names[id(param)]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                on_device = not (step_counters_on_host and key == "step")
                recorder.track_existing(
                    value, Role.OPTIMIZER_STATE, f"{param_name}.{key}", param=param_name, on_device=on_device
                )
    for name, tensor in batch_tensors(batch):
        recorder.track_existing(tensor, Role.INPUT, name)
    if step.kept_outputs is not None:
        for name, tensor in _output_tensors(step.kept_outputs, decoder_blocks(model)):
            recorder.track_existing(tensor, Role.ACTIVATION, f"previous step's outputs: {name}")


def _output_tensors(outputs: ModelOutput, blocks: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a model's outputs hold, a cache layer's named after the decoder block that made them."""
    for key, index, holder, attribute in output_slots(outputs):
        name = key if index is None else f"{key} {attribute} of {blocks[index]}"
        yield name, getattr(holder, attribute)
