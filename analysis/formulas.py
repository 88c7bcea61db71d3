"""The analytic estimates people use instead of a trace, ported from their sources, for comparison.

* Rule of thumb: 16 bytes per parameter (fp16 weights and gradients, fp32 master weights and two Adam
  moments: the ZeRO paper's K = 12 plus 2 + 2, arXiv 1910.02054), nothing for activations.
* DeepSpeed's model-state estimators (``estimate_zero2_model_states_mem_needs`` and
  ``estimate_zero3_model_states_mem_needs`` in deepspeed/runtime/zero/): 2P + 18P/N for ZeRO-1/2 (and
  plain data parallelism, N = 1), 4 x largest layer + 18P/N for ZeRO-3; no activations.
* Hugging Face accelerate's ``estimate-memory`` (accelerate/commands/estimate.py,
  ``estimate_training_usage``): the largest of its stage figures for Adam at batch size 1; fp32:
  4 x the fp32 model size; fp16/bf16: 2 x the fp32 model size.
* LLMem (github.com/taehokim20/LLMem, ``size_estimator.py``, ``SizeEstimator``): the model as loaded, fp32
  optimizer moments and the fp16 outputs of every Linear and Embedding module and decoder layer, each tensor
  rounded up to 2 MiB, plus the logits and two shifted copies; ZeRO-3 data parallelism divides states.
* Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198),
  activations per layer in 16-bit: s·b·h·(34 + 5·a·s/h) without recomputation, 34·s·b·h with selective
  recomputation, 2·s·b·h with full recomputation; tensor parallelism t divides the 24 sbh inside the
  attention and MLP (and everything with sequence parallelism).

Each estimate is split into the categories of analysis/categories.py as its source splits it, so that
``tracer compare`` can set each part beside the trace's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from analysis.categories import Category
from strategies.layout import Layout
from tracer.modules import decoder_blocks
from tracer.resolve import ResolvedModel
from tracer.step import build_model
from tracer.training import TrainingSetup
from tracer.units import format_bytes

RULE_OF_THUMB_BYTES_PER_PARAMETER = 16
LLMEM_ROUNDING = 2 * 1024**2  # SizeEstimator.base_size
LLMEM_ACTIVATION_BYTES = 2  # SizeEstimator.bytes: fp16
LLMEM_INPUT_BYTES = 4  # SizeEstimator.bytes_input


@dataclass(frozen=True)
class Term:
    bytes: int
    assumes: str  # what the formula takes the category to hold


@dataclass(frozen=True)
class FormulaEstimate:
    name: str
    source: str
    terms: dict[Category, Term]  # the categories it counts; empty where it does not cover the setup
    total: int | None  # its figure for the whole: the sum of the terms, except where the source says otherwise
    why_not: str = ""  # why it does not cover the setup
    # what its figure stands for: a category in here without a term is memory the formula misses
    accounts_for: tuple[Category, ...] = tuple(Category)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "total_bytes": self.total,
            "terms": {category.value: {"bytes": t.bytes, "assumes": t.assumes} for category, t in self.terms.items()},
            **({"not_covered": self.why_not} if self.why_not else {}),
        }


def _summed(name: str, source: str, terms: dict[Category, Term], **options: Any) -> FormulaEstimate:
    return FormulaEstimate(name, source, terms, sum(term.bytes for term in terms.values()), **options)


@dataclass(frozen=True)
class ModelShape:
    """What the formulas read off the model: counts and dimensions, nothing traced."""

    parameters: int
    trainable: int
    largest_layer_parameters: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    # Linear and Embedding modules in module order, as LLMem walks them: (kind, output features, sizes of
    # their parameters)
    linear_outputs: tuple[tuple[str, int, tuple[int, ...]], ...]


def model_shape(model: ResolvedModel, setup: TrainingSetup) -> ModelShape:
    with torch.device("meta"):
        net = build_model(model.config, setup)
    blocks = decoder_blocks(net)
    largest = max((sum(p.numel() for p in net.get_submodule(b).parameters()) for b in blocks), default=0)
    embedding = net.get_input_embeddings()
    largest = max(largest, sum(p.numel() for p in embedding.parameters()))
    outputs = []
    for module in net.modules():
        sizes = tuple(p.numel() for p in module.parameters())
        if isinstance(module, nn.Embedding):
            outputs.append(("embedding", module.embedding_dim, sizes))
        elif type(module) is nn.Linear:
            outputs.append(("linear", module.out_features, sizes))
    config = model.config
    return ModelShape(
        parameters=sum(p.numel() for p in net.parameters()),
        trainable=sum(p.numel() for p in net.parameters() if p.requires_grad),
        largest_layer_parameters=largest,
        layers=len(blocks),
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        vocab=config.vocab_size,
        linear_outputs=tuple(outputs),
    )


def rule_of_thumb(shape: ModelShape) -> FormulaEstimate:
    """The ZeRO paper's split of its 16 bytes: 2 + 2 + K = 12."""
    p = shape.parameters
    return _summed(
        "16 B/param",
        "rule of thumb: 16 bytes per parameter for mixed-precision Adam (ZeRO paper, arXiv 1910.02054)",
        {
            Category.PARAMETERS: Term(2 * p, "16-bit weights, 2 bytes per parameter"),
            Category.GRADIENTS: Term(2 * p, "16-bit gradients, 2 bytes per parameter"),
            Category.OPTIMIZER_STATES: Term(
                12 * p, "fp32 master weights, momentum and variance, 12 bytes per parameter"
            ),
        },
    )


