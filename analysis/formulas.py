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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tabulate import tabulate
from torch import nn

from analysis.report import MemoryReport
from analysis.units import format_bytes
from strategies.layout import Layout
from tracer.modules import decoder_blocks
from tracer.resolve import ResolvedModel
from tracer.step import build_model
from tracer.training import TrainingSetup

RULE_OF_THUMB_BYTES_PER_PARAMETER = 16
LLMEM_ROUNDING = 2 * 1024**2  # SizeEstimator.base_size
LLMEM_ACTIVATION_BYTES = 2  # SizeEstimator.bytes: fp16
LLMEM_INPUT_BYTES = 4  # SizeEstimator.bytes_input


@dataclass(frozen=True)
class FormulaEstimate:
    name: str
    bytes: int | None  # None where the formula does not cover the setup
    covers: str  # what it counts


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


def rule_of_thumb(shape: ModelShape) -> int:
    return RULE_OF_THUMB_BYTES_PER_PARAMETER * shape.parameters


def deepspeed_model_states(shape: ModelShape, layout: Layout) -> int:
    gpus = layout.dp
    if layout.zero == 3:
        return 4 * shape.largest_layer_parameters + int(18 * shape.parameters / gpus)
    return 2 * shape.parameters + int(18 * shape.parameters / (gpus if layout.zero else 1))


def accelerate_training(shape: ModelShape, setup: TrainingSetup) -> int:
    fp32_size = 4 * shape.parameters
    low_precision = setup.dtype != "fp32" or setup.mixed_precision is not None
    return 2 * fp32_size if low_precision else 4 * fp32_size


def _llmem_round(nbytes: float) -> int:
    return int(-(-nbytes // LLMEM_ROUNDING) * LLMEM_ROUNDING)


def llmem(shape: ModelShape, setup: TrainingSetup, layout: Layout) -> int | None:
    """SizeEstimator.estimate_size for the data-parallel (ZeRO-3) or single-GPU case; None with TP."""
    if layout.tp > 1:
        return None
    gpus = layout.dp
    batch, seq = setup.batch_size, setup.seq_len
    model_init = 2 * shape.parameters / gpus  # m_init: the fp16 model as loaded (measured by LLMem)
    return int(
        model_init
        + _llmem_parameter_bytes(shape, gpus)
        + _llmem_round(batch * seq * LLMEM_INPUT_BYTES)
        + _llmem_output_bytes(shape, batch, seq)
    )


def _llmem_parameter_bytes(shape: ModelShape, gpus: int) -> int:
    """param_bytes(): per Linear/Embedding weight (the last, the lm_head, only its fp16 copy): its fp16
    share on other ranks under ZeRO-3, and two fp32-sized moments of its shard."""
    total = 0
    weights = [numel for _, _, sizes in shape.linear_outputs for numel in sizes]
    for index, numel in enumerate(weights):
        if index == len(weights) - 1:
            total += _llmem_round(numel * 2)
            continue
        if gpus > 1:
            total += _llmem_round(numel * 2 * (gpus - 1) / gpus)
        total += 2 * _llmem_round(numel * 2 * 2 / gpus)
    return total


def _llmem_output_bytes(shape: ModelShape, batch: int, seq: int) -> int:
    """calc_output_bytes(): fp16 outputs of embeddings (twice), Linear modules and decoder layer inputs,
    then the logits and two copies shifted by one token."""
    tokens = batch * seq
    sizes = [tokens * shape.hidden] * max(shape.layers - 1, 0)
    for kind, features, _ in shape.linear_outputs[:-1]:
        sizes += [tokens * features] * (2 if kind == "embedding" else 1)
    total = sum(_llmem_round(numel * LLMEM_ACTIVATION_BYTES) for numel in sizes)
    total += _llmem_round(tokens * shape.vocab * LLMEM_ACTIVATION_BYTES)
    total += 2 * _llmem_round(batch * (seq - 1) * shape.vocab * LLMEM_ACTIVATION_BYTES)
    return total


def korthikanti_activations(shape: ModelShape, setup: TrainingSetup, layout: Layout) -> int:
    s, b, h, a, t = setup.seq_len, setup.batch_size, shape.hidden, shape.heads, layout.tp
    if setup.grad_checkpointing == "full":
        per_layer = 2 * s * b * h
    elif layout.sequence_parallel:
        per_layer = s * b * h * 34 / t + (0 if setup.grad_checkpointing else 5 * a * s * s * b / t)
    else:
        per_layer = s * b * h * (10 + 24 / t) + (0 if setup.grad_checkpointing else 5 * a * s * s * b / t)
    return int(shape.layers * per_layer)


def formula_estimates(model: ResolvedModel, setup: TrainingSetup, layout: Layout) -> list[FormulaEstimate]:
    shape = model_shape(model, setup)
    return [
        FormulaEstimate("16 bytes/parameter", rule_of_thumb(shape), "model states"),
        FormulaEstimate("DeepSpeed model states", deepspeed_model_states(shape, layout), "model states"),
        FormulaEstimate("accelerate estimate-memory", accelerate_training(shape, setup), "model states"),
        FormulaEstimate("LLMem", llmem(shape, setup, layout), "model states, activations"),
        FormulaEstimate("Korthikanti et al.", korthikanti_activations(shape, setup, layout), "activations"),
    ]


def render_comparison(report: MemoryReport, formulas: list[FormulaEstimate]) -> str:
    """Ours beside each formula, with a line on what each leaves out that the trace holds at the peak."""
    ours = report.peak_bytes
    breakdown = report.breakdown
    states = sum(breakdown.get(key, 0) for key in ("parameters", "gradients", "optimizer_states"))
    rows = [("ours (trace)", format_bytes(ours), "", "everything allocated at the peak")]
    notes = []
    for formula in formulas:
        if formula.bytes is None:
            rows.append((formula.name, "n/a", "", f"{formula.covers} (not for this layout)"))
            continue
        difference = 100 * (formula.bytes - ours) / ours
        rows.append((formula.name, format_bytes(formula.bytes), f"{difference:+.1f}%", formula.covers))
        if formula.covers == "model states" and ours - states > 0.05 * ours:
            notes.append(
                f"- {formula.name} counts model states only: the peak also holds {format_bytes(ours - states)} of "
                f"activations, temporaries and buffers ({100 * (ours - states) / ours:.0f}% of it)."
            )
        elif formula.covers == "activations":
            saved = breakdown.get("activations", 0)
            notes.append(
                f"- {formula.name} counts saved activations in 16-bit for a standard block: "
                f"{format_bytes(formula.bytes)} against {format_bytes(saved)} of activations in the trace at the "
                "peak (fp32 upcasts, logits and the loss are outside the formula)."
            )
    logits = [g for g in report.largest_at_peak if "lm_head" in g.get("where", "") or "loss" in g.get("made_by", "")]
    if logits:
        size = sum(g["bytes"] for g in logits)
        notes.append(f"- Logits and loss buffers live at the peak: {format_bytes(size)} ({100 * size / ours:.0f}%).")
    table = tabulate(rows, headers=["estimate", "memory", "vs ours", "covers"], colalign=("left", "right", "right"))
    return "\n".join([f"{report.model_id}: peak per GPU, ours beside the analytic formulas", "", table, "", *notes])
