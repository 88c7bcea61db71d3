"""Live device bytes at every op, split by role, and the op where their sum peaks.

At op ``i`` the live bytes are everything allocated up to and including op ``i``'s outputs, minus what
was freed after earlier ops: the moment an op has produced its outputs and nothing has been released yet
is the most memory it can need.
"""

from __future__ import annotations

from dataclasses import dataclass

from analysis.liveness import lifetimes
from tracer.graph import StepGraph
from tracer.roles import Role


@dataclass(frozen=True)
class Timeline:
    roles: tuple[Role, ...]
    live: list[list[int]]  # live[i][r]: bytes of role roles[r] live at op i

    def total(self, index: int) -> int:
        return sum(self.live[index])

    def breakdown(self, index: int) -> dict[Role, int]:
        return dict(zip(self.roles, self.live[index], strict=True))

    def with_allocator_slack(self, allocated_at: list[int]) -> Timeline:
        """The timeline as the caching allocator counts it: ``allocated_at[i]`` (its allocated bytes at op
        ``i``) less the rounded requests live there is the slack of blocks handed out whole."""
        slot = self.roles.index(Role.ALLOCATOR_SLACK)
        live = []
        for index, row in enumerate(self.live):
            row = list(row)
            row[slot] = allocated_at[index] - (sum(row) - row[slot])
            live.append(row)
        return Timeline(self.roles, live)


@dataclass(frozen=True)
class Peak:
    index: int
    bytes: int
    breakdown: dict[Role, int]


def timeline(step: StepGraph, rounded: bool = True) -> Timeline:
    spans = lifetimes(step, rounded)
    roles = tuple(Role)
    slot = {role: r for r, role in enumerate(roles)}
    count = len(step.ops)
    allocated = [[0] * len(roles) for _ in range(count)]
    released = [[0] * len(roles) for _ in range(count)]
    for span in spans:
        allocated[span.first][slot[span.role]] += span.bytes
        released[span.last][slot[span.role]] += span.bytes
    live = []
    running = [0] * len(roles)
    for index in range(count):
        now = [held + new for held, new in zip(running, allocated[index], strict=True)]
        live.append(now)
        running = [held - gone for held, gone in zip(now, released[index], strict=True)]
    return Timeline(roles, live)


def find_peak(line: Timeline) -> Peak:
    index = max(range(len(line.live)), key=line.total)
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
