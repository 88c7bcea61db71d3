"""The command line's flags: each command's arguments with their help, and what they mean as a
:class:`TrainingSetup` and a :class:`Layout` (the defaults people run, flags that do not apply refused).
analysis/cli.py runs the commands."""

from __future__ import annotations

import argparse
import os

from analysis.flags import MAX_COUNT, MAX_SEQ_LEN, PIPELINE_SEARCH, OneLineParser, count, counts, rate, share
from analysis.recipes import RECIPES
from tracer.errors import UserError
from tracer.gpus import PCIE_4_X16_GBPS
from tracer.training import (
    ATTENTIONS,
    CACHE_BACKENDS,
    CACHES,
    CHECKPOINTING,
    DEVICE_MAPS,
    DTYPES,
    INFERENCE_ONLY,
    MODES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    DeviceMap,
    LoraSetup,
    Sampling,
    Target,
    TrainingSetup,
)


def build_parser() -> argparse.ArgumentParser:
    """Every command and flag, with its help; ``args.command`` names the command."""
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
    analyze.set_defaults(command="analyze")

    measure = commands.add_parser(
        "measure",
        help="run the same step with real tensors and measure it",
        description="Run two real training steps (random weights) and report the memory of the second: "
        "torch.cuda.max_memory_allocated with --target cuda, tracked storage bytes with --target cpu.",
    )
    _add_step_arguments(measure)
    measure.set_defaults(command="measure")

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
    timeline.set_defaults(command="timeline")

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
    compare.set_defaults(command="compare")

    planner = commands.add_parser(
        "plan",
        help="rank every multi-GPU layout by training speed, each at the largest micro-batch that fits",
        description="For MODEL on --gpus GPUs of one kind: every layout (DDP, ZeRO-1/2/3 as PyTorch and DeepSpeed "
        "run them, every tensor-parallel degree that divides the GPUs and the heads, their products, optimizer "
        "offload; for a MoE model, every expert-parallel degree within a node that divides the GPUs and the experts, "
        "under DDP or FSDP2), each with and without full activation checkpointing; for each, the largest micro-batch "
        "whose predicted reserved memory plus CUDA context fits the GPU less --margin, the gradient accumulation "
        "that reaches --global-batch, and the step time and tokens/s; then one recommendation and why.",
    )
    _add_step_arguments(planner, searches_batch=True)
    _add_plan_arguments(planner)
    planner.set_defaults(command="plan")

    serve = commands.add_parser(
        "serve",
        help="what a serving engine's start-up log will say: weights, activation peak, KV-cache tokens",
        description="Predict, per GPU, what vLLM's V1 engine prints at start-up for `vllm serve MODEL` with these "
        "flags (vLLM's own names): the weights each tensor-parallel rank loads, the profile run's activation "
        "peak, the KV cache that fills the rest of --gpu-memory-utilization, its size in tokens and the maximum "
        "concurrency at --max-model-len. The rules are vLLM's, cited in analysis/vllm.py.",
    )
    _add_serve_arguments(serve)
    serve.set_defaults(command="serve")

    gpus = commands.add_parser("gpus", help="list the GPU catalog (memory, throughput, bandwidth, interconnect)")
    gpus.add_argument("--json", action="store_true", help="print JSON instead of a table")
    gpus.set_defaults(command="gpus")

    models = commands.add_parser("models", help="list the bundled model configs")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.set_defaults(command="models")
    parser.commands = {
        "analyze": analyze, "measure": measure, "timeline": timeline, "compare": compare, "plan": planner,
        "serve": serve, "gpus": gpus, "models": models,
    }  # fmt: skip
    return parser


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from analysis.vllm import (
        DEFAULT_BLOCK_SIZE,
        DEFAULT_GPU_MEMORY_UTILIZATION,
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        DEFAULT_MAX_NUM_SEQS,
        KV_CACHE_DTYPES,
    )

    parser.add_argument("model", metavar="MODEL", help="a model id (bundled, cached) or a config.json")
    parser.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        default="vllm",
        help="the serving engine (default vllm); sglang reads --tensor-parallel-size, --mem-fraction-static, "
        "--kv-cache-dtype, --dtype and --non-torch-memory",
    )
    parser.add_argument(
        "--gpu",
        default="h100",
        help="GPU kind from `python -m tracer gpus` (default h100): its memory, its compute capability (the GPTQ and "
        "AWQ kernels vLLM picks), its cuBLAS workspace and its SM count (the sampler's top-k/top-p buffer)",
    )
    parser.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="the GPU's total memory instead of the catalog's, e.g. 79.19GiB",
    )
    parser.add_argument(
        "--tensor-parallel-size", "--tp", type=count(), default=1, help="GPUs the model is split over (default 1)"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=rate,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help=f"share of the GPU's memory vLLM may use (default {DEFAULT_GPU_MEMORY_UTILIZATION})",
    )
    parser.add_argument(
        "--mem-fraction-static",
        type=rate,
        default=None,
        help="SGLang's share of the free memory for the weights and the KV pool (default: SGLang v0.4.x's for the "
        "tensor-parallel degree, 0.88 to 0.79)",
    )
    parser.add_argument(
        "--max-model-len", type=count(maximum=MAX_SEQ_LEN), default=None, help="longest request (default: the model's)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=count(maximum=MAX_SEQ_LEN),
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help=f"tokens per scheduler step; the profile run's forward (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}; "
        "vLLM's own default depends on its version and GPU: read it from your log's engine config)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=count(),
        default=DEFAULT_MAX_NUM_SEQS,
        help=f"requests per step; the profile run's sampler rows (default {DEFAULT_MAX_NUM_SEQS})",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="auto: the model's dtype; fp8: one byte"
    )
    parser.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="vLLM's --quantization fp8: a 16-bit checkpoint's linear layers and experts quantized to FP8 as they "
        "load (one byte per weight); embeddings, lm_head and norms keep --dtype",
    )
    parser.add_argument(
        "--block-size",
        type=count(),
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp16"),
        default="auto",
        help="weights and activations: auto = the checkpoint's (bf16 for fp32 checkpoints), as vLLM's auto",
    )
    parser.add_argument(
        "--non-torch-memory",
        default="0",
        metavar="SIZE",
        help="what your log's 'non_torch_memory takes' says (NCCL, cuBLAS workspaces); for SGLang, the total less "
        "its 'Load weight begin. avail mem'; not predicted (default 0)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")


