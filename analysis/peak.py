"""Live device bytes at every op, split by role, and the op where their sum peaks.

At op ``i`` the live bytes are everything allocated up to and including op ``i``'s outputs, minus what
was freed after earlier ops: the moment an op has produced its outputs and nothing has been released yet
is the most memory it can need.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from analysis.liveness import Lifetime, lifetimes
from tracer.cuda.caching_allocator import MIN_BLOCK_SIZE
from tracer.graph import StepGraph
from tracer.roles import Role


@dataclass(frozen=True)
class Timeline:
    roles: tuple[Role, ...]
    live: np.ndarray  # live[i, r]: bytes of role roles[r] live at op i (int64)

    @cached_property
    def totals(self) -> np.ndarray:
        return self.live.sum(axis=1)

    def total(self, index: int) -> int:
        return int(self.totals[index])

    def breakdown(self, index: int) -> dict[Role, int]:
        return {role: int(value) for role, value in zip(self.roles, self.live[index], strict=True)}

    def with_allocator_slack(self, allocated_at: list[int]) -> Timeline:
        """The timeline as the caching allocator counts it: ``allocated_at[i]`` (its allocated bytes at op
        ``i``) less the rounded requests live there is the slack of blocks handed out whole."""
        slot = self.roles.index(Role.ALLOCATOR_SLACK)
        live = self.live.copy()
        live[:, slot] = np.asarray(allocated_at, dtype=np.int64) - (self.totals - self.live[:, slot])
        return Timeline(self.roles, live)


@dataclass(frozen=True)
class Peak:
    index: int
    bytes: int
    breakdown: dict[Role, int]


def timeline(step: StepGraph, rounded: bool = True) -> Timeline:
    roles = tuple(Role)
    slot = {role: r for r, role in enumerate(roles)}
    spans = lifetimes(step, rounded)
    return Timeline(roles, live_bytes(spans, [slot[span.role] for span in spans], len(step.ops), len(roles)))


def live_bytes(spans: list[Lifetime], columns: list[int], count: int, width: int) -> np.ndarray:
    """live[i, c]: bytes of the spans put in column c (``columns[k]`` for ``spans[k]``) live at op i."""
    # change[i]: bytes allocated at op i less those freed after op i - 1; the running sum is what is live
    change = np.zeros((count + 1, width), dtype=np.int64)
    column = np.asarray(columns, dtype=np.int64)
    sizes = np.fromiter((span.bytes for span in spans), dtype=np.int64, count=len(spans))
    firsts = np.fromiter((span.first for span in spans), dtype=np.int64, count=len(spans))
    ends = np.fromiter((span.last + 1 for span in spans), dtype=np.int64, count=len(spans))
    np.add.at(change, (firsts, column), sizes)
    np.add.at(change, (ends, column), -sizes)
    return np.cumsum(change[:count], axis=0)


@dataclass(frozen=True)
class PeakLine:
    """The allocated peak of a step at any batch size of a line through it: the lifetimes do not change with the
    batch and the sizes are affine in it (analysis/batch_line.py), so only the sizes are computed again."""

    firsts: np.ndarray
    ends: np.ndarray  # one past the last op at which each storage is live
    sizes: np.ndarray  # bytes at batch ``first``
    slopes: np.ndarray  # bytes gained per sequence
    first: int
    ops: int

    @classmethod
    def of(cls, step: StepGraph, slopes: dict[int, int], first: int) -> PeakLine:
        """``step`` at batch ``first``; ``slopes`` by storage id (absent: does not grow)."""
        spans = lifetimes(step, rounded=False, nonzero=False)
        return cls(
            np.fromiter((span.first for span in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((span.last + 1 for span in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((span.bytes for span in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((slopes.get(span.storage_id, 0) for span in spans), dtype=np.int64, count=len(spans)),
            first,
            len(step.ops),
        )

    def peak(self, batch: int) -> int:
        """The most allocator blocks live at once at ``batch`` (``find_peak(timeline(step))`` of the step there)."""
        sizes = self.sizes + self.slopes * (batch - self.first)
        blocks = -(-sizes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
        change = np.zeros(self.ops + 1, dtype=np.int64)
        np.add.at(change, self.firsts, blocks)
        np.add.at(change, self.ends, -blocks)
        return int(np.cumsum(change[: self.ops]).max()) if self.ops else 0


def find_peak(line: Timeline) -> Peak:
    index = int(np.argmax(line.totals))
    return Peak(index, line.total(index), line.breakdown(index))


def host_peak(step: StepGraph) -> int:
    """The most host memory the step's host-resident storages (offloaded ones) hold at once."""
    spans = lifetimes(step, rounded=False, on_device=False)
    events = sorted([(span.first, span.bytes) for span in spans] + [(span.last + 1, -span.bytes) for span in spans])
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak
