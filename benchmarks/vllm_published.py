"""``serve --engine vllm`` against published vLLM start-up logs: the weights each rank loads, the profile run's
activation peak, the KV-cache memory and its size in tokens, case by case, with the error of each.

    python -m benchmarks.vllm_published [--markdown]

The logs: llm-d-incubation/llm-d-planner committed full ``vllm serve`` pod logs of vLLM 0.19.0 on H100 80GB HBM3 at
``VLLM_LOGGING_LEVEL=DEBUG`` (PR #205, commit d3121e0 "Add logs", 2026-04-22; removed again in 2489dbb), which
print, per worker, "Model loading took", "torch peak memory increase", "non-torch forward increase memory",
"Available KV cache memory" and "GPU KV cache size", and, after the KV cache, "Graph capturing finished in N secs,
took X GiB" (the CUDA graphs, compared with the estimated pool they share, a lower bound). Each case runs with what
its log's "non-default args" line passed (``--gpu-memory-utilization 0.95 --max-model-len ...
--no-enable-prefix-caching``; gpt-oss's left the utilization at 0.9; the GPTQ checkpoint's added ``--dtype
float16``) and vLLM 0.19's defaults on an H100 (``max_num_seqs`` 1024, ``max_num_batched_tokens`` 8192, as the log's
engine config states), on the 79.19 GiB the log's memory snapshot reports.
The non-torch memory (NCCL, cuBLAS, custom all-reduce) is not predicted: as a user would, each case passes its log's
figure to ``--non-torch-memory``. No other number is taken from the logs, and nothing is fitted to them. A GPTQ or AWQ
checkpoint whose config is not bundled is its bundled 16-bit sibling's config plus the ``quantization_config`` its model
card states, cited beside the case.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from dataclasses import dataclass

import torch
from tabulate import tabulate

from analysis.vllm import VllmSetup, vllm_startup
from tracer.gpus import find_gpu
from tracer.resolve import resolve_model
from tracer.units import GIB

LOGS = (
    "https://github.com/llm-d-incubation/llm-d-planner/blob/d3121e059da88662db39a926a3ead964be97359b/"
    "accuracy/results/v0.19.0/logs/"
)
TOTAL_MEMORY_GIB = 79.19  # "worker init memory snapshot: ... total_memory=79.19GiB" (every log, H100 80GB HBM3)
UTILIZATION = 0.95  # --gpu-memory-utilization in the "non-default args" of every case but gpt-oss's (0.9)
MAX_NUM_SEQS = 1024  # vLLM 0.19's default on an H100, as each log's engine config prints it
MAX_NUM_BATCHED_TOKENS = 8192  # "Chunked prefill is enabled with max_num_batched_tokens=8192."


@dataclass(frozen=True)
class Logged:
    """One start-up log: what was run, and the figures it printed (GiB as printed, tokens exactly)."""

    log: str  # file name under LOGS
    model: str  # the bundled config of the served checkpoint (its -Instruct/-it sibling: same architecture)
    served: str  # the checkpoint vLLM served
    tp: int
    max_model_len: int
    kv_cache_dtype: str
    quantization: str | None  # --quantization: how the served checkpoint's weights are modelled
    quantization_config: dict | None  # a GPTQ or AWQ checkpoint's, added to the bundled 16-bit config
    dtype: torch.dtype | None  # --dtype, where the log's non-default args pass one
    utilization: float  # --gpu-memory-utilization
    non_torch: float  # "non-torch forward increase memory", the one figure given as input
    weights: float  # "Model loading took" / "weights memory"
    activation: float  # "torch peak memory increase"
    kv: float  # "Available KV cache memory"
    tokens: int  # "GPU KV cache size: N tokens"
    graphs: float  # "Graph capturing finished in N secs, took X GiB" (capture_model, after the KV cache)
    kind: str


def _case(log: str, model: str, served: str, kind: str, tp: int = 1, max_model_len: int = 8192, **logged) -> Logged:
    kv_cache_dtype, quantization = logged.pop("kv_cache_dtype", "auto"), logged.pop("quantization", None)
    checkpoint, dtype = logged.pop("quantization_config", None), logged.pop("dtype", None)
    utilization = logged.pop("utilization", UTILIZATION)
    return Logged(
        log, model, served, tp, max_model_len, kv_cache_dtype, quantization, checkpoint, dtype, utilization,
        kind=kind, **logged,
    )  # fmt: skip


# RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16, a GPTQ checkpoint (its log: "The model is convertible to
# gptq_marlin", "Using MacheteLinearKernel for GPTQMarlinLinearMethod"): INT4 weights, "symmetric per-group
# quantization ... per group of 128 parameters", the linear layers of the blocks only
# (https://huggingface.co/RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16). Its desc_act is in no copy of its
# config found here; on one Hopper GPU act-order would add only Machete's int32 permutation of each layer's inputs,
# 3.25 MiB, under the log's 0.01 GiB: the case runs without it.
W4A16_LLAMA = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}


LLAMA_8B, QWEN_7B = "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"
CASES = [
    _case("meta-llama-llama-3-1-8b---h100-80gb--tp1pp1dp1--8192.log", LLAMA_8B, "meta-llama/Llama-3.1-8B-Instruct",
          "dense", non_torch=0.25, weights=14.99, activation=1.89, kv=58.11, tokens=476016, graphs=0.91),
    _case("meta-llama-llama-3-1-8b--h100-80gb--tp1pp1dp1--32768.log", LLAMA_8B, "meta-llama/Llama-3.1-8B-Instruct",
          "dense", max_model_len=32768, non_torch=0.25, weights=14.99, activation=1.89, kv=58.11, tokens=476016,
          graphs=0.91),
    _case("meta-llama-llama-3-1-8b---h100-80gb--tp2pp1dp1--8192.log", LLAMA_8B, "meta-llama/Llama-3.1-8B-Instruct",
          "dense", tp=2, non_torch=2.07, weights=7.51, activation=1.89, kv=63.76, tokens=1044688, graphs=0.76),
    _case("meta-llama-llama-3-1-8b---h100-80gb--tp4pp1dp1--8192.log", LLAMA_8B, "meta-llama/Llama-3.1-8B-Instruct",
          "dense", tp=4, non_torch=2.13, weights=3.77, activation=1.89, kv=67.44, tokens=2209792, graphs=0.67),
    _case("meta-llama---h100-80gb--tp1pp1dp1--8192-dtbf16-kvfp8.log", LLAMA_8B, "meta-llama/Llama-3.1-8B-Instruct",
          "dense, fp8 KV cache", kv_cache_dtype="fp8", non_torch=0.25, weights=14.99, activation=1.89, kv=58.11,
          tokens=952032, graphs=0.91),
    _case("qwen-qwen2-5-7b-instruct--h100-80gb--tp1pp1dp1--8192.log", QWEN_7B, "Qwen/Qwen2.5-7B-Instruct",
          "dense", non_torch=0.24, weights=14.25, activation=2.21, kv=58.53, tokens=1096000, graphs=0.87),
    _case("qwen-qwen2---h100-80gb--tp1pp1dp1--8192-dtbf16-kvfp8.log", QWEN_7B, "Qwen/Qwen2.5-7B-Instruct",
          "dense, fp8 KV cache", kv_cache_dtype="fp8", non_torch=0.24, weights=14.25, activation=2.21, kv=58.53,
          tokens=2192000, graphs=0.86),
    _case("qwen-qwen3-8b--h100-80gb--tp1pp1dp1--8192.log", "Qwen/Qwen3-8B", "Qwen/Qwen3-8B",
          "dense", non_torch=0.25, weights=15.27, activation=2.21, kv=57.5, tokens=418688, graphs=0.96),
    _case("qwen-qwen2-5-72b-instruc--h100-80gb--tp2pp1dp1--8192.log", "Qwen/Qwen2.5-72B", "Qwen/Qwen2.5-72B-Instruct",
          "dense", tp=2, non_torch=2.09, weights=67.8, activation=2.29, kv=3.04, tokens=19920, graphs=1.61),
    # RedHatAI's checkpoint holds the bf16 model's linear layers in FP8 with a float32 scale per output channel
    # (compressed-tensors, CompressedTensorsW8A8Fp8 in the log); --quantization fp8 gives the same FP8 weights
    # with a scale per layer: 10 MB apart at TP 4
    _case("fp8dyn-llama-3-3-70b--h100-80gb--tp4pp1dp1--8192.log", "meta-llama/Llama-3.3-70B-Instruct",
          "RedHatAI/Llama-3.3-70B-Instruct-fp8-dynamic", "dense, FP8 weights", tp=4, quantization="fp8",
          non_torch=2.21, weights=16.96, activation=1.97, kv=54.09, tokens=708992, graphs=1.66),
    _case("w4a16-redhatai-lla--h100-80gb--tp1pp1dp1--8192-dtf16.log", LLAMA_8B,
          "RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "dense, GPTQ 4-bit weights (Machete), fp16",
          quantization_config=W4A16_LLAMA, dtype=torch.float16, non_torch=0.25, weights=5.38, activation=1.89,
          kv=67.71, tokens=554704, graphs=0.96),
    # its "non-default args" leave --gpu-memory-utilization at vLLM's 0.9
    _case("openai-gpt-oss-20b--h100-80gb--tp2pp1dp1--8192.log", "openai/gpt-oss-20b", "openai/gpt-oss-20b",
          "MoE, MXFP4 experts, sliding window (hybrid)", tp=2, utilization=0.9, non_torch=2.07, weights=7.01,
          activation=2.87, kv=59.32, tokens=2591776, graphs=1.55),
    _case("mistralai-mixtral-8x7b-i--h100-80gb--tp2pp1dp1--8192.log", "mistralai/Mixtral-8x7B-v0.1",
          "mistralai/Mixtral-8x7B-Instruct-v0.1", "MoE", tp=2, non_torch=2.07, weights=43.51, activation=1.21,
          kv=28.44, tokens=465936, graphs=0.93),
    _case("qwen-qwen3-30b-a3b--h100-80gb--tp1pp1dp1--8192.log", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B",
          "MoE", non_torch=0.27, weights=56.88, activation=2.68, kv=15.41, tokens=168288, graphs=1.41),
    _case("google-gemma-2-9b-it--h100-80gb--tp1pp1dp1--8192.log", "google/gemma-2-9b", "google/gemma-2-9b-it",
          "sliding window (hybrid)", non_torch=0.25, weights=17.22, activation=3.65, kv=54.12, tokens=168880,
          graphs=1.09),
    _case("mistralai-mistral-small---h100-80gb--tp1pp1dp1--8192.log", "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
          "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
          "dense, multimodal (its vision encoder's profile run not modelled)", non_torch=0.25, weights=44.76,
          activation=2.03, kv=28.19, tokens=184752, graphs=1.06),
    _case("meta-llama-llama-4-scout--h100-80gb--tp4pp1dp1--8192.log", "meta-llama/Llama-4-Scout-17B-16E-Instruct",
          "meta-llama/Llama-4-Scout-17B-16E-Instruct",
          "MoE, chunked local attention (hybrid), multimodal (its vision encoder's profile run not modelled)",
          tp=4, non_torch=2.17, weights=53.12, activation=3.19, kv=16.75, tokens=365968, graphs=1.13),
    _case("deepseek-ai-deepseek-v2---h100-80gb--tp1pp1dp1--8192.log", "deepseek-ai/DeepSeek-V2-Lite",
          "deepseek-ai/DeepSeek-V2-Lite-Chat", "MoE, MLA (compressed latent cached)", non_torch=0.26, weights=29.43,
          activation=1.93, kv=43.61, tokens=1505552, graphs=1.57),
    _case("google-gemma-3-4b-it--h100-80gb--tp1pp1dp1--8192.log", "google/gemma-3-4b-it", "google/gemma-3-4b-it",
          "sliding window (hybrid), multimodal (its vision encoder's profile run not modelled)", non_torch=0.25,
          weights=8.58, activation=3.89, kv=62.51, tokens=468144, graphs=0.67),
    _case("google-gemma-3-27b-it--h100-80gb--tp1pp1dp1--8192.log", "google/gemma-3-27b-it", "google/gemma-3-27b-it",
          "sliding window (hybrid), multimodal (its vision encoder's profile run not modelled)", non_torch=0.26,
          weights=51.45, activation=3.99, kv=19.53, tokens=36560, graphs=1.14),
]  # fmt: skip
NOT_REPRODUCED = [
    ("meta-llama-llama-3-1-8b---h100-80gb--tp1pp2dp1--8192.log", "pipeline parallelism is not modelled by serve"),
    ("moonshotai-kimi-vl-a3b-i--h100-80gb--tp2pp1dp1--8192.log", "config not bundled (Kimi-VL): no official copy"),
    ("google-gemma-3-12b-it--h100-80gb--tp1pp1dp1--8192.log", "config not bundled (Gemma 3 12B): no official copy"),
]  # fmt: skip


# AWQ checkpoints' "Model loading took X GiB" from vLLM logs users posted at INFO level (no memory snapshot, profile
# or non-torch lines: only the weights are checked). Each names its checkpoint, its TP size, "Using awq_marlin
# kernel" and fp16; none is on Hopper, so every layer runs on Marlin. The quantization_config is AutoAWQ's GEMM
# format as the checkpoints publish it (4-bit, groups of 128, zero points: TechxGenus/Meta-Llama-3-70B-AWQ's
# config.json); the bundled 16-bit config of the same architecture stands for the model.
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@dataclass(frozen=True)
class LoggedWeights:
    source: str
    model: str
    served: str
    tp: int
    gpu: str  # a GPU of the logged compute capability: it picks the kernel
    weights: str  # "Model loading took X GiB" as printed (5.2, or 18.55)

    @property
    def printed_to(self) -> float:
        """Half the printed figure's last digit, in GiB."""
        return 0.5 * 10 ** -len(self.weights.partition(".")[2])


