"""The record of one training step: every aten op in execution order and every storage it touched.

Storages, not tensors, are the unit of memory: views and in-place ops share one storage. Each storage
knows the op that created it and the op after which its last reference died, as observed while the step
ran, so Python-scope and autograd-engine lifetimes are exactly those of eager execution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tracer.roles import Phase, Role


def element_size(dtype: str) -> int:
    """Bytes per element of a dtype as storages record it ("float32", "bfloat16", ...)."""
    return getattr(torch, dtype).itemsize


_FORWARD_PHASES = frozenset({Phase.FORWARD, Phase.PREFILL, Phase.DECODE})


@dataclass(frozen=True)
class Op:
    index: int
    target: str  # e.g. "aten.mm.default"
    module: str  # module path, "" for the model itself
    phase: Phase
    inputs: tuple[int, ...]  # storage ids read
    outputs: tuple[int, ...]  # storage ids written (new, or existing ones for in-place ops and views)
    recompute: bool = False  # a forward op run again in backward (activation checkpointing)
    flops: int = 0  # floating-point operations, as torch.utils.flop_counter counts them (matmuls, attention)
    bytes_moved: int = 0  # bytes of the tensors it reads and writes (0 for views): its memory traffic
    # In a pipeline stage's step (strategies/pipeline.py): the (stage, microbatch) whose forward or backward pass
    # this op of the traced step runs in; None for the optimizer's ops and everywhere else.
    pipeline_pass: tuple[int, int] | None = None
    # The autograd engine's sum of two gradients of one tensor into a buffered gradient that is dense and no view,
    # which a plain run makes in place where nothing else holds that gradient (tracer/gradient_sums.py)
    sums_gradients: bool = False

    @property
    def runs_forward(self) -> bool:
        return self.phase in _FORWARD_PHASES or self.recompute


@dataclass
class Storage:
    id: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    role: Role
    created_at: int | None  # op index; None when it existed before the step
    freed_after: int | None  # op index after which it died; None when it outlives the step
    on_device: bool = True  # False for host tensors (e.g. optimizer step counters on CUDA)
    name: str = ""  # parameter or state name for storages that existed before the step
    param: str | None = None  # the parameter this is, or is the gradient, state or optimizer temporary of
    device: int = 0  # the GPU it lives on, where a device map spreads the model over several (tracer/device_map.py)


@dataclass(frozen=True)
class ModelStructure:
    """What strategies need to know about the model's module tree."""

    blocks: tuple[str, ...] = ()  # module paths of the repeated decoder layers, in forward order
    input_embedding: str = ""  # module path of the token embedding
    output_embedding: str | None = None  # module path of the lm_head, if the model has one
    tp_plan: dict[str, str] = field(default_factory=dict)  # transformers' own: module path pattern -> style
    ep_plan: dict[str, str] = field(default_factory=dict)  # transformers' expert-parallel plan, the same way
    model_class: str = ""
    # Multi-head latent attention's rotary key width (``qk_rope_head_dim``), which the tensor-parallel style of its
    # latent projection splits off the projection's output; None for other attention.
    rotary_key_dim: int | None = None


@dataclass
class Trace:
    ops: list[Op]
    storages: dict[int, Storage]
    assumptions: dict[str, Any] = field(default_factory=dict)
    parameter_count: int = 0
    trainable_parameter_count: int = 0
    structure: ModelStructure = field(default_factory=ModelStructure)
    # Bytes each optimizer op moves per storage: how a stamped trace counts what an op over the parameters
    # of every layer moves for the layers it did not trace (tracer/stamping.py).
    optimizer_traffic: dict[int, dict[int, int]] = field(default_factory=dict)

    def phase_start(self, phase: Phase) -> int | None:
        """Index of the first op of ``phase``, or None if the phase has no ops."""
        return next((op.index for op in self.ops if op.phase is phase), None)
