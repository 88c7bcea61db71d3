"""Optimizers whose kernels fake tensors cannot run, emulated with the storage they keep and the memory
their update allocates."""

from __future__ import annotations

import torch

# bitsandbytes 0.50 (bitsandbytes/optim/optimizer.py, Optimizer2State.init_state): parameters with fewer
# elements than min_8bit_size keep 32-bit states; larger ones keep uint8 states with one float32 absmax per
# block of 256 elements (block_wise=True) and share the two 256-entry quantization maps.
MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 256
QUANTIZATION_MAP_SIZE = 256


class AdamW8bit(torch.optim.Optimizer):
    """``bitsandbytes.optim.AdamW8bit`` with its defaults: the states as ``init_state`` allocates them, and an
    update that allocates nothing (``optimizer_update_8bit_blockwise`` and ``optimizer_update_32bit`` are
    fused kernels working in place)."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})
        self._maps: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    self._init_state(param, state)
                # The fused update reads the gradient and rewrites parameter and states in place.
                param.add_(param.grad, alpha=0.0)
        return None

    def _init_state(self, param: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        if param.numel() < MIN_8BIT_SIZE:
            state["state1"] = torch.zeros_like(param, dtype=torch.float32)
            state["state2"] = torch.zeros_like(param, dtype=torch.float32)
            return
        if not self._maps:
            self._maps["dynamic"] = param.new_zeros(QUANTIZATION_MAP_SIZE, dtype=torch.float32)
            self._maps["udynamic"] = param.new_zeros(QUANTIZATION_MAP_SIZE, dtype=torch.float32)
        blocks = -(-param.numel() // BLOCK_SIZE)
        state["state1"] = torch.zeros_like(param, dtype=torch.uint8)
        state["qmap1"] = self._maps["dynamic"]
        state["state2"] = torch.zeros_like(param, dtype=torch.uint8)
        state["qmap2"] = self._maps["udynamic"]
        state["absmax1"] = param.new_zeros(blocks, dtype=torch.float32)
        state["absmax2"] = param.new_zeros(blocks, dtype=torch.float32)
