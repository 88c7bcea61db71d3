"""LoRA adapters through ``peft``, on the model as built (fake or real tensors alike)."""

from __future__ import annotations

from unittest.mock import patch

import torch
from torch import nn

from tracer.errors import UserError
from tracer.training import LoraSetup

ALL_LINEAR = "all-linear"


def apply_lora(model: nn.Module, lora: LoraSetup) -> nn.Module:
    """``get_peft_model`` with ``LoraConfig(r, lora_alpha, target_modules, lora_dropout)``: the base is
    frozen (no gradients, no optimizer state), the adapters train."""
    from peft import LoraConfig, get_peft_model
    from transformers import PreTrainedModel

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        target_modules=_target_modules(lora.targets),
        lora_dropout=lora.dropout,
        bias="none",
        # a custom model's forward is its own: peft's generic PeftModel passes its arguments through
        task_type="CAUSAL_LM" if isinstance(model, PreTrainedModel) else None,
    )
    try:
        with patch.object(nn.Module, "to", _replacing_tensors):
            return get_peft_model(model, config, autocast_adapter_dtype=lora.float32_adapters)
    except ValueError as error:
        raise UserError(
            f"peft cannot add LoRA adapters to this model: {error} Name the layers with --lora-targets "
            "(for example q_proj,v_proj)."
        ) from None


def _target_modules(targets: tuple[str, ...] | None) -> list[str] | str | None:
    """Module names, or peft's ``"all-linear"`` (every linear layer but the output one)."""
    if targets == (ALL_LINEAR,):
        return ALL_LINEAR
    return list(targets) if targets else None


def _replacing_tensors(module: nn.Module, *args, **kwargs) -> nn.Module:
    """``Module.to`` while peft builds adapters. peft moves each adapter to its base layer's device and dtype,
    and ``Module.to`` swaps fake parameters in place (``Module._apply``), which fails when anything else
    holds them. New adapters are held by nothing else yet, so their tensors are replaced instead; a move that
    changes nothing is skipped."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    for owner in module.modules():
        for slots in (owner._parameters, owner._buffers):
            for name, tensor in slots.items():
                if tensor is None:
                    continue
                target_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
                target_device = device if device is not None else tensor.device
                if tensor.device == target_device and tensor.dtype == target_dtype:
                    continue
                moved = tensor.detach().to(device=target_device, dtype=target_dtype)
                if isinstance(tensor, nn.Parameter):
                    moved = nn.Parameter(moved, requires_grad=tensor.requires_grad)
                slots[name] = moved
    return module
