"""How a tensor is split over N ranks, as ``torch.chunk``, FSDP2 and DTensor's ``Shard`` split it."""

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
        return chunk_length(self.rows, self.world, rank) * self.row_numel


def chunk_length(length: int, world: int, rank: int) -> int:
    """Length of rank ``rank``'s piece of ``torch.chunk(tensor, world)`` along a dimension of ``length``:
    pieces of ceil(length / world), the last ones shorter or empty."""
    piece = -(-length // world)
    return min(piece, max(0, length - rank * piece))
