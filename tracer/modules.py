"""Which module an op belongs to, in forward and in backward.

Forward ops take the innermost module whose forward is running (global forward pre/post hooks). Backward
ops take the module that created the autograd node now executing: each node's sequence number is recorded
when the forward op that created it runs. Nothing here holds a tensor, so lifetimes stay as in eager.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container
from functools import cache

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from tracer.trace import ModelStructure

ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
# The module path of forward ops the loop runs outside the model (a custom model's loss, accelerate's fp32 copies
# of the outputs), and of their backward: not the model's own top level (""). Hooks on the model (FSDP's
# post-forward, and its pre-backward on the model's outputs) run before them in forward and after them in backward.
LOOP = "(the loop, outside the model)"


class ModuleScope:
    def __init__(self, model: nn.Module, on_block: Callable[[int], None] | None = None) -> None:
        """``on_block`` is told the index of the decoder block an op belongs to whenever it changes (for
        progress: blocks run in order in forward and in reverse in backward)."""
        self._names = {id(module): name for name, module in model.named_modules()}
        self._param_owner = {
            id(param): name.rpartition(".")[0] for name, param in model.named_parameters(remove_duplicate=False)
        }
        self._stack: list[str] = []
        self._module_of_node: dict[int, str] = {}
        self._handles: list = []
        self._on_block = on_block
        self._block_index = {name: index for index, name in enumerate(decoder_blocks(model))} if on_block else {}
        self._block_of: dict[str, int | None] = {}
        self._last_block: int | None = None
        self._previous_backward = ""
        # In the step's forward and backward, an op outside every module and every autograd node is the loop's (its
        # loss, the seed gradient of loss.backward()); in the optimizer step every op is.
        self.in_pass = False

    def __enter__(self) -> ModuleScope:
        self._handles = [
            register_module_forward_pre_hook(self._enter_module),
            register_module_forward_hook(self._exit_module, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def running_forward(self) -> bool:
        """Whether a module's forward is running (in backward: activation checkpointing recomputing it)."""
        return bool(self._stack)

    def current(self) -> str:
        """The module path of the op being dispatched now ("" is the model itself)."""
        name = self._current()
        if self._on_block is not None:
            self._note_block(name)
        return name

    def _current(self) -> str:
        if self._stack:
            name = self._stack[-1]
            # The autograd node of the op being dispatched (if any) was just created and took this number.
            self._module_of_node.setdefault(torch._C._autograd._get_sequence_nr() - 1, name)
            return name
        node = torch._C._current_autograd_node()
        if node is None:
            if self.in_pass:  # the loop's own op: the autograd node it makes is the loop's in backward too
                self._module_of_node.setdefault(torch._C._autograd._get_sequence_nr() - 1, LOOP)
                return LOOP
            return ""
        if node.name() == ACCUMULATE_GRAD:
            name = self._param_owner.get(id(node.variable))
        else:
            name = self._module_of_node.get(node._sequence_nr())
        if name is None:
            # A node no forward op was seen making, or the gradient of a leaf that is no parameter (the inputs
            # reentrant checkpointing detaches): it runs among the nodes of the backward op before.
            name = self._previous_backward
        self._previous_backward = name
        return name

    def _note_block(self, module: str) -> None:
        if module not in self._block_of:
            block_path = enclosing_block(module, self._block_index)
            self._block_of[module] = None if block_path is None else self._block_index[block_path]
        block = self._block_of[module]
        if block is not None and block != self._last_block:
            self._last_block = block
            self._on_block(block)

    def _enter_module(self, module: nn.Module, args: object) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _exit_module(self, module: nn.Module, args: object, output: object) -> None:
        if id(module) in self._names and self._stack:
            self._stack.pop()


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all, trainable) parameters, counting a quantized weight by the elements it stands for, not the bytes
    that pack them (quantized layers say so with ``logical_weight_numel``, or ``packed_parameter_numel`` where the
    packed tensors are buffers), and an expert-parallel rank's experts by all the ranks' (``expert_parallel_degree``:
    each holds as many)."""
    total = trainable = 0
    seen: set[int] = set()  # tied weights count once
    for module in model.modules():
        total += getattr(module, "packed_parameter_numel", 0)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            numel = getattr(module, "logical_weight_numel", param.numel()) if name == "weight" else param.numel()
            numel *= getattr(module, "expert_parallel_degree", 1)
            total += numel
            trainable += numel if param.requires_grad else 0
    return total, trainable


def model_structure(model: nn.Module) -> ModelStructure:
    names = {id(module): name for name, module in model.named_modules()}
    embedding, output = input_embedding(model), output_layer(model)
    return ModelStructure(
        blocks=decoder_blocks(model),
        input_embedding=names[id(embedding)] if embedding is not None else "",
        output_embedding=names.get(id(output)) if output is not None else None,
        tp_plan=dict(getattr(model, "_tp_plan", None) or {}),
        ep_plan=dict(getattr(model, "_ep_plan", None) or {}),
        model_class=type(model).__name__,
        rotary_key_dim=getattr(_text_config(model), "qk_rope_head_dim", None),
    )


def _text_config(model: nn.Module) -> object:
    """The config of the model's language model (a multimodal checkpoint nests it), None if it has none."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def input_embedding(model: nn.Module) -> nn.Module | None:
    """The token embedding: transformers' ``get_input_embeddings()``, else the model's first ``nn.Embedding``."""
    if hasattr(model, "get_input_embeddings"):
        return model.get_input_embeddings()
    return next((module for module in model.modules() if isinstance(module, nn.Embedding)), None)


def output_layer(model: nn.Module) -> nn.Module | None:
    """The layer that makes the logits: transformers' ``get_output_embeddings()``, else the model's last
    ``nn.Linear`` with as many outputs as the token embedding has rows (torchtitan's ``output``)."""
    if hasattr(model, "get_output_embeddings"):
        return model.get_output_embeddings()
    embedding = input_embedding(model)
    if embedding is None:
        return None
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == embedding.num_embeddings]
    return linears[-1] if linears else None


@cache
def plan_pattern(pattern: str) -> re.Pattern[str]:
    """A parallel plan's module or parameter pattern ("model.layers.*.mlp") as a regular expression ("*" is a layer
    index), as transformers matches its tp, ep and fsdp plans."""
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


def within(module: str, scope: str) -> bool:
    """Whether the module at path ``module`` is ``scope`` or lies in it (every module lies in the model, "")."""
    return scope == "" or module == scope or module.startswith(scope + ".")


def enclosing_block(path: str, blocks: Container[str]) -> str | None:
    """The block of ``blocks`` that the module or parameter at ``path`` lies in (or is), if any."""
    parts = path.split(".")
    return next((p for p in (".".join(parts[:end]) for end in range(1, len(parts) + 1)) if p in blocks), None)


def decoder_blocks(model: nn.Module) -> tuple[str, ...]:
    """Module paths of the repeated decoder layers: the children of the longest ``nn.ModuleList`` (or
    ``nn.ModuleDict``, as torchtitan keeps them) whose modules share one class and hold parameters
    (``model.layers.0`` ... for Llama, ``transformer.h.0`` ... for GPT-2)."""
    best: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) or len(module) <= len(best):
            continue
        children = dict(module.named_children())
        kinds = {type(child) for child in children.values()}
        first = next(iter(children.values()))
        if len(kinds) == 1 and any(True for _ in first.parameters()):
            best = tuple(f"{name}.{key}" for key in children)
    return best