def deepspeed_model_states(shape: ModelShape, layout: Layout) -> FormulaEstimate:
    """Split as the comment in ``estimate_zero2_model_states_mem_needs`` splits its 18 bytes (2 16-bit and
    4 fp32 gradient bytes, 4 fp32 weight and 8 moment bytes); ZeRO-3's estimator uses the same 18 and adds
    16-bit weights and gradients of the largest layer."""
    p = shape.parameters
    gpus = layout.dp if layout.zero else 1
    sharded = 18 * p // gpus  # int(18 * total_params / total_gpus)
    gradients = 6 * p // gpus
    per_gpu = f", over {gpus} GPUs" if gpus > 1 else ""
    optimizer = Term(
        sharded - gradients, f"fp32 master weights, momentum and variance, 12 bytes per parameter{per_gpu}"
    )
    if layout.zero == 3:
        largest = shape.largest_layer_parameters
        terms = {
            Category.PARAMETERS: Term(2 * largest, "16-bit weights of the largest layer, gathered"),
            Category.GRADIENTS: Term(
                2 * largest + gradients,
                f"16-bit gradients of the largest layer, and 6 bytes per parameter (16-bit and fp32){per_gpu}",
            ),
            Category.OPTIMIZER_STATES: optimizer,
        }
        source = "deepspeed estimate_zero3_model_states_mem_needs"
    else:
        terms = {
            Category.PARAMETERS: Term(2 * p, "16-bit weights, 2 bytes per parameter"),
            Category.GRADIENTS: Term(gradients, f"16-bit and fp32 gradients, 6 bytes per parameter{per_gpu}"),
            Category.OPTIMIZER_STATES: optimizer,
        }
        source = "deepspeed estimate_zero2_model_states_mem_needs"
    return _summed("DeepSpeed", source, terms)


