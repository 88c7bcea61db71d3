"""Build the model, optimizer and batch for a setup, and run the training step as a user's loop does.

Shared by the estimate (under FakeTensorMode) and by the measurement (real tensors), so both run the same
Python code and differ only in the tensors underneath.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from tracer.checkpointing import enable_checkpointing, unwinding_checkpoints
from tracer.errors import UserError
from tracer.lora import apply_lora
from tracer.materialize import initialize, materialize
from tracer.optimizers import AdamW8bit
from tracer.packed import replace_packed_linears
from tracer.published import PACKED, check_published, counted_as_published, quant_method
from tracer.quantization import quantize_base_weights
from tracer.roles import Phase
from tracer.training import TORCH_OPTIMIZERS, TrainingSetup

# Learning rates and betas do not change memory; torch's defaults are used for everything else.
SGD_MOMENTUM = 0.9
LEARNING_RATE = 1e-5


def attention_implementation(config: PretrainedConfig, setup: TrainingSetup) -> str:
    """The attention path transformers will run: "sdpa" unless asked for eager or the model has no SDPA path."""
    if setup.attn == "eager":
        return "eager"
    model_class = _causal_lm_class(config)
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def build_model(config: PretrainedConfig, setup: TrainingSetup) -> nn.Module:
    """The model as the setup runs it: a GPTQ or AWQ checkpoint's packed layers, quantized base weights, LoRA adapters
    and checkpointing applied."""
    check_published(config, setup)
    config = copy.deepcopy(config)  # the model's own: checkpointing turns its cache off, and traces share configs
    try:
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention_implementation(config, setup), dtype=setup.param_dtype
        )
    except (ValueError, TypeError, RuntimeError) as error:
        raise UserError(f"transformers cannot build this model from its config: {error}") from None
    if setup.use_cache is not None and setup.mode == "train":
        model.config.use_cache = setup.use_cache
    if quant_method(config) in PACKED and counted_as_published(config, setup):
        replace_packed_linears(model, config)
    return apply_variants(model, setup)


def builds_on_meta(config: PretrainedConfig, setup: TrainingSetup) -> bool:
    """Whether the model can be built on the meta device and materialized (tracer/materialize.py): not with quantized
    base weights, which bitsandbytes quantizes as they move to the device, nor a packed checkpoint's layers."""
    return not setup.quantize and not (quant_method(config) in PACKED and counted_as_published(config, setup))


