"""``python -m tracer``: a thin command line over :func:`analysis.estimate.analyze` and friends."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager

from analysis.flags import MAX_COUNT, MAX_SEQ_LEN, OneLineParser, count, rate, share
from tracer.errors import UserError
from tracer.gpus import PCIE_4_X16_GBPS
from tracer.training import (
    ATTENTIONS,
    CACHES,
    CHECKPOINTING,
    DTYPES,
    MODES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    LoraSetup,
    Target,
    TrainingSetup,
)

EXIT_USER_ERROR = 2
GENERATE_LOGITS_TO_KEEP = 1  # generate() computes the prefill's logits at the last position only


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        _quiet_libraries()
        return args.run(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m tracer",
        description="Predict the peak GPU memory of fine-tuning a Hugging Face decoder LLM, by tracing one "
        "training step on fake tensors (nothing is allocated, nothing is downloaded).",
    )
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    analyze = commands.add_parser(
        "analyze",
        help="estimate the peak memory of one training step",
        description="Estimate torch.cuda.max_memory_allocated of one steady-state training step: "
        "loss = model(input_ids, labels=labels).loss; loss.backward(); optimizer.step(); "
        "optimizer.zero_grad(set_to_none=True).",
    )
    _add_step_arguments(analyze)
    _add_layout_arguments(analyze)
    analyze.add_argument(
        "--by-module",
        type=count(maximum=64),
        metavar="DEPTH",
        default=None,
        help="also print what each module (its path cut to DEPTH parts, e.g. 3 = model.layers.N) holds at the "
        "peak, and the 10 largest storages live there",
    )
    analyze.add_argument(
        "--html",
        metavar="FILE",
        default=None,
        help="also write the report as one self-contained page: the interactive timeline (zoom, hover for an op, "
        "phases, the GPU's memory, the peak) and every section of the terminal report, with the per-module view",
    )
    analyze.add_argument_group("sweep").add_argument(
        "--sweep",
        nargs="+",
        metavar="AXIS=V1,V2",
        default=None,
        help="estimate every combination of these values instead of one setup and print a table, e.g. "
        "--sweep seq-len=512,2048,8192 batch=1,8,32; axes: batch, seq-len, max-new-tokens (inference); with "
        "--target cuda, also which fit --gpu and the largest of each axis that does",
    )
    analyze.set_defaults(run=_run_analyze)

    measure = commands.add_parser(
        "measure",
        help="run the same step with real tensors and measure it",
        description="Run two real training steps (random weights) and report the memory of the second: "
        "torch.cuda.max_memory_allocated with --target cuda, tracked storage bytes with --target cpu.",
    )
    _add_step_arguments(measure)
    measure.set_defaults(run=_run_measure)

    timeline = commands.add_parser(
        "timeline",
        help="write the estimated step op by op: a plot, a page, a table or a memory_viz snapshot",
        description="Estimate as analyze does, then write live memory by category at every op of the busiest GPU. "
        "The suffix of -o picks the format: .png (stacked plot, phases, the peak; the GPU's memory with --gpu), "
        ".html (one self-contained interactive page), .csv / .json (one row per op), .pickle (a snapshot in the "
        "format of torch.cuda.memory._dump_snapshot, for pytorch.org/memory_viz).",
    )
    timeline.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="file to write (.png .html .csv .json .pickle)"
    )
    _add_step_arguments(timeline)
    _add_layout_arguments(timeline)
    timeline.set_defaults(run=_run_timeline)

    compare = commands.add_parser(
        "compare",
        help="our estimate beside the analytic formulas people use",
        description="Estimate as analyze does and print, beside it, the 16 bytes/parameter rule, DeepSpeed's "
        "model-state estimator, accelerate's estimate-memory, LLMem's formulas and Korthikanti et al.'s "
        "activation formula on the same setup, category by category (parameters, gradients, optimizer states, "
        "activations, logits and loss, other), with one line explaining each difference of 5% of the peak or more: "
        "what the formula assumes and what the trace holds instead.",
    )
    _add_step_arguments(compare)
    _add_layout_arguments(compare)
    compare.set_defaults(run=_run_compare)

    planner = commands.add_parser(
        "plan",
        help="rank every multi-GPU layout by training speed, each at the largest micro-batch that fits",
        description="For MODEL on --gpus GPUs of one kind: every layout (DDP, ZeRO-1/2/3 as PyTorch and DeepSpeed "
        "run them, every tensor-parallel degree that divides the GPUs and the heads, their products, optimizer "
        "offload), each with and without full activation checkpointing; for each, the largest micro-batch whose "
        "predicted reserved memory plus CUDA context fits the GPU less --margin, the gradient accumulation that "
        "reaches --global-batch, and the step time and tokens/s; then one recommendation and why.",
    )
    _add_step_arguments(planner, searches_batch=True)
    _add_plan_arguments(planner)
    planner.set_defaults(run=_run_plan)

    gpus = commands.add_parser("gpus", help="list the GPU catalog (memory, throughput, bandwidth, interconnect)")
    gpus.add_argument("--json", action="store_true", help="print JSON instead of a table")
    gpus.set_defaults(run=_run_gpus)

    models = commands.add_parser("models", help="list the bundled model configs")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.set_defaults(run=_run_models)
    return parser


def _add_step_arguments(parser: argparse.ArgumentParser, searches_batch: bool = False) -> None:
    """The setup of the step; ``searches_batch``: the command picks the batch size (and trains on CUDA)."""
    defaults = TrainingSetup()
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a Hugging Face model id (bundled, cached or on the Hub), a config.json path, or a directory "
        "holding config.json",
    )
    if not searches_batch:
        parser.add_argument(
            "--batch-size", type=count(), default=defaults.batch_size, help="sequences per step (default 1)"
        )
    parser.add_argument(
        "--seq-len",
        type=count(maximum=MAX_SEQ_LEN),
        default=defaults.seq_len,
        help="tokens per sequence (default 1024)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the stored parameters: given alone, the whole step runs in it (pure bf16 or fp16, or "
        "plain fp32). Default: fp32 under --mixed-precision for training; bf16 (fp16 on GPUs without bf16) for "
        "inference and for quantized base weights, the dtype checkpoints are served and computed in",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("bf16", "fp16", "off"),
        default=None,
        help="run the forward under autocast in this dtype, with fp32 weights, gradients and optimizer states "
        "(fp16 adds a GradScaler); under FSDP2 (--zero 2, 3) or DeepSpeed, their own mixed precision instead: "
        "low-precision compute, fp32 shards or master weights. Default for training without --dtype: bf16 "
        "(fp16 on GPUs without bf16), the recipe of the HF Trainer's bf16=True that fine-tuning runs use; "
        "off for plain fp32",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=None,
        help="torch.optim.AdamW (default), Adam, SGD with momentum 0.9, transformers' Adafactor (as the Trainer "
        "builds it), or bitsandbytes' AdamW8bit",
    )
    parser.add_argument(
        "--optimizer-impl",
        choices=OPTIMIZER_IMPLS,
        default=None,
        help="implementation of torch's adamw/adam/sgd: foreach (multi-tensor, with temporaries for all "
        "parameters at once), fused (one kernel, no temporaries) or for-loop; default: torch's choice for the "
        "device (foreach on CUDA)",
    )
    parser.add_argument(
        "--attn",
        choices=ATTENTIONS,
        default=defaults.attn,
        help="attention implementation; sdpa (default) falls back to eager for models without an SDPA path",
    )
    if not searches_batch:
        parser.add_argument(
            "--target",
            choices=[t.value for t in Target],
            default=defaults.target.value,
            help="reproduce what a CUDA GPU runs (default) or what the CPU runs (for comparing with measure on CPU)",
        )
    parser.add_argument(
        "--gpu",
        default=None,
        help="GPU whose kernels and library workspaces are assumed with --target cuda (default h100); timeline "
        "draws its memory",
    )
    parser.add_argument(
        "--expandable-segments",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the CUDA caching allocator with expandable segments, which changes reserved memory and how "
        "blocks split (default: as PYTORCH_CUDA_ALLOC_CONF in this shell says, else off)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    _add_variant_arguments(parser)
    if not searches_batch:
        _add_inference_arguments(parser)


def _add_inference_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("inference", "With --mode inference: generation instead of a training step.")
    group.add_argument(
        "--mode",
        choices=MODES,
        default="train",
        help="train (default): one training step; inference: under no_grad, the prefill of a --seq-len prompt and "
        "the decode step of the last of --max-new-tokens tokens, with a KV cache",
    )
    group.add_argument(
        "--max-new-tokens", type=count(), default=None, help="tokens generated after the prompt (default 1)"
    )
    group.add_argument(
        "--cache", choices=CACHES, default=None, help="transformers' DynamicCache (default) or StaticCache"
    )
    group.add_argument(
        "--logits-to-keep",
        type=count(minimum=0, maximum=MAX_SEQ_LEN),
        default=None,
        help="prefill computes the logits of the last N positions only (0: all, the plain forward's default); "
        "default 1, as generate() passes it",
    )
    group.add_argument(
        "--quantize",
        choices=("int8", "int4", "nf4"),
        default=None,
        help="weights stored as bitsandbytes stores them: LLM.int8(), FP4 or NF4 (blocksize 64, double "
        "quantization); computing in bf16 unless --dtype fp16 (fp16 on GPUs without bf16)",
    )


def _add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fine-tuning variants")
    group.add_argument(
        "--grad-checkpointing",
        choices=CHECKPOINTING,
        nargs="?",
        const="full",
        default=None,
        help="recompute activations in backward: full = every decoder layer (model.gradient_checkpointing_enable), "
        "selective = the attention of every decoder layer; the bare flag means full, as HF's "
        "gradient_checkpointing=True does; default: off",
    )
    group.add_argument(
        "--reentrant", action="store_true", help="with --grad-checkpointing full: use_reentrant=True (default False)"
    )
    group.add_argument(
        "--grad-accum",
        type=count(),
        default=1,
        help="micro-steps per optimizer step (gradient accumulation, default 1)",
    )
    group.add_argument(
        "--keep-outputs",
        action="store_true",
        help="your loop keeps the model's outputs through backward (outputs = model(**batch); "
        "loss = outputs.loss, as accelerate's examples do): the logits and the key/value cache transformers "
        "returns in training live until the next forward returns. Default: dropped before backward, as the "
        "HF Trainer does",
    )
    group.add_argument(
        "--lora-r", type=count(), default=None, help="train LoRA adapters of this rank (peft); default: off"
    )
    group.add_argument("--lora-alpha", type=count(), default=None, help="LoRA alpha (default 16)")
    group.add_argument("--lora-dropout", type=share, default=None, help="LoRA dropout (default 0)")
    group.add_argument(
        "--lora-targets",
        default=None,
        help="comma-separated module names to adapt, e.g. q_proj,v_proj (default: peft's choice for the model)",
    )
    quantization = group.add_mutually_exclusive_group()
    quantization.add_argument(
        "--qlora",
        action="store_true",
        help="QLoRA: NF4 base weights with double quantization (bitsandbytes), LoRA adapters (rank 8 unless "
        "--lora-r); computing in bf16 unless --dtype fp16 (fp16 on GPUs without bf16)",
    )
    quantization.add_argument(
        "--load-in-8bit",
        action="store_true",
        help="LLM.int8() base weights (bitsandbytes) with LoRA adapters (rank 8 unless --lora-r)",
    )


def _add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    from strategies.layout import ENGINES, OFFLOADS, TP_OUTPUTS, ZERO_STAGES

    group = parser.add_argument_group(
        "parallel layout", "Estimate the memory of each GPU of a multi-GPU run. Default: one GPU."
    )
    group.add_argument("--gpus", type=count(), default=1, help="total number of GPUs (default 1)")
    group.add_argument(
        "--tp",
        type=count(),
        default=1,
        help="tensor-parallel degree: Megatron-style column/row-parallel attention and MLP, vocabulary-parallel "
        "embedding and lm_head; must divide --gpus and the attention heads (default 1); the data-parallel "
        "degree is gpus / tp",
    )
    group.add_argument(
        "--zero",
        type=int,
        choices=ZERO_STAGES,
        default=0,
        help="ZeRO stage over the data-parallel group: 0 replicates everything (DDP), 1 shards optimizer "
        "states, 2 also gradients, 3 also parameters (default 0)",
    )
    group.add_argument(
        "--engine",
        choices=ENGINES,
        default="fsdp",
        help="whose runtime is modelled: fsdp = PyTorch (DDP for --zero 0, DDP with ZeroRedundancyOptimizer "
        "for 1, FSDP2 fully_shard for 2 and 3), deepspeed = DeepSpeed ZeRO with its default bucket sizes "
        "(default fsdp)",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: shard the norms, residual stream and dropout along the sequence (Megatron SP)",
    )
    group.add_argument(
        "--offload",
        choices=OFFLOADS,
        default=None,
        metavar="KIND",
        help="keep in host memory: optimizer = the optimizer step and its state (DeepSpeed ZeRO-Offload, any "
        "--zero, one GPU included); optimizer,params = that and the parameters (DeepSpeed ZeRO-Infinity with "
        "--zero 3, or FSDP2's CPUOffloadPolicy with --zero 3); reports host memory and PCIe traffic",
    )
    group.add_argument(
        "--pcie-gbps",
        type=rate,
        default=None,
        help=f"with --offload: host link bandwidth each way in GB/s, for transfer times (default {PCIE_4_X16_GBPS}: "
        "PCIe 4.0 x16)",
    )
    group.add_argument(
        "--tp-output",
        choices=TP_OUTPUTS,
        default="parallel",
        help="with --tp: keep the lm_head output sharded over the vocabulary and compute a vocabulary-parallel "
        "loss (parallel, default), or all-gather the full logits on every GPU first, as ColossalAI's 1D TP and "
        "transformers' colwise_gather_output plan do (gathered)",
    )


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from analysis.budget import DEFAULT_MARGIN
    from analysis.steptime import GPUS_PER_NODE, HOST_OPTIMIZER_GBPS, INTERNODE_GBPS

    group = parser.add_argument_group("cluster and budget")
    group.add_argument("--gpus", type=count(), default=1, help="total number of GPUs (default 1)")
    group.add_argument(
        "--global-batch",
        type=count(maximum=MAX_COUNT * 1024),
        default=None,
        help="sequences per optimizer step over all GPUs, reached by gradient accumulation; default: each layout "
        "at its largest micro-batch without accumulation",
    )
    group.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="memory of each GPU, e.g. 80GiB or 24GB, instead of the --gpu catalog's",
    )
    group.add_argument(
        "--margin",
        type=share,
        default=DEFAULT_MARGIN,
        help=f"share of GPU memory kept free for what the estimate does not hold: NCCL buffers, side-stream pools, "
        f"the estimate's error (default {DEFAULT_MARGIN})",
    )
    group.add_argument(
        "--tflops", type=rate, default=None, help="peak dense TFLOP/s in the compute dtype, instead of the catalog's"
    )
    group.add_argument(
        "--memory-gbps", type=rate, default=None, help="GPU memory bandwidth in GB/s, instead of the catalog's"
    )
    group.add_argument(
        "--interconnect-gbps",
        type=rate,
        default=None,
        help="GPU-to-GPU bandwidth of one GPU in one direction inside a node, GB/s, instead of the catalog's",
    )
    group.add_argument(
        "--internode-gbps",
        type=rate,
        default=INTERNODE_GBPS,
        help=f"network bandwidth per GPU between nodes, one direction, GB/s (default {INTERNODE_GBPS:g}: 400 Gb/s)",
    )
    group.add_argument(
        "--gpus-per-node",
        type=count(),
        default=GPUS_PER_NODE,
        help=f"GPUs per node; tensor parallelism stays inside one (default {GPUS_PER_NODE})",
    )
    group.add_argument(
        "--pcie-gbps",
        type=rate,
        default=PCIE_4_X16_GBPS,
        help=f"host link bandwidth each way in GB/s, for offloading (default {PCIE_4_X16_GBPS}: PCIe 4.0 x16)",
    )
    group.add_argument(
        "--host-optimizer-gbps",
        type=rate,
        default=HOST_OPTIMIZER_GBPS,
        help=f"host memory bandwidth an offloaded optimizer step streams at, GB/s (default {HOST_OPTIMIZER_GBPS:g})",
    )
    group.add_argument("--no-offload", action="store_true", help="leave optimizer-offload layouts out")
    group.add_argument(
        "--jobs",
        type=count(maximum=1024),
        default=os.cpu_count() or 1,
        help="processes searching layouts (default: one per CPU)",
    )
    group.add_argument(
        "--html",
        metavar="FILE",
        default=None,
        help="also write the plan as one self-contained page: the table, then the recommended layout's report "
        "and interactive timeline (one more trace)",
    )


def _run_plan(args: argparse.Namespace) -> int:
    from analysis.budget import MemoryBudget
    from analysis.plan import plan
    from analysis.plan_render import plan_json, render_plan
    from analysis.steptime import Cluster
    from tracer.gpus import find_gpu
    from tracer.resolve import resolve_model
    from tracer.units import MIB, parse_bytes

    if args.grad_accum != 1:
        raise UserError("plan picks the gradient accumulation itself: give --global-batch instead of --grad-accum.")
    page = _writable(args.html, "--html", (".html",)) if args.html else None
    setup = _setup(args)
    gpu = find_gpu(setup.gpu)
    overrides = {}
    if args.gpu_memory:
        memory = parse_bytes(args.gpu_memory, "--gpu-memory")
        if memory < MIB:
            raise UserError(f"--gpu-memory {args.gpu_memory} is less than 1 MiB; give the GPU's memory, e.g. 80GiB.")
        overrides["memory_bytes"] = memory
    if args.tflops:
        overrides |= {"bf16_tflops": args.tflops, "fp16_tflops": args.tflops, "fp32_tflops": args.tflops}
    if args.memory_gbps:
        overrides["memory_gbps"] = args.memory_gbps
    if args.interconnect_gbps:
        overrides["interconnect_gbps"] = args.interconnect_gbps
    gpu = dataclasses.replace(gpu, **overrides)
    cluster = Cluster(gpu, args.gpus_per_node, args.internode_gbps, args.pcie_gbps, args.host_optimizer_gbps)
    budget = MemoryBudget(gpu.memory_bytes, args.margin)
    model = resolve_model(args.model)
    _warn_about_length(model, setup)
    with _progress_bar(args, "planning", unit="layout") as bar:
        result = plan(
            model,
            setup,
            args.gpus,
            cluster,
            budget,
            args.global_batch,
            offload=not args.no_offload,
            jobs=args.jobs,
            on_progress=bar,
        )
    print(json.dumps(plan_json(result), indent=2) if args.json else render_plan(result))
    if page:
        _write_plan_page(args, page, model, result, gpu)
    return 0


def _write_plan_page(args: argparse.Namespace, path, model, result, gpu) -> None:
    """The plan's page: its table, and the recommended layout's report and timeline (one more trace)."""
    from analysis.estimate import estimate
    from analysis.plan_render import render_plan
    from analysis.report_page import write_report_page
    from strategies.layout import accumulation_modelled

    best = result.best
    sections = {"Plan": render_plan(result)}
    if best is None:
        write_report_page(path, f"{model.model_id}: plan on {result.gpus} x {gpu.description}", [], sections)
        return
    layout = best.candidate.layout
    accumulation = best.accumulation if accumulation_modelled(layout) else 1
    setup = dataclasses.replace(
        result.setup,
        batch_size=best.micro_batch,
        grad_checkpointing=best.candidate.checkpointing,
        grad_accum=accumulation,
    )
    _progress(args, f"Tracing the recommended layout for {path} ...")
    recommended = estimate(model, setup, layout)
    verdict = result.budget.verdict(recommended.report, gpu.description)
    _write_page(path, model, setup, recommended, verdict, gpu, sections)
    _progress(args, f"Wrote {path}.")


def _run_gpus(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from tracer.gpus import GPUS, TOTAL_MEMORY_SOURCES
    from tracer.units import GIB

    if args.json:
        print(json.dumps([gpu.__dict__ | {"memory_source": TOTAL_MEMORY_SOURCES[gpu.name]} for gpu in GPUS], indent=2))
        return 0
    rows = [
        (
            gpu.name,
            gpu.description,
            f"{gpu.memory_bytes / GIB:.2f}",
            f"{gpu.bf16_tflops:g}" if gpu.bf16_tflops else "-",
            f"{gpu.fp16_tflops:g}",
            f"{gpu.fp32_tflops:g}",
            f"{gpu.memory_gbps:,.0f}",
            f"{gpu.interconnect} ({gpu.interconnect_gbps:g} each way)",
            f"sm{gpu.compute_capability[0]}{gpu.compute_capability[1]}",
        )
        for gpu in GPUS
    ]
    headers = ["--gpu", "GPU", "memory GiB", "bf16 TFLOP/s", "fp16", "fp32", "memory GB/s", "GPU-to-GPU GB/s", "arch"]
    print(
        tabulate(
            rows, headers=headers, colalign=("left", "left", *["right"] * 5, "left", "left"), disable_numparse=True
        )
    )
    notes = [f"  {gpu.name}: {gpu.note}" for gpu in GPUS if gpu.note]
    print(
        "\nMemory: the total torch reports (cudaDeviceProp.totalGlobalMem), less than the datasheet's GB; "
        "python -m tracer gpus --json cites each. Dense throughput (no sparsity), datasheet figures. --gpu-memory, "
        "--tflops, --memory-gbps and --interconnect-gbps override them.\n" + "\n".join(notes)
    )
    return 0


def _layout(args: argparse.Namespace):
    from strategies.layout import Layout

    return Layout(
        gpus=args.gpus,
        tp=args.tp,
        zero=args.zero,
        engine=args.engine,
        sequence_parallel=args.sequence_parallel,
        tp_output=args.tp_output,
        offload=args.offload,
    )


def _setup(args: argparse.Namespace) -> TrainingSetup:
    _refuse_flags_that_do_not_apply(args)
    defaults = TrainingSetup()
    quantize = "nf4" if args.qlora else "int8" if args.load_in_8bit else None
    if getattr(args, "quantize", None):
        quantize = "fp4" if args.quantize == "int4" else args.quantize
    lora = None
    if args.lora_r is not None or args.qlora or args.load_in_8bit:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) if args.lora_targets else None
        lora = LoraSetup(
            r=_given(args.lora_r, LoraSetup.r),
            alpha=_given(args.lora_alpha, LoraSetup.alpha),
            targets=targets,
            dropout=_given(args.lora_dropout, LoraSetup.dropout),
        )
    inference = {
        name: _given(getattr(args, name), getattr(defaults, name))
        for name in ("mode", "max_new_tokens", "cache")
        if hasattr(args, name)
    }
    if hasattr(args, "logits_to_keep"):
        inference["logits_to_keep"] = _given(args.logits_to_keep, GENERATE_LOGITS_TO_KEEP)
    dtype, mixed_precision = _precision(args, quantized=quantize is not None)
    return TrainingSetup(
        batch_size=getattr(args, "batch_size", 1),
        seq_len=args.seq_len,
        dtype=dtype,
        mixed_precision=mixed_precision,
        optimizer=_given(args.optimizer, defaults.optimizer),
        attn=args.attn,
        target=Target(getattr(args, "target", Target.CUDA.value)),
        gpu=args.gpu or TrainingSetup.gpu,
        grad_checkpointing=args.grad_checkpointing,
        reentrant=args.reentrant,
        lora=lora,
        quantize=quantize,
        grad_accum=args.grad_accum,
        keep_outputs=args.keep_outputs,
        optimizer_impl=args.optimizer_impl,
        pcie_gbps=_given(getattr(args, "pcie_gbps", None), PCIE_4_X16_GBPS),
        **inference,
        expandable_segments=_expandable_segments(args),
    )


def _precision(args: argparse.Namespace, quantized: bool) -> tuple[str, str | None]:
    """(--dtype, --mixed-precision) with the defaults people run: training in the HF Trainer's bf16 recipe
    (fp32 weights, bf16 autocast); inference and quantized base weights in bf16; fp16 instead of bf16 on a GPU
    without bf16 (V100, T4)."""
    from tracer.gpus import find_gpu

    if args.mixed_precision == "off":
        return args.dtype or "fp32", None
    if args.mixed_precision is not None or args.dtype is not None:
        return args.dtype or "fp32", args.mixed_precision
    cuda = getattr(args, "target", Target.CUDA.value) == Target.CUDA.value
    low = "fp16" if cuda and find_gpu(args.gpu or TrainingSetup.gpu).bf16_tflops is None else "bf16"
    if quantized or getattr(args, "mode", "train") == "inference":
        return low, None
    return "fp32", low


def _given(value, default):
    """A flag whose default is None so that giving it can be told apart from leaving it out."""
    return default if value is None else value


def _refuse_flags_that_do_not_apply(args: argparse.Namespace) -> None:
    """A flag that would be ignored is an error: the user meant something the estimate would not show."""

    def given(name: str) -> bool:
        return getattr(args, name, None) is not None

    inference = getattr(args, "mode", "train") == "inference"
    lora = given("lora_r") or args.qlora or args.load_in_8bit
    for name in ("lora_alpha", "lora_dropout", "lora_targets"):
        if given(name) and not lora:
            raise UserError(f"--{name.replace('_', '-')} sets up LoRA adapters: add --lora-r R (or --qlora).")
    if inference and given("optimizer"):
        raise UserError("--optimizer does not apply to inference: drop it with --mode inference.")
    for name in ("max_new_tokens", "cache", "logits_to_keep"):
        if given(name) and not inference:
            raise UserError(f"--{name.replace('_', '-')} applies to generation: add --mode inference.")
    if hasattr(args, "offload") and args.offload is None and given("pcie_gbps"):
        raise UserError("--pcie-gbps times transfers to host memory: add --offload, or drop it.")
    if getattr(args, "target", "cuda") == "cpu" and given("gpu"):
        raise UserError("--gpu picks the GPU that --target cuda reproduces: drop it with --target cpu.")


def _expandable_segments(args: argparse.Namespace) -> bool:
    if args.expandable_segments is not None:
        return args.expandable_segments
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower().replace(" ", "")
    return getattr(args, "target", Target.CUDA.value) == Target.CUDA.value and "expandable_segments:true" in conf


def _estimate(args: argparse.Namespace, model, setup: TrainingSetup, layout):
    """The estimate, with a progress bar on stderr (decoder layers in forward and backward, then ranks)."""
    from analysis.estimate import estimate

    _warn_about_length(model, setup)
    start = time.perf_counter()
    with _progress_bar(args, f"tracing {model.model_id}", unit="", leave=False) as bar:
        result = estimate(model, setup, layout, progress=bar)
    what = "inference" if setup.mode == "inference" else "one training step"
    _progress(args, f"Traced {what} of {model.model_id} on fake tensors in {time.perf_counter() - start:.1f} s.")
    return result


def _run_analyze(args: argparse.Namespace) -> int:
    from analysis.budget import MemoryBudget
    from analysis.modules import module_table, render_module_table
    from analysis.report import render_text
    from tracer.gpus import find_gpu
    from tracer.resolve import resolve_model

    page = _writable(args.html, "--html", (".html",)) if args.html else None
    setup = _setup(args)
    layout = _layout(args)
    gpu = find_gpu(setup.gpu)
    model = resolve_model(args.model)
    if args.sweep:
        if page:
            raise UserError("--html writes one step's report: drop it with --sweep.")
        return _run_sweep(args, model, setup, layout, gpu if setup.target is Target.CUDA else None)
    result = _estimate(args, model, setup, layout)
    report = result.report
    table = module_table(result.step, report.peak_op_index, args.by_module) if args.by_module else None
    budget = MemoryBudget(gpu.memory_bytes) if setup.target is Target.CUDA else None
    verdict = budget.verdict(report, gpu.description) if budget else None
    if args.json:
        fit = {"fit": budget.to_json(report)} if budget else {}
        print(json.dumps(report.to_json() | fit | ({"by_module": table} if table else {}), indent=2))
    else:
        print(render_text(report, verdict) + (f"\n\n{render_module_table(table)}" if table else ""))
    if page:
        _write_page(page, model, setup, result, verdict, gpu if setup.target is Target.CUDA else None)
        _progress(args, f"Wrote {page}.")
    return 0


def _writable(name: str, flag: str, suffixes: tuple[str, ...]):
    """The output path, checked before any tracing."""
    from pathlib import Path

    path = Path(name)
    if path.suffix not in suffixes:
        raise UserError(f"{flag} {path}: the suffix picks the format; use one of {', '.join(suffixes)}.")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {path}: folder {path.parent} does not exist.")
    if path.is_dir() or not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{flag} {path} cannot be written; choose a file in a folder you may write to.")
    return path


def _write_page(path, model, setup: TrainingSetup, result, verdict: str | None, gpu, before=None) -> None:
    """The report page: the timeline, the terminal report and the per-layer view (modules to depth 3), after
    the sections ``before`` (heading -> text) if any."""
    from analysis.export import setup_summary, timeline_rows
    from analysis.modules import module_table, render_module_table
    from analysis.report import render_text
    from analysis.report_page import write_report_page

    report = result.report
    where = report.layout.describe() if not report.layout.plain else "one GPU"
    sections = {
        **(before or {}),
        "Report": render_text(report, verdict),
        "By module (depth 3)": render_module_table(module_table(result.step, report.peak_op_index, 3)),
    }
    rows = timeline_rows(result.step, result.line)
    title = f"{model.model_id}, {setup_summary(setup)}: {where}"
    write_report_page(path, title, rows, sections, gpu.memory_bytes if gpu else None, gpu.description if gpu else "")


def _run_timeline(args: argparse.Namespace) -> int:
    from analysis.estimate import allocator_config
    from analysis.export import (
        FORMATS,
        setup_summary,
        timeline_rows,
        write_csv,
        write_json,
        write_png,
        write_snapshot,
    )
    from tracer.gpus import find_gpu
    from tracer.resolve import resolve_model
    from tracer.units import format_bytes

    path = _writable(args.output, "-o", FORMATS)
    setup = _setup(args)
    if path.suffix == ".pickle" and setup.target is not Target.CUDA:
        raise UserError("A memory_viz snapshot describes the CUDA caching allocator: drop --target cpu.")
    model = resolve_model(args.model)
    result = _estimate(args, model, setup, _layout(args))
    report = result.report
    rows = timeline_rows(result.step, result.line)
    where = report.layout.describe() if not report.layout.plain else "one GPU"
    title = f"{model.model_id}, {setup_summary(setup)}: {where}"
    if path.suffix == ".csv":
        write_csv(rows, path)
    elif path.suffix == ".json":
        write_json(rows, path, report.to_json())
    elif path.suffix == ".png":
        capacity = find_gpu(setup.gpu).memory_bytes if args.gpu is not None else None
        write_png(rows, path, title, capacity)
    elif path.suffix == ".html":
        from analysis.budget import MemoryBudget

        gpu = find_gpu(setup.gpu) if setup.target is Target.CUDA else None
        verdict = MemoryBudget(gpu.memory_bytes).verdict(report, gpu.description) if gpu else None
        _write_page(path, model, setup, result, verdict, gpu)
    else:
        write_snapshot(result.step, path, allocator_config(setup))
    peak = format_bytes(report.peak_bytes)
    _progress(args, f"Wrote {path} ({len(rows):,} ops, peak allocated {peak} at op {report.peak_op_index:,}).")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from analysis.budget import MemoryBudget
    from analysis.comparison import compare, comparison_json, render_comparison
    from analysis.formulas import formula_estimates, model_shape
    from tracer.gpus import find_gpu
    from tracer.resolve import resolve_model

    setup = _setup(args)
    layout = _layout(args)
    model = resolve_model(args.model)
    result = _estimate(args, model, setup, layout)
    shape = model_shape(model, setup)
    comparison = compare(result.report, result.step, result.line, shape, formula_estimates(shape, setup, layout))
    budget = MemoryBudget(find_gpu(setup.gpu).memory_bytes) if setup.target is Target.CUDA else None
    if args.json:
        fit = {"fit": budget.to_json(result.report)} if budget else {}
        print(json.dumps(comparison_json(comparison) | fit, indent=2))
    else:
        verdict = budget.verdict(result.report, find_gpu(setup.gpu).description) if budget else None
        print(render_comparison(comparison) + (f"\n\n{verdict}" if verdict else ""))
    return 0


def _run_sweep(args: argparse.Namespace, model, setup: TrainingSetup, layout, gpu) -> int:
    from analysis.sweep import parse_sweep, render_sweep, run_sweep, sweep_json

    axes = parse_sweep(args.sweep, setup.mode)
    longest = dict(seq_len=max(axes.get("seq-len", (setup.seq_len,))))
    _warn_about_length(model, dataclasses.replace(setup, **longest))
    start = time.perf_counter()

    def on_point(done: int, total: int, values: dict[str, int]) -> None:
        point = ", ".join(f"{name} {value}" for name, value in values.items())
        elapsed = time.perf_counter() - start
        left = f", about {elapsed / done * (total - done):.0f} s left" if done else ""
        _progress(args, f"[{done + 1}/{total}] tracing {point} ({elapsed:.0f} s so far{left})")

    grid = " x ".join(f"{len(values)} {axis}" for axis, values in axes.items())
    _progress(args, f"Sweeping {grid} values of {model.model_id}, one trace each:")
    sweep = run_sweep(model, setup, layout, axes, gpu, on_point)
    _progress(args, f"done in {time.perf_counter() - start:.1f} s.")
    print(json.dumps(sweep_json(sweep), indent=2) if args.json else render_sweep(sweep, model.model_id))
    return 0


def _run_measure(args: argparse.Namespace) -> int:
    from analysis.measure import measure, require_device
    from analysis.report import render_text
    from tracer.resolve import resolve_model

    setup = _setup(args)
    require_device(setup.target)
    model = resolve_model(args.model)
    _warn_about_length(model, setup, refuse=True)
    what = "generations" if setup.mode == "inference" else "training steps"
    _progress(args, f"Running two real {what} of {model.model_id} on {setup.target.value} ...")
    report = measure(model, setup)
    print(json.dumps(report.to_json(), indent=2) if args.json else render_text(report))
    return 0


def _run_models(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from tracer.registry import BUNDLED_MODELS

    rows = []
    for model in BUNDLED_MODELS:
        config = model.load()
        rows.append({"model": model.model_id, "model_type": config["model_type"], "aliases": list(model.aliases)})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(
            tabulate(
                [(r["model"], r["model_type"], ", ".join(r["aliases"])) for r in rows],
                headers=["model", "type", "aliases"],
            )
        )
    return 0


def _warn_about_length(model, setup: TrainingSetup, refuse: bool = False) -> None:
    """Past max_position_embeddings a model was not trained, and one with a learned position table cannot run:
    a trace still runs (a warning), a real run (``refuse``) is an error."""
    limit = getattr(model.config, "max_position_embeddings", None)
    length = setup.seq_len + (setup.max_new_tokens - 1 if setup.mode == "inference" else 0)
    if not isinstance(limit, int) or length <= limit:
        return
    tokens = f"--seq-len {setup.seq_len}" + (
        f" + --max-new-tokens {setup.max_new_tokens}" if length > setup.seq_len else ""
    )
    if refuse:
        raise UserError(
            f"{tokens} reaches position {length}, beyond {model.model_id}'s max_position_embeddings ({limit}), "
            "which a real run cannot embed: measure at most that many tokens."
        )
    print(
        f"warning: {tokens} reaches position {length}, beyond {model.model_id}'s max_position_embeddings ({limit}); "
        "the estimate still runs, but the model was not trained for it.",
        file=sys.stderr,
    )


@contextmanager
def _progress_bar(args: argparse.Namespace, what: str, unit: str, leave: bool = True):
    """A tqdm bar on stderr fed with ``(stage, done, total)``: each new stage starts it again, a total of 0
    is a stage without a count. Silent with --quiet or --json."""
    if args.quiet or args.json:
        yield lambda stage, done, total: None
        return
    from tqdm import tqdm

    with tqdm(desc=what, file=sys.stderr, unit=unit, dynamic_ncols=True, leave=leave) as bar:
        current = None

        def update(stage: str, done: int, total: int) -> None:
            nonlocal current
            if stage != current:
                current = stage
                bar.reset(total=total or None)
                bar.set_description_str(f"{what}: {stage[:60]}", refresh=False)
            bar.n = done
            bar.refresh()

        yield update


def _progress(args: argparse.Namespace, message: str, end: str = "\n") -> None:
    if not (args.quiet or args.json):
        print(message, file=sys.stderr, end=end, flush=True)


def _quiet_libraries() -> None:
    import logging

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # imported by peft; warns about its CPU kernels
