"""GPUs the estimate can target. Compute capability decides which kernels and workspaces CUDA uses."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.errors import UserError


@dataclass(frozen=True)
class Gpu:
    name: str
    description: str
    compute_capability: tuple[int, int]


GPUS: tuple[Gpu, ...] = (
    Gpu("v100-16gb", "NVIDIA V100 16GB", (7, 0)),
    Gpu("v100-32gb", "NVIDIA V100 32GB", (7, 0)),
    Gpu("t4", "NVIDIA T4", (7, 5)),
    Gpu("a10g", "NVIDIA A10G", (8, 6)),
    Gpu("rtx3090", "NVIDIA GeForce RTX 3090", (8, 6)),
    Gpu("l4", "NVIDIA L4", (8, 9)),
    Gpu("rtx4090", "NVIDIA GeForce RTX 4090", (8, 9)),
    Gpu("l40s", "NVIDIA L40S", (8, 9)),
    Gpu("a100-40gb", "NVIDIA A100 40GB", (8, 0)),
    Gpu("a100-80gb", "NVIDIA A100 80GB", (8, 0)),
    Gpu("h100", "NVIDIA H100 80GB", (9, 0)),
    Gpu("h200", "NVIDIA H200", (9, 0)),
    Gpu("b200", "NVIDIA B200", (10, 0)),
)

_BY_NAME = {gpu.name: gpu for gpu in GPUS} | {"h100-80gb": next(g for g in GPUS if g.name == "h100")}


def find_gpu(name: str) -> Gpu:
    gpu = _BY_NAME.get(name.lower())
    if gpu is None:
        raise UserError(f"Unknown GPU {name!r}. Known: {', '.join(g.name for g in GPUS)}.")
    return gpu