def load_model(
    config: PretrainedConfig,
    setup: TrainingSetup,
    device: torch.device,
    parallelize: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """:func:`build_model` on ``device`` as ``from_pretrained`` loads a checkpoint there: built on the meta device,
    then each weight given its storage once and initialized (tracer/materialize.py). ``parallelize`` (tensor
    parallelism, FSDP2's sharding) runs before the weights get their storage, as torchtitan runs it, so that each
    rank allocates its shards alone. Quantized base weights (bitsandbytes quantizes them as they move to the device)
    and packed checkpoints are built on the device, and parallelized there."""
    on_meta = builds_on_meta(config, setup)
    with torch.device("meta") if on_meta else device:
        model = build_model(config, setup)
    if parallelize is not None:
        parallelize(model)
    if on_meta:
        materialize(model, device)
        initialize(model)
    return model


def apply_variants(model: nn.Module, setup: TrainingSetup) -> nn.Module:
    """The setup's variants on a built model: quantized base weights, checkpointing, then LoRA adapters."""
    if setup.quantize:
        quantize_base_weights(model, setup.quantize)
    if setup.grad_checkpointing:
        enable_checkpointing(model, setup.grad_checkpointing, setup.reentrant)
    if setup.lora:
        model = apply_lora(model, setup.lora)
    return model.eval() if setup.mode == "inference" else model.train()  # dropout runs in training only


def optimizer_recipe(setup: TrainingSetup) -> tuple[type[torch.optim.Optimizer], dict[str, object]]:
    """The optimizer class and its arguments (besides the parameters and the implementation)."""
    if setup.optimizer == "adamw":
        return torch.optim.AdamW, {"lr": LEARNING_RATE}
    if setup.optimizer == "adam":
        return torch.optim.Adam, {"lr": LEARNING_RATE}
    if setup.optimizer == "sgd":
        return torch.optim.SGD, {"lr": LEARNING_RATE, "momentum": SGD_MOMENTUM}
    if setup.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        # As the Trainer builds it for optim="adafactor".
        return Adafactor, {"lr": LEARNING_RATE, "scale_parameter": False, "relative_step": False}
    return AdamW8bit, {"lr": LEARNING_RATE}


def build_optimizer(model: nn.Module, setup: TrainingSetup, foreach: bool | None) -> torch.optim.Optimizer:
    """The optimizer over trainable parameters. ``foreach`` is the default implementation to ask torch's
    optimizers for (None lets torch pick for the tensors' device); ``setup.optimizer_impl`` overrides it."""
    optimizer_class, arguments = optimizer_recipe(setup)
    params = [p for p in model.parameters() if p.requires_grad]
    if setup.optimizer not in TORCH_OPTIMIZERS:
        return optimizer_class(params, **arguments)
    if setup.optimizer_impl == "fused":
        return optimizer_class(params, fused=True, **arguments)
    if setup.optimizer_impl is not None:
        foreach = setup.optimizer_impl == "foreach"
    return optimizer_class(params, foreach=foreach, **arguments)


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor


def make_batch(config: PretrainedConfig, setup: TrainingSetup, device: torch.device | str) -> Batch:
    return make_token_batch(config.vocab_size, setup, device)


def make_token_batch(vocab_size: int, setup: TrainingSetup, device: torch.device | str) -> Batch:
    """Token ids and labels as a data collator hands them over: two separate int64 tensors."""
    shape = (setup.batch_size, setup.seq_len)
    input_ids = torch.randint(0, vocab_size, shape, device=device)
    return Batch(input_ids=input_ids, labels=input_ids.clone())


def batch_tensors(batch: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a batch holds, named: a :class:`Batch`'s fields, or those of a custom model's batch (a
    tensor, a dataclass, a mapping, a tuple or a list of them, nested)."""
    if isinstance(batch, torch.Tensor):
        yield "batch", batch
        return
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = ((field.name, getattr(batch, field.name)) for field in dataclasses.fields(batch))
    elif isinstance(batch, Mapping):
        items = ((str(key), value) for key, value in batch.items())
    elif isinstance(batch, tuple | list):
        items = ((str(index), value) for index, value in enumerate(batch))
    else:
        return
    for name, value in items:
        for inner, tensor in batch_tensors(value):
            yield (name if inner == "batch" else f"{name}.{inner}"), tensor


OnPhase = Callable[[Phase], None]
# A custom model's forward and loss, ``loss_fn(model, batch) -> loss`` (tracer/custom.py).
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class TrainingStep:
    """``loss = model(input_ids, labels=labels).loss; loss.backward(); optimizer.step();
    optimizer.zero_grad(set_to_none=True)``; with a gradient scaler for fp16 mixed precision.

    ``keep_outputs``: the loop holds the model's outputs (``outputs = model(**batch)``, as accelerate's
    examples write it) until the next forward returns new ones, so the logits, and the key/value cache
    transformers returns in training without checkpointing, live through backward and the optimizer step
    into the next step's forward. The Trainer drops them before backward. ``fp32_outputs``: the forward is
    wrapped as accelerate wraps it under mixed precision, its bf16/fp16 outputs copied to fp32."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Callable[[], AbstractContextManager] = nullcontext
    scaler: torch.amp.GradScaler | None = None
    keep_outputs: bool = False
    kept_outputs: ModelOutput | None = None
    fp32_outputs: bool = False  # accelerate's convert_outputs_to_fp32 around the forward
    loss_fn: LossFn | None = None  # a custom model's forward and loss (tracer/custom.py); None: outputs.loss

    def forward(self, batch: Batch) -> ModelOutput:
        with self.autocast(), unwinding_checkpoints():
            outputs = self.model(batch.input_ids, labels=batch.labels)
        if self.fp32_outputs:
            from accelerate.utils.operations import convert_to_fp32

            outputs = convert_to_fp32(outputs)
        return outputs

    def loss(self, batch: Batch) -> torch.Tensor:
        """The forward and its loss; the outputs are kept only if the loop keeps them."""
        if self.loss_fn is not None:
            with self.autocast(), unwinding_checkpoints():
                return self.loss_fn(self.model, batch)
        outputs = self.forward(batch)
        self.kept_outputs = outputs if self.keep_outputs else None
        return outputs.loss

    def run(self, batch: Batch, on_phase: OnPhase = lambda phase: None, micro_steps: int = 1) -> None:
        """One optimizer step after ``micro_steps`` forward and backward passes (gradient accumulation)."""
        for _ in range(micro_steps):
            on_phase(Phase.FORWARD)
            loss = self.loss(batch)
            if micro_steps > 1:
                loss = loss / micro_steps
            on_phase(Phase.BACKWARD)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        on_phase(Phase.OPTIMIZER)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    def prime(self, batch: Batch) -> None:
        """Reach the steady state without running the model: one optimizer step on zero gradients creates
        the optimizer state (and the GradScaler's scale) exactly as a first real step would; a loop that keeps
        its outputs holds the previous step's: those of a forward with autograd (transformers drops the key/value
        cache under checkpointing only then), without the graph, which that step's backward freed."""
        if self.keep_outputs:
            self.kept_outputs = _without_graph(self.forward(batch))
        params = [p for p in self.model.parameters() if p.requires_grad]
        for param in params:
            param.grad = torch.zeros_like(param)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.scale(torch.zeros((), device=params[0].device))
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


def _causal_lm_class(config: PretrainedConfig) -> type:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def output_slots(outputs: ModelOutput) -> Iterator[tuple[str, int | None, object, str]]:
    """Where a model's outputs hold tensors: (field, cache layer index or None, holder, attribute). The fields'
    own tensors (loss, logits), and each cache layer's keys and values."""
    for key, value in outputs.items():
        if isinstance(value, torch.Tensor):
            yield key, None, outputs, key
        elif isinstance(value, Cache):
            for index, layer in enumerate(value.layers):
                for attribute, tensor in vars(layer).items():
                    if isinstance(tensor, torch.Tensor):
                        yield key, index, layer, attribute


def _without_graph(outputs: ModelOutput) -> ModelOutput:
    """The model's outputs with every tensor, the cache's included, detached from the autograd graph."""
    for _, _, holder, attribute in output_slots(outputs):
        setattr(holder, attribute, getattr(holder, attribute).detach())  # ModelOutput keeps its dict in step
    return outputs
