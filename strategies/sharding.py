"""How a tensor is split along dim 0 over N ranks, as ``torch.chunk`` and FSDP2 split it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Dim0Shard:
    shape: tuple[int, ...]
    world: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def padded_rows(self) -> int:
        """Rows of every rank's shard after padding dim 0 to a multiple of the world size."""
        return -(-self.rows // self.world)

    @property
    def padded_shard_numel(self) -> int:
        return self.padded_rows * self.row_numel

    @property
    def padded_numel(self) -> int:
        return self.padded_shard_numel * self.world

    def local_numel(self, rank: int) -> int:
        """Elements rank ``rank`` really holds (the last ranks hold fewer rows, or none)."""
        rows = min(self.padded_rows, max(0, self.rows - rank * self.padded_rows))
        return rows * self.row_numel