AWQ_WEIGHTS = [
    LoggedWeights("vLLM 0.16.0 on 2 NVIDIA L40S, a public lab note 'Lab 1 - vLLM OpenAI Server: Llama 3 70B Instruct "
                  "(AWQ) on NVIDIA L40S (TP=2)' (02-27)", "meta-llama/Llama-3.1-70B",
                  "TechxGenus/Meta-Llama-3-70B-Instruct-AWQ", 2, "l40s", "18.55"),
    LoggedWeights("vLLM 0.17.0 on 2 GPUs of capability 8.9, a public log of `vllm serve /models/Qwen/Qwen3-8B-AWQ "
                  "--tensor-parallel-size 2` (05-11)", "Qwen/Qwen3-8B", "Qwen/Qwen3-8B-AWQ", 2, "l40s", "2.85"),
    LoggedWeights("vLLM 0.19.0 offline LLM() on Windows, one GPU ('Using MarlinLinearKernel for "
                  "AWQMarlinLinearMethod'), a public note on Qwen2.5-7B-Instruct-AWQ (04-20)", "Qwen/Qwen2.5-7B",
                  "Qwen/Qwen2.5-7B-Instruct-AWQ", 1, "rtx4090", "5.2"),
]  # fmt: skip


def estimate_weights(case: LoggedWeights) -> int:
    """The weights one rank loads, in bytes."""
    gpu = find_gpu(case.gpu)
    setup = VllmSetup(gpu.memory_bytes, tensor_parallel_size=case.tp, dtype=torch.float16, gpu=gpu)
    config = copy.deepcopy(resolve_model(case.model).config)
    config.quantization_config = AWQ
    return vllm_startup(config, setup).weights.total


