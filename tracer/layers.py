"""Which decoder layers a trace needs: the layers of a model come in a few kinds, repeating.

A decoder layer's memory does not depend on where it sits in the stack, only on its kind (its modules,
their parameters and settings: sliding or full attention, dense or MoE). So a model of N layers whose
kinds repeat with period p after a head of ``a`` layers is traced with ``a + 3p (+ a remainder)`` layers
(the repeating block, one block before it and one after, so that what passes between layers is seen on
both sides) and the rest is stamped from the middle block (tracer/stamping.py). The head holds at least the
first layer, whose input (the embedding's output) needs no gradient when the embedding is frozen (LoRA).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from tracer.modules import decoder_blocks

# Attributes that number a layer rather than describe it.
_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx"})
_SIMPLE = (int, float, str, bool, type(None))


@dataclass(frozen=True)
class LayerPlan:
    """Trace the model cut to ``traced`` layers (built from ``cut``), then stamp ``copies`` more copies of the
    ``period`` layers from ``template`` on, giving the model's ``layers``."""

    full: PretrainedConfig
    cut: PretrainedConfig
    layers: int
    traced: int
    template: int
    period: int

    @property
    def copies(self) -> int:
        return (self.layers - self.traced) // self.period

    def widen(self, config: PretrainedConfig) -> None:
        """Give the cut model's config the whole model's layer count and per-layer lists back: code outside
        the decoder layers that reads them (a cache made with a layer per decoder layer, masks per layer type)
        then runs as in the whole model, while the decoder runs the layers it has."""
        for name in _cut_fields(self.full):
            setattr(config, name, copy.deepcopy(getattr(self.full, name)))


def plan_layers(config: PretrainedConfig) -> LayerPlan | None:
    """How to trace ``config`` with fewer layers, or None when every layer must be traced (the model is
    too shallow to gain, or its layers do not repeat)."""
    try:
        kinds = layer_kinds(config)
    except Exception:  # what transformers cannot build, the full trace reports by name
        return None
    if kinds is None or len(kinds) != getattr(config, "num_hidden_layers", None):
        return None
    shape = _repeating(kinds)
    if shape is None:
        return None
    head, period = shape
    template = head + period
    traced = template + 2 * period + (len(kinds) - head) % period
    reduced = cut_to(config, traced)
    if layer_kinds(reduced) != kinds[:traced]:  # the cut changed what some layer is
        return None
    return LayerPlan(config, reduced, len(kinds), traced, template, period)


def layer_kinds(config: PretrainedConfig) -> list[tuple] | None:
    """One hashable description per decoder layer, equal for layers that trace alike; None when the model
    has no repeated decoder layers. The model is built on the meta device: nothing is allocated."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = decoder_blocks(model)
    if not blocks:
        return None
    settings = _per_layer_settings(config, len(blocks))
    return [
        (_module_kind(model.get_submodule(path), len(blocks)), *(_frozen(s[i]) for s in settings))
        for i, path in enumerate(blocks)
    ]


def cut_to(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """``config`` with its first ``layers`` layers: the layer count and every per-layer list cut."""
    reduced = copy.deepcopy(config)
    for name in _cut_fields(config):
        value = getattr(config, name)
        setattr(reduced, name, layers if name == "num_hidden_layers" else type(value)(value[:layers]))
    return reduced


def _cut_fields(config: PretrainedConfig) -> list[str]:
    """The layer count and the per-layer lists of a config."""
    layers = config.num_hidden_layers
    return ["num_hidden_layers", *(name for name, value in vars(config).items() if _per_layer(value, layers))]


def _repeating(kinds: Sequence[tuple]) -> tuple[int, int] | None:
    """(head, period) of the cheapest trace: the kinds repeat with ``period`` from layer ``head`` to the end,
    and tracing ``head + 3 period`` layers (plus the remainder) leaves at least one block to stamp."""
    layers, best = len(kinds), None
    for period in range(1, layers // 4 + 1):
        head = _periodic_from(kinds, period)
        traced = head + 3 * period + (layers - head) % period
        if traced < layers and (best is None or traced < best[0]):
            best = (traced, head, period)
    return None if best is None else best[1:]


def _periodic_from(kinds: Sequence[tuple], period: int) -> int:
    """The first layer from which ``kinds[i] == kinds[i + period]`` holds to the end, and not the first layer:
    its input is the embedding's output, which needs no gradient when the embedding is frozen (LoRA)."""
    head = len(kinds) - period
    while head > 1 and kinds[head - 1] == kinds[head - 1 + period]:
        head -= 1
    return head


def _per_layer_settings(config: PretrainedConfig, layers: int) -> list[Sequence]:
    """The config's per-layer lists (``layer_types``, ``no_rope_layers`` ...), which code may read by layer
    index at run time rather than keep on the layer. A list of every layer's index (Llama 4's ``moe_layers``
    when all layers are MoE) numbers the layers rather than sets them apart."""
    return [
        value
        for _, value in sorted(vars(config).items())
        if _per_layer(value, layers) and list(value) != list(range(layers))
    ]


def _per_layer(value: object, layers: int) -> bool:
    return isinstance(value, list | tuple) and len(value) == layers


def _module_kind(layer: nn.Module, layers: int) -> tuple:
    """A layer's modules, their settings and their tensors' shapes; a copy of a per-layer list of the config
    (GPT-Neo keeps ``attention_layers`` on every attention) is left to the config's lists."""
    described = []
    for name, module in layer.named_modules():
        settings = tuple(
            (key, _frozen(value))
            for key, value in sorted(vars(module).items())
            if not key.startswith("_")
            and key not in _INDEX_ATTRIBUTES
            and _is_simple(value)
            and not _per_layer(value, layers)
        )
        tensors = tuple(
            (key, tuple(t.shape), t.dtype, t.requires_grad)
            for key, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        )
        described.append((name, type(module).__qualname__, settings, tensors))
    return tuple(described)


def _frozen(value: object) -> object:
    return tuple(_frozen(v) for v in value) if isinstance(value, list | tuple) else value


def _is_simple(value: object) -> bool:
    if isinstance(value, list | tuple):
        return all(_is_simple(v) for v in value)
    return isinstance(value, _SIMPLE)
