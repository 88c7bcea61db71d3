"""Estimated peaks of 2025-2026 models per GPU: full fine-tuning, LoRA, QLoRA and inference at 8k, on 1 to 8 GPUs.

    python -m benchmarks.model_table [--markdown] [--models ID ...]

Training: bf16 weights under bf16 autocast (the Trainer's ``bf16=True`` on a bf16 checkpoint), AdamW, full
activation checkpointing, batch 1 of 4,096 tokens. Full fine-tuning on one GPU and under FSDP2 over 8; LoRA and
QLoRA (NF4 weights computing in bf16) adapters of rank 16 on the attention and MLP projections, on one GPU.
Inference: bf16 (a checkpoint published in MXFP4 or FP8 as published), batch 1, an 8,192-token prompt then 256 new
tokens, as ``generate()`` runs it, on one GPU and tensor parallel over 4 (MoE experts expert-parallel where the
model's TP plan does not split them). H100 kernels; each cell is the estimated peak allocated memory of the busiest
GPU, in GiB.
"""

from __future__ import annotations

import argparse
import time

import transformers
from tabulate import tabulate

from analysis.estimate import analyze
from strategies.layout import Layout
from tracer.errors import UserError
from tracer.resolve import resolve_model
from tracer.training import LoraSetup, TrainingSetup
from tracer.units import GIB

MODELS = (
    "HuggingFaceTB/SmolLM3-3B",
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-32B",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "google/gemma-3-1b-it",
    "google/gemma-3-27b-it",
    "microsoft/phi-4",
    "mistralai/Mistral-Nemo-Base-2407",
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
    "meta-llama/Llama-3.3-70B-Instruct",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "deepseek-ai/DeepSeek-V2-Lite",
    "zai-org/GLM-4.5-Air",
    "openai/gpt-oss-20b",
    "openai/gpt-oss-120b",
)
TRAINING = {"seq_len": 4096, "dtype": "bf16", "mixed_precision": "bf16", "grad_checkpointing": "full"}
QLORA = {"seq_len": 4096, "dtype": "bf16", "grad_checkpointing": "full"}  # NF4 weights compute in bf16, no autocast
INFERENCE = {"mode": "inference", "seq_len": 8192, "dtype": "bf16", "max_new_tokens": 256}
# the attention and MLP projections, fused or not (peft's "all-linear" would also wrap Llama 4's router, whose
# tuple output its LoRA layer cannot take)
LORA = LoraSetup(
    r=16,
    targets=("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"),
)
GPUS = 8
TP = 4  # divides the 4 or 8 key/value heads of these models

# column -> (setup, layouts tried in order until one is modelled)
Column = tuple[TrainingSetup, tuple[Layout, ...]]
COLUMNS: dict[str, Column] = {
    "full FT, 1 GPU": (TrainingSetup(**TRAINING), (Layout(),)),
    f"full FT, FSDP2 x{GPUS}": (TrainingSetup(**TRAINING), (Layout(gpus=GPUS, zero=3),)),
    "LoRA, 1 GPU": (TrainingSetup(**TRAINING, lora=LORA), (Layout(),)),
    "QLoRA, 1 GPU": (TrainingSetup(**QLORA, lora=LORA, quantize="nf4"), (Layout(),)),
    "inference 8k, 1 GPU": (TrainingSetup(**INFERENCE), (Layout(),)),
    f"inference 8k, TP x{TP}": (
        TrainingSetup(**INFERENCE),
        (Layout(gpus=TP, tp=TP), Layout(gpus=TP, tp=TP, ep=TP)),
    ),
}


def cell(model, setup: TrainingSetup, layouts: tuple[Layout, ...], refusals: dict[str, int]) -> str:
    """The peak in GiB under the first layout that is modelled for this model, or the number of the reason none
    is (``refusals``: each reason's number, in order of first appearance)."""
    reason = ""
    for layout in layouts:
        try:
            report = analyze(model, setup, layout)
        except UserError as error:
            reason = reason or str(error)
            continue
        return f"{report.peak_bytes / GIB:.1f}" + (" (EP)" if layout.ep > 1 else "")
    return f"refused ({refusals.setdefault(reason, len(refusals) + 1)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a GitHub markdown table")
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="model ids (default: the table's)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    rows, refusals, start = [], {}, time.time()
    for model_id in args.models:
        model = resolve_model(model_id)
        row = [model_id]
        for name, (setup, layouts) in COLUMNS.items():
            began = time.time()
            row.append(cell(model, setup, layouts, refusals))
            print(f"{model_id}, {name}: {row[-1]} ({time.time() - began:.0f} s)", flush=True)
        rows.append(row)
    print(tabulate(rows, headers=["model", *COLUMNS], tablefmt="github" if args.markdown else "simple"))
    print(f"\nGiB per GPU, estimated peak allocated memory ({time.time() - start:.0f} s).")
    for reason, number in refusals.items():
        print(f"\n({number}) {reason}")


if __name__ == "__main__":
    main()