def estimate(case: Logged):
    setup = VllmSetup(
        gpu_memory_bytes=int(TOTAL_MEMORY_GIB * GIB),
        gpu_memory_utilization=case.utilization,
        tensor_parallel_size=case.tp,
        max_model_len=case.max_model_len,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        kv_cache_dtype=case.kv_cache_dtype,
        non_torch_bytes=int(case.non_torch * GIB),
        quantization=case.quantization,
        dtype=case.dtype,
    )
    model = resolve_model(case.model)
    config = copy.deepcopy(model.config)
    if case.quantization_config:
        config.quantization_config = case.quantization_config
    return vllm_startup(config, setup, model.multimodal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    args = parser.parse_args()
    rows, errors, graph_errors = [], [], []
    for case in CASES:
        startup = estimate(case)
        error = (startup.kv_cache_tokens - case.tokens) / case.tokens
        errors.append(abs(error))
        pool = startup.graphs.pool_bytes / GIB
        graph_errors.append((pool - case.graphs) / case.graphs)
        rows.append(
            (
                case.served,
                case.kind,
                case.tp,
                case.max_model_len,
                f"{case.weights:.2f} / {startup.weights.total / GIB:.2f}",
                f"{case.activation:.2f} / {startup.activation_peak_bytes / GIB:.2f}",
                f"{case.kv:.2f} / {startup.kv_cache_bytes / GIB:.2f}",
                f"{case.tokens:,} / {startup.kv_cache_tokens:,}",
                f"{100 * error:+.2f}%",
                f"{case.graphs:.2f} / {pool:.2f}",
                f"{100 * graph_errors[-1]:+.0f}%",
                f"{startup.graphs.count:,}",
            )
        )
    headers = [
        "served", "kind", "TP", "max len", "weights GiB", "activation GiB", "KV GiB", "KV tokens", "error",
        "graphs GiB (pool)", "pool error", "graphs",
    ]  # fmt: skip
    print(
        "logged / estimated; vLLM 0.19.0, H100 80GB HBM3, --gpu-memory-utilization 0.95 but 0.9 for gpt-oss (logs: "
        + LOGS
        + ")\n"
    )
    print(tabulate(rows, headers, tablefmt="github" if args.markdown else "simple", disable_numparse=True))
    print(
        f"\n{len(rows)} cases: KV tokens median |error| {100 * statistics.median(errors):.2f}%, "
        f"max {100 * max(errors):.2f}%, {sum(e <= 0.05 for e in errors)} within 5%"
    )
    print(
        "CUDA graphs: 'took X GiB' against the estimated pool (the largest capture's working set, a lower bound: the "
        f"driver's memory per graph is not predicted): median {100 * statistics.median(graph_errors):+.0f}%, from "
        f"{100 * min(graph_errors):+.0f}% to {100 * max(graph_errors):+.0f}%"
    )
    print("\nNot reproduced:")
    for log, why in NOT_REPRODUCED:
        print(f"  {log}: {why}")
    weights = [
        (case.served, case.tp, f"{case.weights} / {estimate_weights(case) / GIB:.3f}", case.source)
        for case in AWQ_WEIGHTS
    ]
    print("\nAWQ checkpoints, the weights per GPU only (INFO-level logs; logged / estimated GiB):\n")
    print(tabulate(weights, ["served", "TP", "weights GiB", "log"], tablefmt="github" if args.markdown else "simple"))


if __name__ == "__main__":
    main()
