"""What fits a GPU: the device memory a step needs against the GPU's capacity less a safety margin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from analysis.report import MemoryReport
from tracer.units import format_bytes

if TYPE_CHECKING:
    from tracer.gpus import Gpu

# Share of the GPU's capacity kept free. What the estimate does not hold: torch reports a little less total
# memory than the datasheet (79.1-79.3 GiB of an 80 GB part), NCCL's communicator buffers, the side streams'
# own allocator pools of FSDP and DeepSpeed, and the estimate's own error.
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class MemoryBudget:
    capacity_bytes: int
    margin: float = DEFAULT_MARGIN

    @property
    def usable_bytes(self) -> int:
        return int(self.capacity_bytes * (1 - self.margin))

    def allocator_capacity(self, context_bytes: int) -> int:
        """What the caching allocator may reserve before its ``cudaMalloc`` fails: the usable memory less the CUDA
        context. There it releases its cached segments and retries, as PyTorch's does (the margin stays for what
        the estimate does not hold), so a step fits when the allocated memory does, not only the cached."""
        return self.usable_bytes - context_bytes

    def needed_bytes(self, report: MemoryReport) -> int:
        """Device memory of the most loaded GPU: reserved memory plus the CUDA context where the caching
        allocator was replayed (``--target cuda``), else the allocated peak."""
        reports = report.ranks or [report]
        return max(r.device_total_bytes if r.device_total_bytes is not None else r.peak_bytes for r in reports)

    def fits(self, report: MemoryReport) -> bool:
        return self.needed_bytes(report) <= self.usable_bytes

    def rules_out(self, needed_floor: int) -> bool:
        """Whether a step that needs at least ``needed_floor`` bytes cannot fit."""
        return needed_floor > self.usable_bytes

    def shortfall_bytes(self, report: MemoryReport) -> int:
        return self.needed_bytes(report) - self.usable_bytes

    def verdict(self, report: MemoryReport, gpu_description: str) -> str:
        """One line: whether the step fits, by how much, and what the margin is for."""
        needed, usable = self.needed_bytes(report), self.usable_bytes
        what = "reserved memory + CUDA context" if report.device_total_bytes is not None else "peak allocated memory"
        if needed <= usable:
            head = f"Fits the {gpu_description}: {format_bytes(usable - needed)} to spare"
        else:
            head = f"Does not fit the {gpu_description}: {format_bytes(needed - usable)} over"
        return (
            f"{head} ({what} {format_bytes(needed)} against {format_bytes(usable)}, "
            f"{100 - 100 * self.margin:g}% of its {format_bytes(self.capacity_bytes)}; the "
            f"{100 * self.margin:g}% left covers NCCL's buffers, side-stream pools and the estimate's error)"
        )

    def to_json(self, report: MemoryReport) -> dict[str, int | bool | float]:
        return {
            "fits": self.fits(report),
            "needed_bytes": self.needed_bytes(report),
            "usable_bytes": self.usable_bytes,
            "capacity_bytes": self.capacity_bytes,
            "margin": self.margin,
        }

    def describe(self) -> str:
        return (
            f"reserved memory + CUDA context <= {format_bytes(self.usable_bytes)} "
            f"({100 - 100 * self.margin:g}% of {format_bytes(self.capacity_bytes)})"
        )


def default_allocator_capacity(gpu: Gpu | None) -> int | None:
    """:meth:`MemoryBudget.allocator_capacity` of ``gpu`` under the default margin, where ``analyze`` and ``sweep``
    judge the fit; None without a GPU (``--target cpu``), where the allocator never runs out."""
    return MemoryBudget(gpu.memory_bytes).allocator_capacity(gpu.context_bytes) if gpu else None