def accelerate_training(shape: ModelShape, setup: TrainingSetup) -> FormulaEstimate:
    """``estimate_training_usage``'s stages for Adam at batch size 1; its figure is the largest stage
    (``step``: all three for fp32, the optimizer alone for mixed precision), not their sum."""
    fp32_size = 4 * shape.parameters
    low_precision = setup.dtype != "fp32" or setup.mixed_precision is not None
    gradients = (
        Term(fp32_size + fp32_size // 2, "16-bit and fp32 gradients, 6 bytes per parameter")
        if low_precision
        else Term(fp32_size, "fp32 gradients, 4 bytes per parameter")
    )
    terms = {
        Category.PARAMETERS: Term(fp32_size, "fp32 weights, 4 bytes per parameter"),
        Category.GRADIENTS: gradients,
        Category.OPTIMIZER_STATES: Term(2 * fp32_size, "Adam's momentum and variance, 8 bytes per parameter"),
    }
    total = 2 * fp32_size if low_precision else 4 * fp32_size
    return FormulaEstimate("accelerate", "accelerate estimate-memory (estimate_training_usage)", terms, total)


def _llmem_round(nbytes: float) -> int:
    return int(-(-nbytes // LLMEM_ROUNDING) * LLMEM_ROUNDING)


def llmem(shape: ModelShape, setup: TrainingSetup, layout: Layout) -> FormulaEstimate:
    """SizeEstimator.estimate_size for the data-parallel (ZeRO-3) or single-GPU case; not for TP."""
    name, source = "LLMem", "LLMem SizeEstimator (github.com/taehokim20/LLMem)"
    if layout.tp > 1:
        return FormulaEstimate(name, source, {}, None, "LLMem models data parallelism only, not tensor parallelism")
    gpus = layout.dp
    batch, seq = setup.batch_size, setup.seq_len
    model_init = 2 * shape.parameters // gpus  # m_init: the fp16 model as loaded (measured by LLMem)
    gathered, moments = _llmem_parameter_bytes(shape, gpus)
    activations, logits = _llmem_output_bytes(shape, batch, seq)
    return _summed(
        name,
        source,
        {
            Category.PARAMETERS: Term(
                model_init + gathered,
                "the fp16 model as loaded and the output layer's fp16 copy"
                + (", and the weights ZeRO-3 gathers" if gpus > 1 else ""),
            ),
            Category.OPTIMIZER_STATES: Term(
                moments, "two fp32 moments of each weight but the last, 8 bytes per parameter"
            ),
            Category.ACTIVATIONS: Term(
                activations, "fp16 outputs of every Linear and Embedding and each layer's input, in 2 MiB blocks"
            ),
            Category.LOGITS_AND_LOSS: Term(logits, "fp16 logits and two copies shifted by one token"),
            Category.OTHER: Term(_llmem_round(batch * seq * LLMEM_INPUT_BYTES), "the input ids"),
        },
    )


def _llmem_parameter_bytes(shape: ModelShape, gpus: int) -> tuple[int, int]:
    """param_bytes(), as (weights, moments): per Linear/Embedding weight (the last, the lm_head, only its fp16
    copy) its fp16 share on other ranks under ZeRO-3, and two fp32-sized moments of its shard."""
    weights = moments = 0
    sizes = [numel for _, _, numels in shape.linear_outputs for numel in numels]
    for index, numel in enumerate(sizes):
        if index == len(sizes) - 1:
            weights += _llmem_round(numel * 2)
            continue
        if gpus > 1:
            weights += _llmem_round(numel * 2 * (gpus - 1) / gpus)
        moments += 2 * _llmem_round(numel * 2 * 2 / gpus)
    return weights, moments


def _llmem_output_bytes(shape: ModelShape, batch: int, seq: int) -> tuple[int, int]:
    """calc_output_bytes(), as (activations, logits): fp16 outputs of embeddings (twice), Linear modules and
    decoder layer inputs; then the logits and two copies shifted by one token."""
    tokens = batch * seq
    sizes = [tokens * shape.hidden] * max(shape.layers - 1, 0)
    for kind, features, _ in shape.linear_outputs[:-1]:
        sizes += [tokens * features] * (2 if kind == "embedding" else 1)
    activations = sum(_llmem_round(numel * LLMEM_ACTIVATION_BYTES) for numel in sizes)
    logits = _llmem_round(tokens * shape.vocab * LLMEM_ACTIVATION_BYTES)
    logits += 2 * _llmem_round(batch * (seq - 1) * shape.vocab * LLMEM_ACTIVATION_BYTES)
    return activations, logits


def korthikanti_activations(shape: ModelShape, setup: TrainingSetup, layout: Layout) -> FormulaEstimate:
    s, b, h, a, t = setup.seq_len, setup.batch_size, shape.hidden, shape.heads, layout.tp
    scores = 0 if setup.grad_checkpointing else 5 * a * s * s * b / t  # attention scores, softmax, dropout mask
    if setup.grad_checkpointing == "full":
        per_layer, assumes = 2 * s * b * h, "each layer's 16-bit input (full recomputation: 2sbh per layer)"
    elif layout.sequence_parallel:
        per_layer, assumes = s * b * h * 34 / t + scores, "a 16-bit GPT layer: (34sbh + 5as^2b) / t per layer"
    else:
        per_layer, assumes = s * b * h * (10 + 24 / t) + scores, "a 16-bit GPT layer: 34sbh + 5as^2b per layer"
        if t > 1:
            assumes = "a 16-bit GPT layer: (10 + 24/t)sbh + 5as^2b/t per layer"
    if scores:
        assumes += f", {format_bytes(int(shape.layers * scores))} of it attention scores, softmax and dropout mask"
    elif setup.grad_checkpointing == "selective":
        assumes = "a 16-bit GPT layer without its attention scores (selective recomputation: 34sbh per layer)"
    terms = {Category.ACTIVATIONS: Term(int(shape.layers * per_layer), assumes)}
    source = "Korthikanti et al., arXiv 2205.05198: the activations a transformer layer saves"
    return _summed("Korthikanti", source, terms, accounts_for=(Category.ACTIVATIONS, Category.LOGITS_AND_LOSS))


def formula_estimates(shape: ModelShape, setup: TrainingSetup, layout: Layout) -> list[FormulaEstimate]:
    return [
        rule_of_thumb(shape),
        deepspeed_model_states(shape, layout),
        accelerate_training(shape, setup),
        llmem(shape, setup, layout),
        korthikanti_activations(shape, setup, layout),
    ]
