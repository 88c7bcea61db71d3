"""GPUs the estimate can target. Compute capability decides which kernels and workspaces CUDA uses."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.errors import UserError


@dataclass(frozen=True)
class Gpu:
    name: str
    description: str
    compute_capability: tuple[int, int]
    # The datasheet's capacity; torch reports a little less as total memory (79.1-79.3 GiB on 80 GB parts, as
    # CUDA out-of-memory messages show), which the fit margin of tracer/sweep.py covers.
    memory_gib: float

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 1024**3)


GPUS: tuple[Gpu, ...] = (
    Gpu("v100-16gb", "NVIDIA V100 16GB", (7, 0), 16),
    Gpu("v100-32gb", "NVIDIA V100 32GB", (7, 0), 32),
    Gpu("t4", "NVIDIA T4", (7, 5), 16),
    Gpu("a10g", "NVIDIA A10G", (8, 6), 24),
    Gpu("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6), 24),
    Gpu("l4", "NVIDIA L4", (8, 9), 24),
    Gpu("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9), 24),
    Gpu("l40s", "NVIDIA L40S", (8, 9), 48),
    Gpu("a100-40gb", "NVIDIA A100 40GB", (8, 0), 40),
    Gpu("a100-80gb", "NVIDIA A100 80GB", (8, 0), 80),
    Gpu("h100", "NVIDIA H100 80GB", (9, 0), 80),
    Gpu("h200", "NVIDIA H200", (9, 0), 141),
    Gpu("b200", "NVIDIA B200", (10, 0), 180),
)

_BY_NAME = {gpu.name: gpu for gpu in GPUS} | {"h100-80gb": next(g for g in GPUS if g.name == "h100")}


def find_gpu(name: str) -> Gpu:
    gpu = _BY_NAME.get(name.lower())
    if gpu is None:
        raise UserError(f"Unknown GPU {name!r}. Known: {', '.join(g.name for g in GPUS)}.")
    return gpu
