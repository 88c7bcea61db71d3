"""Models that are no transformers id: any ``nn.Module`` a factory builds, trained with the user's own loss.

torchtitan's Llama, a research model, a transformers model with a loss of one's own: whatever runs as
``loss = loss_fn(model, batch); loss.backward(); optimizer.step(); optimizer.zero_grad()`` is traced like a
transformers model, with the same report, layouts and timelines. The setup's variants apply as the frameworks
apply them to such a model: LoRA through peft (name the layers), checkpointing by wrapping each repeated block
in torch's ``checkpoint_wrapper`` (torchtitan's ``apply_ac``), quantized base weights, mixed precision,
accumulation and every optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tracer.errors import UserError
from tracer.step import LossFn, apply_variants, make_token_batch
from tracer.training import TrainingSetup

# ``make_batch(batch_size, seq_len, device)``: the batch the loss function takes.
BatchFn = Callable[[int, int, torch.device | str], Any]

# What a transformers model's outputs and generate() make possible, and a custom loss does not.
_TRANSFORMERS_ONLY = {
    "--mode inference (generate() is transformers')": lambda setup: setup.mode == "inference",
    "--keep-outputs": lambda setup: setup.keep_outputs,
    "--accelerate-prepared": lambda setup: setup.accelerate_prepared,
    "--use-cache on": lambda setup: setup.use_cache,
}


@dataclass(frozen=True)
class CustomModel:
    """A model built by ``factory()`` and trained with ``loss_fn(model, batch)``.

    ``factory`` is called under FakeTensorMode (nothing is allocated) with the setup's dtype as torch's
    default dtype, as transformers builds a model; it must not load weights. ``loss_fn`` is the forward and
    loss of the user's loop, run under the setup's autocast; what it does not return dies when it returns
    (torchtitan's ``pred = model(inputs); loss = loss_fn(pred, labels); del pred``). The batch is token ids
    and labels of ``setup.batch_size x setup.seq_len`` below ``vocab_size`` (a :class:`~tracer.step.Batch`),
    or whatever ``make_batch`` returns. ``tp_plan`` splits the repeated blocks for ``--tp``, in transformers'
    notation (``{"layers.*.attention.wq": "colwise", "layers.*.attention.wo": "rowwise", ...}``); the token
    embedding and the output layer are split over the vocabulary as for transformers models."""

    name: str
    factory: Callable[[], nn.Module]
    loss_fn: LossFn
    vocab_size: int | None = None
    make_batch: BatchFn | None = None
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    source: str = "a Python factory"

    def __post_init__(self) -> None:
        if self.vocab_size is None and self.make_batch is None:
            raise UserError(f"{self.name}: give vocab_size (for token batches) or make_batch.")

    @property
    def model_id(self) -> str:
        return self.name

    @property
    def config(self) -> None:
        """No transformers config: what one would tell (layers to stamp, heads to split) is read off the model."""
        return None

    def check(self, setup: TrainingSetup) -> None:
        """Refuse what only a transformers model's outputs or generate() give."""
        refused = [flag for flag, used in _TRANSFORMERS_ONLY.items() if used(setup)]
        if refused:
            raise UserError(
                f"{', '.join(refused)}: not for a custom model ({self.name}), whose step is its loss function."
            )

    def build(self, setup: TrainingSetup) -> nn.Module:
        self.check(setup)
        with _default_dtype(setup.param_dtype):
            model = self.factory()
        if not isinstance(model, nn.Module):
            raise UserError(f"{self.name}: the factory returned {type(model).__name__}, not an nn.Module.")
        model._tp_plan = dict(self.tp_plan)  # where transformers keeps a model's plan (tracer/modules.py)
        return apply_variants(model, setup)

    def load(self, setup: TrainingSetup, device: torch.device) -> nn.Module:
        """The factory's model built on ``device``: its own code decides what it allocates there."""
        with device:
            return self.build(setup)

    def batch(self, setup: TrainingSetup, device: torch.device | str) -> Any:
        if self.make_batch is not None:
            return self.make_batch(setup.batch_size, setup.seq_len, device)
        return make_token_batch(self.vocab_size, setup, device)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
