"""Give a model built on the meta device its storage, as the runs users launch do.

``from_pretrained`` builds the model on the meta device and gives each weight its storage on the GPU once, as it
loads it; torchtitan builds on the meta device, shards or parallelizes there, then calls ``to_empty`` and
initializes. Neither holds more than the weights it keeps. Building on the GPU instead allocates every weight
whole before any sharding and a tied output layer before tying, and the caching allocator keeps what they free:
memory no user's run has reserved.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give ``module``'s meta parameters and buffers uninitialized storage on ``device``, as ``to_empty`` does
    (FSDP2 and DTensor modules included: they keep their shards), except that a tensor several modules share (a
    tied weight) is allocated once and stays shared, where ``to_empty`` allocates each use and unties them."""
    uses: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                uses[id(param)].append((owner, name))
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # keeps each source alive, so that no id is reused

    def empty_on_device(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            made[id(tensor)] = (tensor, torch.empty_like(tensor, device=device))
        return made[id(tensor)][1]

    module._apply(empty_on_device)
    for (first_owner, first_name), *others in uses.values():
        for owner, name in others:
            owner._parameters[name] = first_owner._parameters[first_name]


def initialize(model: nn.Module) -> None:
    """Fill a materialized transformers model (a peft model's base included) as ``from_pretrained`` fills the
    weights a checkpoint lacks: its own initialization, rotary embeddings' buffers included. The values change no
    allocation of a dense model; they keep the step's numbers finite, and a mixture of experts' routing that of a
    model built with initialized weights rather than of uninitialized memory."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        base.initialize_weights()