def _add_step_arguments(parser: argparse.ArgumentParser, searches_batch: bool = False) -> None:
    """The setup of the step; ``searches_batch``: the command picks the batch size (and trains on CUDA)."""
    defaults = TrainingSetup()
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        default=None,
        help="a Hugging Face model id (bundled, cached or on the Hub), a config.json path, or a directory "
        "holding config.json; may come from --config (base_model, model_name_or_path, a torchtune or "
        "torchtitan model)",
    )
    parser.add_argument(
        "--config",
        action="append",
        metavar="FILE",
        default=None,
        help="read the run's own configuration: a DeepSpeed JSON, an accelerate config YAML, Trainer / TRL "
        "SFTConfig arguments (YAML or JSON, as the alignment-handbook writes them), an axolotl YAML, a torchtune "
        "recipe YAML or a torchtitan TOML. Repeatable (e.g. the Trainer's arguments and the DeepSpeed JSON they "
        "name); flags given here win. Prints what each key became and which keys were left out and why",
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
        "--recipe",
        choices=tuple(RECIPES),
        default=None,
        help="the framework whose training step to reproduce, as its own code runs it: "
        + "; ".join(f"{r.name} = {r.what}" for r in RECIPES.values())
        + ". Sets the defaults that framework uses (--config files and flags given here win) and prints the "
        "source lines each follows and what the framework does that the estimate does not model",
    )
    parser.add_argument(
        "--dtype",
        choices=(*DTYPES, "checkpoint"),
        default=None,
        help="dtype of the stored parameters: given alone, the whole step runs in it (pure bf16 or fp16, or "
        "plain fp32); checkpoint = the dtype config.json says the checkpoint is stored in, which from_pretrained "
        "loads by default since transformers 5. Default: fp32 under --mixed-precision for training; bf16 (fp16 on "
        "GPUs without bf16) for "
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
        "--cache",
        choices=CACHES,
        default=None,
        help="generate()'s cache_implementation: dynamic (DynamicCache, the default), static (StaticCache), offloaded "
        "and offloaded_static (the same with every layer in host memory but the one being updated and the next), "
        "quantized (QuantizedCache, with --cache-backend)",
    )
    group.add_argument(
        "--cache-backend",
        choices=CACHE_BACKENDS,
        default=None,
        help="with --cache quantized: fp8, transformers' own FP8 layers (cache_config={'backend': 'fp8'}); quanto and "
        "hqq, which need libraries of their own, are not modelled",
    )
    group.add_argument(
        "--do-sample",
        action="store_const",
        const=True,
        default=None,
        help="generate(do_sample=True): the logits processors, softmax and multinomial sampling instead of the argmax; "
        "with GenerationConfig's defaults (top-k 50) unless --temperature, --top-k or --top-p say otherwise",
    )
    group.add_argument(
        "--temperature", type=rate, default=None, help="with --do-sample: TemperatureLogitsWarper (default 1.0: none)"
    )
    group.add_argument(
        "--top-k",
        type=count(minimum=0),
        default=None,
        help="with --do-sample: TopKLogitsWarper (default 50; 0: none)",
    )
    group.add_argument(
        "--top-p", type=_probability, default=None, help="with --do-sample: TopPLogitsWarper (default 1.0: none)"
    )
    group.add_argument(
        "--logits-to-keep",
        type=count(minimum=0, maximum=MAX_SEQ_LEN),
        default=None,
        help="prefill computes the logits of the last N positions only (0: all, the plain forward's default); "
        "default 1, as generate() passes it",
    )
    group.add_argument(
        "--dequantize",
        action="store_const",
        const=True,
        default=None,
        help="a checkpoint published quantized (FP8 blocks: DeepSeek-V3/R1, Kimi K2; MXFP4: gpt-oss) is loaded "
        "dequantized to --dtype, as transformers does without the kernels its format needs (GPTQ and AWQ: their "
        "16-bit model); by default its weights are counted as published",
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
        "op = every decoder layer under torchtitan's per-op selective policy (the outputs of matmuls and attention "
        "saved, but every second matmul, the rest recomputed), selective = the attention of every decoder layer; "
        "the bare flag means full, as HF's gradient_checkpointing=True does; default: off",
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
        "--accelerate-prepared",
        action="store_true",
        help="the model went through accelerator.prepare, as in the HF Trainer and accelerate loops: under "
        "--mixed-precision its outputs come back as fp32 copies (convert_outputs_to_fp32), and with "
        "--keep-outputs the logits kept through backward are fp32",
    )
    group.add_argument(
        "--use-cache",
        choices=("on", "off"),
        default=None,
        help="whether the training forward builds transformers' key/value cache (config.use_cache), which keeps "
        "every layer's keys and values referenced until the outputs are dropped. Default: as the config says "
        "(on for most models), as your own loop runs it; the HF Trainer, TRL and axolotl set it off "
        "(TrainingArguments.use_cache=False); checkpointing turns it off",
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
    group.add_argument(
        "--adapter-dtype",
        choices=("fp32", "model"),
        default=None,
        help="dtype of the LoRA adapters of a bf16/fp16 model: fp32 (default), as peft >= 0.11 keeps them "
        "(get_peft_model's autocast_adapter_dtype=True), or the model's own (autocast_adapter_dtype=False, "
        "axolotl's peft_autocast_adapter_dtype: false, or peft before 0.11)",
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
    from strategies.pipeline import SCHEDULES as PP_SCHEDULES

    group = parser.add_argument_group(
        "parallel layout", "Estimate the memory of each GPU of a multi-GPU run. Default: one GPU."
    )
    parser.set_defaults(zero_config=None)  # DeepSpeed's zero_optimization sizes, from a --config file
    group.add_argument("--gpus", type=count(), default=1, help="total number of GPUs (default 1)")
    group.add_argument(
        "--device-map",
        choices=DEVICE_MAPS,
        default=None,
        help="with --mode inference: from_pretrained(device_map=...) over --gpus GPUs, as accelerate places the "
        "layers (infer_auto_device_map with the GPUs' free memory) and its hooks run them one GPU after another; "
        "every GPU is reported",
    )
    group.add_argument(
        "--tp",
        type=count(),
        default=1,
        help="tensor-parallel degree: Megatron-style column/row-parallel attention and MLP, vocabulary-parallel "
        "embedding and lm_head; must divide --gpus and the attention heads (default 1); the data-parallel "
        'degree is gpus / tp. With --mode inference, transformers\' tp_plan="auto" over all --gpus',
    )
    group.add_argument(
        "--ep",
        type=count(),
        default=1,
        help="expert-parallel degree of a MoE model: each GPU holds 1/ep of every MoE layer's experts, whole. "
        "With --mode inference it equals --tp, as transformers runs it (DistributedConfig(tp_size=N, ep_size=N): "
        "each GPU runs its experts on the whole batch and the outputs are all-reduced); in training it divides "
        "--gpus, as torchtitan runs it: groups of ep GPUs exchange the routed tokens by all-to-all, each GPU with its "
        "own batch, the dense parameters under DDP (ep equal to --gpus) or FSDP2 over all the GPUs (--zero 2/3: "
        "the experts sharded over the gpus / ep GPUs holding them) (default 1)",
    )
    group.add_argument(
        "--routing-imbalance",
        type=rate,
        default=1.0,
        metavar="X",
        help="with --ep in training: the busiest GPU's experts receive X times their share of the routed tokens, "
        "for capacity planning; that GPU is reported (default 1: balanced routing)",
    )
    group.add_argument(
        "--pp",
        type=count(),
        default=1,
        help="pipeline stages (torch.distributed.pipelining): the decoder layers split contiguously, the first "
        "stage also holding the embedding, the last the final norm, the output layer and the loss; every stage "
        "is reported; must divide --gpus with --tp, the data-parallel degree being gpus / (tp x pp), each stage "
        "under --zero's runtime over its data-parallel group (default 1)",
    )
    group.add_argument(
        "--cp",
        type=count(),
        default=1,
        help="context-parallel degree (torch's context_parallel, as torchtitan runs it): each sequence split over cp "
        "GPUs, load balanced, every attention a ring over them (the keys and values all-gathered, the flash kernel "
        "block by block); the data-parallel degree is gpus / (tp x pp x cp), and --zero's runtime replicates or "
        "shards the parameters over dp x cp GPUs (default 1)",
    )
    group.add_argument(
        "--pp-split",
        type=counts,
        default=None,
        metavar="N,N,...",
        help="with --pp: decoder layers of each stage, in order, adding up to the model's (torchtitan's "
        "pipeline_parallel_split_points at their running sums); default even, earlier stages taking one more",
    )
    group.add_argument(
        "--pp-schedule",
        choices=PP_SCHEDULES,
        default="1f1b",
        help="with --pp: gpipe runs every microbatch's forward, then every backward; 1f1b keeps at most "
        "(stages - stage) microbatches in flight; interleaved-1f1b gives each rank --stages-per-rank stages "
        "(torch's ScheduleInterleaved1F1B), a smaller bubble for more microbatches in flight (default 1f1b)",
    )
    group.add_argument(
        "--stages-per-rank",
        type=count(),
        default=None,
        help="with --pp-schedule interleaved-1f1b: pipeline stages each rank holds, rank r holding stages r, "
        "r + pp, ... (torchtitan's stages per rank; default 2)",
    )
    group.add_argument(
        "--microbatches",
        type=count(),
        default=None,
        help="with --pp: microbatches of --batch-size per optimizer step (default: one per stage)",
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
        "--routing-imbalance",
        type=rate,
        default=1.0,
        metavar="X",
        help="for a MoE model's expert-parallel layouts: the busiest GPU's experts receive X times their share of "
        "the routed tokens, for capacity planning; that GPU is the one whose memory is planned (default 1: "
        "balanced routing)",
    )
    group.add_argument(
        "--pipeline",
        choices=PIPELINE_SEARCH,
        default="auto",
        help="pipeline-parallel layouts (1F1B and interleaved 1F1B over 2 to 8 ranks, each stage FSDP2-sharded as "
        "torchtitan runs them): "
        "auto searches them when no other layout fits (default), on always, off never",
    )
    group.add_argument(
        "--exhaustive",
        action="store_true",
        help="search every layout; by default a layout whose ceiling (every GPU running its forward and backward "
        "ops at their roofline, nothing else) is below the fastest layout found is listed under 'Not "
        "considered' without a search",
    )
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


def layout_of(args: argparse.Namespace):
    """The parallel layout the flags describe; a device map's GPUs are the setup's (:func:`setup_of`)."""
    from strategies.deepspeed import ZeroConfig
    from strategies.layout import Layout

    if getattr(args, "device_map", None):
        return Layout()
    return Layout(
        gpus=args.gpus,
        tp=args.tp,
        ep=args.ep,
        routing_imbalance=args.routing_imbalance,
        pp=args.pp,
        pp_schedule=args.pp_schedule,
        microbatches=args.microbatches,
        pp_split=args.pp_split,
        pp_stages_per_rank=args.stages_per_rank,
        cp=args.cp,
        zero=args.zero,
        engine=args.engine,
        sequence_parallel=args.sequence_parallel,
        tp_output=args.tp_output,
        offload=args.offload,
        zero_config=args.zero_config or ZeroConfig(),
    )


def setup_of(args: argparse.Namespace) -> TrainingSetup:
    """The step the flags describe, with the command line's defaults (:func:`_precision`); flags that would be
    ignored are refused."""
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
            float32_adapters=args.adapter_dtype != "model",
        )
    inference = {
        name: _given(getattr(args, name), getattr(defaults, name))
        for name in ("mode", *INFERENCE_ONLY)
        if hasattr(args, name)
    }
    if getattr(args, "do_sample", None):
        inference["sampling"] = Sampling(
            temperature=_given(args.temperature, Sampling.temperature),
            top_k=_given(args.top_k, Sampling.top_k),
            top_p=_given(args.top_p, Sampling.top_p),
        )
    if getattr(args, "device_map", None):
        inference["device_map"] = DeviceMap(args.device_map, args.gpus)
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
        accelerate_prepared=args.accelerate_prepared,
        use_cache=None if args.use_cache is None else args.use_cache == "on",
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


def _probability(text: str) -> float:
    """A probability mass in (0, 1] (``--top-p``)."""
    value = rate(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def _given(value, default):
    """A flag whose default is None so that giving it can be told apart from leaving it out."""
    return default if value is None else value


def _refuse_flags_that_do_not_apply(args: argparse.Namespace) -> None:
    """A flag that would be ignored is an error: the user meant something the estimate would not show."""

    def given(name: str) -> bool:
        return getattr(args, name, None) is not None

    inference = getattr(args, "mode", "train") == "inference"
    lora = given("lora_r") or args.qlora or args.load_in_8bit
    for name in ("lora_alpha", "lora_dropout", "lora_targets", "adapter_dtype"):
        if given(name) and not lora:
            raise UserError(f"--{name.replace('_', '-')} sets up LoRA adapters: add --lora-r R (or --qlora).")
    if inference and given("optimizer"):
        raise UserError("--optimizer does not apply to inference: drop it with --mode inference.")
    for name in (*INFERENCE_ONLY, "do_sample", "device_map"):
        if given(name) and not inference:
            raise UserError(f"--{name.replace('_', '-')} applies to generation: add --mode inference.")
    for name in ("temperature", "top_k", "top_p"):
        if given(name) and not given("do_sample"):
            raise UserError(f"--{name.replace('_', '-')} applies to sampling: add --do-sample (greedy ignores it).")
    if given("device_map"):
        layout = {"--tp": args.tp > 1, "--ep": args.ep > 1, "--pp": args.pp > 1, "--zero": args.zero}
        layout |= {"--offload": args.offload, "--sequence-parallel": args.sequence_parallel}
        used = [flag for flag, value in layout.items() if value]
        if used:
            raise UserError(
                f"--device-map runs whole layers on each GPU, one GPU after another: drop {', '.join(used)} (or drop "
                "--device-map for transformers' tensor parallelism, --tp)."
            )
    if hasattr(args, "offload") and args.offload is None and given("pcie_gbps"):
        raise UserError("--pcie-gbps times transfers to host memory: add --offload, or drop it.")
    if getattr(args, "target", "cuda") == "cpu" and given("gpu"):
        raise UserError("--gpu picks the GPU that --target cuda reproduces: drop it with --target cpu.")


def _expandable_segments(args: argparse.Namespace) -> bool:
    if args.expandable_segments is not None:
        return args.expandable_segments
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower().replace(" ", "")
    return getattr(args, "target", Target.CUDA.value) == Target.CUDA.value and "expandable_segments:true" in conf
