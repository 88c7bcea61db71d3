"""GPUs the estimate and the planner can target: memory, peak throughput, bandwidths, compute capability.

Memory is what torch reports as the device's total (cited per GPU below). The other figures are the vendors'
datasheets for the named part (SXM/OAM modules where there is a choice): dense
tensor-core throughput (without structured sparsity), fp32 without tensor cores (what torch's default
``float32_matmul_precision="highest"`` uses), memory bandwidth, and the GPU-to-GPU link each GPU has in one
direction (half the bidirectional figure datasheets print). Compute capability decides which kernels and
workspaces CUDA uses in the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracer.errors import UserError

# Device memory a process holds outside the caching allocator once CUDA is initialised: the CUDA context
# (driver state and the kernels loaded so far, lazily). Measured: NVML's memory of the process less what the
# allocator reserved, on an H200 with driver 580, CUDA 13.0 and torch 2.11: 690 to 828 MiB over 104 processes,
# median 758 MiB (benchmarks/ground_truth/data/nvidia-h200/, process_used_bytes - reserved_at_end). The figure
# pytorch/pytorch#109888 gives for CUDA >= 11.7, "around 400MB", is an older stack's. Other GPUs unmeasured.
CUDA_CONTEXT_BYTES = 758 * 1024**2

# One PCIe x16 link in one direction, GB/s (PCI-SIG: 8 GT/s per lane for 3.0, 16 GT/s for 4.0, 128b/130b
# encoding).
PCIE_3_X16_GBPS = 15.75
PCIE_4_X16_GBPS = 31.5


@dataclass(frozen=True)
class Gpu:
    name: str
    description: str
    compute_capability: tuple[int, int]
    memory_bytes: int  # what torch reports as the device's total memory (see TOTAL_MEMORY_SOURCES)
    bf16_tflops: float | None  # dense tensor-core bf16 with fp32 accumulation; None: no bf16 tensor cores
    fp16_tflops: float  # dense tensor-core fp16 with fp32 accumulation
    fp32_tflops: float  # without tensor cores
    memory_gbps: float  # device memory bandwidth, GB/s
    interconnect: str
    interconnect_gbps: float  # GPU-to-GPU bandwidth of one GPU in one direction, GB/s
    context_bytes: int = CUDA_CONTEXT_BYTES
    note: str = ""
    # torch.cuda.get_device_properties().L2_cache_size, the buffer inductor's autotuner flushes the L2 with
    # (analysis/cudagraphs.py); None where not known
    l2_cache_bytes: int | None = None
    # torch.cuda.get_device_properties().multi_processor_count: the programs vLLM's Triton top-k/top-p kernel runs
    # (analysis/vllm.py); see MULTIPROCESSOR_SOURCES
    multiprocessors: int = 0

    def peak_flops(self, compute_dtype: str) -> float:
        """Peak FLOP/s of matmuls in ``compute_dtype`` ("bfloat16", "float16", "float32")."""
        if compute_dtype == "bfloat16":
            if self.bf16_tflops is None:
                raise UserError(
                    f"The {self.description} has no bfloat16 tensor cores: use fp16 (--dtype fp16 or "
                    "--mixed-precision fp16) or another --gpu."
                )
            return self.bf16_tflops * 1e12
        return (self.fp16_tflops if compute_dtype == "float16" else self.fp32_tflops) * 1e12


NVLINK_2 = "NVLink 2 (300 GB/s)"
NVLINK_3 = "NVLink 3 (600 GB/s)"
NVLINK_4 = "NVLink 4 (900 GB/s)"
NVLINK_5 = "NVLink 5 (1.8 TB/s)"
PCIE_3 = "PCIe 3.0 x16"
PCIE_4 = "PCIe 4.0 x16"


def _gib(total: float) -> int:
    """A total printed in GiB with two decimals, as CUDA out-of-memory messages print it."""
    return round(total * 1024**3)


# The memory a GPU offers is its total as torch reports it (cudaDeviceProp.totalGlobalMem: the "total capacity"
# of CUDA out-of-memory messages), not the datasheet's decimal gigabytes: an "80GB" H100 offers 79.18 GiB.
# Where reports differ (driver, board, ECC), the smallest. Sources, each a run that printed it:
TOTAL_MEMORY_SOURCES = {
    "v100-16gb": "15.78 GiB: github.com/kchengiva/Shift-GCN/issues/34",
    "v100-32gb": "31.74 GiB: github.com/liucongg/ChatGLM-Finetuning/issues/73",
    "t4": "14.75 GiB: github.com/hpcaitech/Open-Sora/issues/697 (Colab T4)",
    "a10g": "22.49 GiB: github.com/AUTOMATIC1111/stable-diffusion-webui/issues/1259",
    "rtx3090": "23.70 GiB: github.com/GaoLii/DSP/issues/10",
    "l4": "no torch total found; nvidia-smi's 23,034 MiB (github.com/lmstudio-ai/lmstudio-bug-tracker/issues/1638), "
    "which is at least what torch reports",
    "rtx4090": "23.64 GiB: github.com/ali-vilab/VGen/issues/104 (also 23.65, 23.68 elsewhere)",
    "l40s": "44.42 GiB: github.com/stepfun-ai/Step-Video-T2V/issues/8 (also 44.53: Wan-Video/Wan2.1#205)",
    "a100-40gb": "39.50 GiB: github.com/TianheWu/CoSeR/issues/10 (the report says A100, not which size)",
    "a100-80gb": "79.14 GiB: github.com/lianqi1008/Control-GIC/issues/6 (also 79.25, 79.35 elsewhere)",
    "h100": "79.18 GiB: 1x H100 80GB HBM3 in github.com/Jackmin801/prime-rl-hardfork "
    "benchmarks/results/BENCHMARKS.md (79.21 on an 8x node)",
    "h200": "139.80 GiB: 8x H200 in github.com/Jackmin801/prime-rl-hardfork benchmarks/results/BENCHMARKS.md",
    "b200": "178.35 GiB: B200 deviceQuery in github.com/pytorch/ao/pull/4002 (178.36 in prime-rl-hardfork's)",
    "mi300x": "191.98 GiB: a ROCm out-of-memory message on an MI300X (weak: repository not resolved)",
}

# torch.cuda.get_device_properties().multi_processor_count (CUDA deviceQuery's "Multiprocessors"; ROCm's compute
# units), each from a printout of the device itself where one was found
MULTIPROCESSOR_SOURCES = {
    "v100-16gb": "80: deviceQuery of a Tesla V100-SXM2-16GB, github.com/ULHPC/ulhpc-docs docs/containers/index.md",
    "v100-32gb": "80: deviceQuery of a Tesla V100-SXM2-32GB, github.com/felicepantaleo/kseta-22 "
    "docs/parallelism/cuda.md",
    "t4": "40: TensorFlow's device log (coreCount: 40), github.com/tensorflow/tensorrt/issues/169",
    "a10g": "80 (the A10 has 72): torch's properties of an NVIDIA A10G in github.com/meta-pytorch/torchcodec's CUDA "
    "decoding example",
    "rtx3090": "82: deviceQuery, github.com/thamada/nvidia-smi gls/RTX3090_deviceQuery.py",
    "l4": "58: deviceQuery, github.com/thamada/nvidia-smi gls/L4_deviceQuery.py",
    "rtx4090": "128: deviceQuery, github.com/aikitoria/open-gpu-kernel-modules/issues/1",
    "l40s": "142: deviceQuery, github.com/alvarobartt/cuda-device-query README.md",
    "a100-40gb": "108: deviceQuery of an A100-SXM4-40GB, github.com/bottlerocket-os/bottlerocket/pull/3873",
    "a100-80gb": "108: deviceQuery of an A100-SXM4-80GB, github.com/thamada/nvidia-smi gls/A100SXMx4_deviceQuery.py",
    "h100": "132: deviceQuery of an H100 80GB HBM3, github.com/thamada/nvidia-smi nvsim/H100SXMx8_deviceQuery.py "
    "(the PCIe card has 114)",
    "h200": "132: torch's properties of an NVIDIA H200, github.com/ai-bot-pro/achatbot "
    "deploy/modal/src/llm/vllm/vlm/skywork_r1v.py",
    "b200": "148: torch's properties of an NVIDIA B200, github.com/ai-bot-pro/achatbot (the same file)",
    "mi300x": "304 compute units: torch's properties of an MI300X, github.com/ROCm/ROCm/issues/4203",
}

GPUS: tuple[Gpu, ...] = (
    Gpu("v100-16gb", "NVIDIA V100 16GB", (7, 0), _gib(15.78), None, 125, 15.7, 900, NVLINK_2, 150, multiprocessors=80),
    Gpu("v100-32gb", "NVIDIA V100 32GB", (7, 0), _gib(31.74), None, 125, 15.7, 900, NVLINK_2, 150, multiprocessors=80),
    Gpu("t4", "NVIDIA T4", (7, 5), _gib(14.75), None, 65, 8.1, 320, PCIE_3, PCIE_3_X16_GBPS, multiprocessors=40),
    Gpu(
        "a10g",
        "NVIDIA A10G",
        (8, 6),
        _gib(22.49),
        70,
        70,
        31.2,
        600,
        PCIE_4,
        PCIE_4_X16_GBPS,
        note="AWS part without an NVIDIA datasheet: throughput as AWS quotes it for G5 instances",
        multiprocessors=80,
    ),
    Gpu(
        "rtx3090",
        "NVIDIA GeForce RTX 3090",
        (8, 6),
        _gib(23.70),
        71,
        71,
        35.6,
        936,
        PCIE_4,
        PCIE_4_X16_GBPS,
        multiprocessors=82,
    ),
    Gpu("l4", "NVIDIA L4", (8, 9), 23_034 * 1024**2, 121, 121, 30.3, 300, PCIE_4, PCIE_4_X16_GBPS, multiprocessors=58),
    Gpu(
        "rtx4090",
        "NVIDIA GeForce RTX 4090",
        (8, 9),
        _gib(23.64),
        165.2,
        165.2,
        82.6,
        1008,
        PCIE_4,
        PCIE_4_X16_GBPS,
        multiprocessors=128,
    ),
    Gpu("l40s", "NVIDIA L40S", (8, 9), _gib(44.42), 362, 362, 91.6, 864, PCIE_4, PCIE_4_X16_GBPS, multiprocessors=142),
    Gpu("a100-40gb", "NVIDIA A100 40GB", (8, 0), _gib(39.50), 312, 312, 19.5, 1555, NVLINK_3, 300, multiprocessors=108),
    Gpu("a100-80gb", "NVIDIA A100 80GB", (8, 0), _gib(79.14), 312, 312, 19.5, 2039, NVLINK_3, 300, multiprocessors=108),
    # L2: 50 MiB on the H100 SXM5 (NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 3); the H200's
    # 60 MiB is the flush buffer its autotuner allocated (benchmarks/ground_truth/data/nvidia-h200, torch 2.11)
    Gpu(
        "h100",
        "NVIDIA H100 80GB",
        (9, 0),
        _gib(79.18),
        989,
        989,
        67,
        3350,
        NVLINK_4,
        450,
        l2_cache_bytes=50 * 1024**2,
        multiprocessors=132,
    ),
    Gpu(
        "h200",
        "NVIDIA H200",
        (9, 0),
        _gib(139.80),
        989,
        989,
        67,
        4800,
        NVLINK_4,
        450,
        l2_cache_bytes=60 * 1024**2,
        multiprocessors=132,
    ),
    Gpu("b200", "NVIDIA B200", (10, 0), _gib(178.35), 2250, 2250, 75, 8000, NVLINK_5, 900, multiprocessors=148),
    Gpu(
        "mi300x",
        "AMD Instinct MI300X",
        (9, 0),
        _gib(191.98),
        1307.4,
        1307.4,
        163.4,
        5300,
        "Infinity Fabric (896 GB/s)",
        448,
        note="ROCm: the trace assumes CUDA sm90 kernels and workspaces, which ROCm's differ from",
        multiprocessors=304,
    ),
)

_BY_NAME = {gpu.name: gpu for gpu in GPUS} | {"h100-80gb": next(g for g in GPUS if g.name == "h100")}


def find_gpu(name: str) -> Gpu:
    gpu = _BY_NAME.get(name.lower())
    if gpu is None:
        raise UserError(f"Unknown GPU {name!r}. Known: {', '.join(g.name for g in GPUS)} (python -m tracer gpus).")
    return gpu


def gpu_for_device_name(device_name: str) -> Gpu | None:
    """The catalog entry for a name ``torch.cuda.get_device_name`` reports ("NVIDIA H100 80GB HBM3")."""
    name = device_name.lower()
    matches = [gpu for gpu in GPUS if gpu.description.lower() in name or name in gpu.description.lower()]
    return max(matches, key=lambda gpu: len(gpu.description), default=None)
