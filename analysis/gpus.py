"""GPUs the estimate can target. Compute capability decides which kernels and workspaces CUDA uses."""

from __future__ import annotations

from dataclasses import dataclass

from tracer.errors import UserError

# Device memory a process holds outside the caching allocator once CUDA is initialised: the CUDA context
# (driver state and the kernels loaded so far). "Around 400MB if CUDA >= 11.7 is used and lazy module
# loading enabled (default in PyTorch)": pytorch/pytorch#109888. Not measured by us per GPU family yet;
# benchmarks/ground_truth/collect.py records device_used_bytes - max_memory_reserved on each GPU it runs on.
CUDA_CONTEXT_BYTES = 400 * 1024**2


@dataclass(frozen=True)
class Gpu:
    name: str
    description: str
    compute_capability: tuple[int, int]
    # The datasheet's capacity; torch reports a little less as total memory (79.1-79.3 GiB on 80 GB parts, as
    # CUDA out-of-memory messages show), which the fit margin of tracer/sweep.py covers.
    memory_gib: float
    context_bytes: int = CUDA_CONTEXT_BYTES

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


def gpu_for_device_name(device_name: str) -> Gpu | None:
    """The catalog entry for a name ``torch.cuda.get_device_name`` reports ("NVIDIA H100 80GB HBM3")."""
    name = device_name.lower()
    matches = [gpu for gpu in GPUS if gpu.description.lower() in name or name in gpu.description.lower()]
    return max(matches, key=lambda gpu: len(gpu.description), default=None)
