"""Published GPU measurements, reproduced: each case is a public table row with its source, the setup mapped to
the command line (a ``--recipe`` and flags), the metric the source reports, and the error of the estimate.

    python -m benchmarks.published [--markdown]

No constant is fitted to these numbers: every byte comes from the traced step and the runtimes' rules. Rows
whose model or setup cannot be reproduced are listed with the reason instead of a number.

Sources: torchtitan's Llama 3.1 benchmarks on H100 (torchtitan's own model code, estimated with transformers'
Llama of the same config), and Answer.AI's fsdp_qlora benchmarks (AnswerDotAI/fsdp_qlora benchmarks_03_2024.md, read at
05ed9f2; train.py at 50efa1e). Its template command: ``train.py --model_name meta-llama/Llama-2-7b-hf
--batch_size 1 --context_length 512 --train_type qlora --use_gradient_checkpointing True
--reentrant_checkpointing True --use_cpu_offload False --dataset dummy`` on 2 GPUs; its tables report
``torch.cuda.max_memory_reserved`` of rank 0 ("the reported peak reserved memory ... the peak allocated memory is
8.28 GiB vs 9.16 GiB"). train.py trains rank-64 adapters (alpha 16, dropout 0.1) on q, k, v, up, down and
gate projections, in pure bf16, FSDP1 FULL_SHARD (``ddp`` is FSDP's NO_SHARD), sdpa attention.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from tabulate import tabulate

from analysis.arguments import layout_of, setup_of
from analysis.cli import _parse
from analysis.estimate import estimate
from tracer.units import GIB

ANSWER_AI = "AnswerDotAI/fsdp_qlora benchmarks_03_2024.md"
# The runs date from February and March 2024, before peft 0.11 (huggingface/peft#1706, released 2024-05-15)
# began keeping the adapters of a bf16 model in fp32: theirs were bf16.
FSDP_QLORA = (
    "--recipe", "fsdp-qlora", "--lora-r", "64", "--lora-alpha", "16", "--lora-dropout", "0.1",
    "--lora-targets", "q_proj,k_proj,v_proj,up_proj,down_proj,gate_proj", "--adapter-dtype", "model", "--gpus", "2",
)  # fmt: skip
SHARDED = ("--zero", "3")
OFFLOADED = ("--zero", "3", "--offload", "optimizer,params")
NO_SHARD = ("--zero", "0")  # FSDP NO_SHARD: whole parameters on each GPU, gradients all-reduced (as DDP)


@dataclass(frozen=True)
class Published:
    source: str  # where the row is, with its lines
    row: str
    model: str
    flags: tuple[str, ...]
    metric: str  # "reserved" (max_memory_reserved) or "allocated" (max_memory_allocated)
    gib: float  # the published figure, GiB (2**30 bytes)


def _answer_ai(
    lines: str, row: str, qlora: bool, batch: int, context: int, sharding, gpu: str, gib: float, metric="reserved"
) -> Published:
    kind = ("--qlora",) if qlora else ()
    flags = (*FSDP_QLORA, *kind, *sharding, "--batch-size", str(batch), "--seq-len", str(context), "--gpu", gpu)
    return Published(f"{ANSWER_AI}:{lines}", row, "meta-llama/Llama-2-7b-hf", flags, metric, gib)


CASES = [
    _answer_ai("32-37", "QLoRA, batch 1, 512", True, 1, 512, SHARDED, "rtx3090", 4.98),
    _answer_ai("32-37", "QLoRA, batch 1, 2048", True, 1, 2048, SHARDED, "rtx3090", 5.21),
    _answer_ai("42-47", "LoRA, batch 1, 512", False, 1, 512, SHARDED, "rtx3090", 10.24),
    _answer_ai("50", "LoRA, batch 1, 512", False, 1, 512, SHARDED, "rtx3090", 8.28, "allocated"),
    _answer_ai("42-47", "LoRA, batch 1, 2048", False, 1, 2048, SHARDED, "rtx3090", 10.22),
    _answer_ai("50", "LoRA, batch 1, 2048", False, 1, 2048, SHARDED, "rtx3090", 9.16, "allocated"),
    _answer_ai("55-62", "QLoRA, batch 4, 2048", True, 4, 2048, SHARDED, "rtx3090", 11.22),
    _answer_ai("55-62", "QLoRA, batch 10, 2048", True, 10, 2048, SHARDED, "rtx3090", 20.97),
    _answer_ai("55-62", "LoRA, batch 4, 2048", False, 4, 2048, SHARDED, "rtx3090", 16.14),
    _answer_ai("55-62", "LoRA, batch 6, 2048", False, 6, 2048, SHARDED, "rtx3090", 21.35),
    _answer_ai("70-75", "QLoRA, NO_SHARD, batch 8, 2048", True, 8, 2048, NO_SHARD, "rtx3090", 20.94),
    _answer_ai("70-75", "LoRA, NO_SHARD, batch 4, 2048", False, 4, 2048, NO_SHARD, "rtx3090", 22.04),
    _answer_ai("123-132", "LoRA, CPU offload, batch 10, 2048", False, 10, 2048, OFFLOADED, "rtx4090", 22.69),
    _answer_ai("123-132", "QLoRA, CPU offload, batch 12, 2048", True, 12, 2048, OFFLOADED, "rtx4090", 22.38),
]
TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
# torchtitan 9dec370 (2024-12-26), 8 H100 per host; train_configs/llama3_8b.toml: 8192 tokens, selective
# checkpointing per op; FSDP2 with bf16 parameters and fp32 reductions; the logged memory is
# memory_stats()["reserved_bytes.all.peak"], the maximum over the GPUs.
TORCHTITAN_8B = ("--recipe", "torchtitan", "--zero", "3", "--batch-size", "2", "--seq-len", "8192", "--gpu", "h100")
CASES += [
    Published(f"{TORCHTITAN}: Table 1", "Llama 3.1 8B, FSDP over 8", "meta-llama/Llama-3.1-8B",
              (*TORCHTITAN_8B, "--gpus", "8"), "reserved", 82.4),
    Published(f"{TORCHTITAN}: Table 3", "Llama 3.1 8B, FSDP over 128", "meta-llama/Llama-3.1-8B",
              (*TORCHTITAN_8B, "--gpus", "128"), "reserved", 67.0),
]  # fmt: skip
NOT_REPRODUCED = [
    (f"{ANSWER_AI}:87-92, 140-145", "Yi 34B rows", "the model id is not given and its config is not bundled"),
    (f"{ANSWER_AI}:161-166", "Mistral 7B v0.2 rows", "the model id is not given; v0.2's config is not bundled"),
    (f"{ANSWER_AI}:102-106, 151-155", "Llama-2 70B QLoRA, CPU offload", "whether activations were offloaded too is "
     "not stated (the prose mentions it)"),
    (f"{TORCHTITAN}: Tables 1, 3", "with torch.compile, Float8", "compiled kernels and float8 are not modelled"),
    (f"{TORCHTITAN}: Tables 2, 4-6", "CP, TP with Float8, PP", "context and pipeline parallelism and float8 are not "
     "modelled yet"),
]  # fmt: skip


def measure_case(case: Published) -> int:
    args = _parse(["analyze", case.model, *case.flags, "--quiet"])
    report = estimate(args.model, setup_of(args), layout_of(args)).report
    return report.reserved_bytes if case.metric == "reserved" else report.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows, errors = [], []
    for case in CASES:
        estimated = measure_case(case) / GIB
        error = (estimated - case.gib) / case.gib
        errors.append(abs(error))
        flags = " ".join(case.flags[len(FSDP_QLORA) :] if case.source.startswith(ANSWER_AI) else case.flags)
        rows.append((case.source, case.row, case.metric, flags, f"{case.gib:.2f}", f"{estimated:.2f}", f"{error:+.1%}"))
    flags_header = "flags (Answer.AI's after the fsdp-qlora recipe)"
    headers = ["source", "row", "metric", flags_header, "published GiB", "estimate", "error"]
    print(tabulate(rows, headers, tablefmt="github" if args.markdown else "simple", disable_numparse=True))
    print(
        f"\n{len(rows)} cases: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}, "
        f"{sum(e <= 0.05 for e in errors)} within 5%"
    )
    print("\nNot reproduced:")
    for source, row, why in NOT_REPRODUCED:
        print(f"  {source} ({row}): {why}")


if __name__ == "__main__":
    main()
