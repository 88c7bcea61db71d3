"""``python -m tracer``: each command run over :func:`analysis.estimate.estimate` and friends; the flags and what
they mean are analysis/arguments.py."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

from analysis.arguments import build_parser, layout_of, setup_of
from analysis.collector import collector_paused
from tracer.errors import UserError
from tracer.training import Target, TrainingSetup

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # as a shell reports a process stopped by Ctrl-C
EXIT_BROKEN_PIPE = 141  # as a shell reports a process stopped by SIGPIPE: its reader (``| head``) left early


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parse(argv)
        _quiet_libraries()
        # a measurement runs the step as users run it, with the collector on; estimating needs no collector
        with nullcontext() if args.command == "measure" else collector_paused():
            code = RUNNERS[args.command](args)
        sys.stdout.flush()  # a reader gone shows here, not at exit
        return code
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # nothing more can be printed; what is still buffered goes nowhere rather than failing again on exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags, with what ``--recipe`` and then ``--config`` files set as their defaults: a flag given here
    wins."""
    from analysis.flags import settings

    parser = build_parser()
    args = parser.parse_args(argv)
    command = parser.commands[args.command]
    defaults: dict = {}
    reads = []
    if getattr(args, "recipe", None):
        from analysis.recipes import RECIPES

        if getattr(args, "mode", "train") == "inference":
            raise UserError("--recipe describes a framework's training step: drop it with --mode inference.")
        chosen = RECIPES[args.recipe]
        defaults |= {dest: value for dest, value in chosen.defaults.items() if dest in settings(command)}
        if not args.quiet:
            print("\n".join(chosen.summary()), file=sys.stderr)
    if getattr(args, "config", None):
        from analysis.run_config import read_configs

        reads, values = read_configs(args.config, settings(command))
        if not args.quiet:
            for read in reads:
                print("\n".join(read.summary()), file=sys.stderr)
        defaults |= values
    if defaults:
        command.set_defaults(**defaults)
        args = parser.parse_args(argv)
    args.config_reads = reads
    if hasattr(args, "model") and args.model is None:
        raise UserError(
            "name the model: MODEL (a model id or config.json), or a --config that names one (axolotl's "
            "base_model, the Trainer's model_name_or_path, a torchtune or torchtitan model)."
        )
    if getattr(args, "dtype", None) == "checkpoint":
        args.dtype = _stored_dtype(args.model)
    return args


def _stored_dtype(model_id: str) -> str:
    """The dtype config.json says the checkpoint is stored in (float32 when it does not say)."""
    from analysis.run_config import TORCH_DTYPES
    from tracer.resolve import resolve_model

    config = resolve_model(model_id).config
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return TORCH_DTYPES.get(str(stored).removeprefix("torch."), "fp32")


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
    setup = setup_of(args)
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
            pipeline=args.pipeline,
            routing_imbalance=args.routing_imbalance,
            exhaustive=args.exhaustive,
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

    best = result.best
    sections = {"Plan": render_plan(result)}
    if best is None:
        write_report_page(path, f"{model.model_id}: plan on {result.gpus} x {gpu.description}", [], sections)
        return
    layout = best.candidate.layout
    setup = dataclasses.replace(
        result.setup,
        batch_size=best.micro_batch,
        grad_checkpointing=best.candidate.checkpointing,
        grad_accum=best.accumulation,
    )
    _progress(args, f"Tracing the recommended layout for {path} ...")
    recommended = estimate(model, setup, layout)
    verdict = result.budget.verdict(recommended.report, gpu.description)
    _write_page(path, model, setup, recommended, verdict, gpu, sections)
    _progress(args, f"Wrote {path}.")


def _run_serve(args: argparse.Namespace) -> int:
    import torch

    from analysis.vllm import VllmSetup, render_startup, startup_json, vllm_startup
    from tracer.gpus import find_gpu
    from tracer.resolve import resolve_model
    from tracer.units import parse_bytes

    gpu = find_gpu(args.gpu)
    memory = parse_bytes(args.gpu_memory, "--gpu-memory") if args.gpu_memory else gpu.memory_bytes
    dtype = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    non_torch = parse_bytes(args.non_torch_memory, "--non-torch-memory") if args.non_torch_memory != "0" else 0
    model = resolve_model(args.model)
    if args.engine == "sglang":
        return _serve_sglang(args, model, memory, dtype, non_torch)
    if args.mem_fraction_static is not None:
        raise UserError("--mem-fraction-static is SGLang's; vLLM's share is --gpu-memory-utilization.")
    setup = VllmSetup(
        gpu_memory_bytes=memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        dtype=dtype,
        non_torch_bytes=non_torch,
        quantization=args.quantization,
        gpu=gpu,
    )
    startup = vllm_startup(model.config, setup, model.multimodal, model.multimodal_missing)
    print(json.dumps(startup_json(startup), indent=2) if args.json else render_startup(model, startup))
    return 0


def _serve_sglang(args: argparse.Namespace, model, memory: int, dtype, non_torch: int) -> int:
    from analysis import sglang

    if args.quantization:
        raise UserError("--quantization with --engine sglang is not modelled; serve 16-bit checkpoints.")
    setup = sglang.SglangSetup(
        gpu_memory_bytes=memory,
        tensor_parallel_size=args.tensor_parallel_size,
        mem_fraction_static=args.mem_fraction_static,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=dtype,
        non_torch_bytes=non_torch,
    )
    startup = sglang.sglang_startup(model.config, setup)
    print(json.dumps(sglang.startup_json(startup), indent=2) if args.json else sglang.render_startup(model, startup))
    return 0


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


def _estimate(args: argparse.Namespace, model, setup: TrainingSetup, layout):
    """The estimate, with a progress bar on stderr (decoder layers in forward and backward, then ranks); under a
    device map, every GPU's."""
    from analysis.budget import default_allocator_capacity
    from analysis.device_map import estimate_device_map
    from analysis.estimate import estimate

    _warn_about_length(model, setup)
    capacity = default_allocator_capacity(_target_gpu(setup))
    start = time.perf_counter()
    with _progress_bar(args, f"tracing {model.model_id}", unit="", leave=False) as bar:
        if setup.device_map is not None:
            result = estimate_device_map(model, setup, progress=bar)
        else:
            result = estimate(model, setup, layout, progress=bar, capacity=capacity)
    what = "inference" if setup.mode == "inference" else "one training step"
    _progress(args, f"Traced {what} of {model.model_id} on fake tensors in {time.perf_counter() - start:.1f} s.")
    return result


def _run_analyze(args: argparse.Namespace) -> int:
    from analysis.modules import module_table, render_module_table
    from analysis.report import render_text
    from tracer.resolve import resolve_model

    page = _writable(args.html, "--html", (".html",)) if args.html else None
    setup = setup_of(args)
    layout = layout_of(args)
    gpu = _target_gpu(setup)
    model = resolve_model(args.model)
    if args.sweep:
        if page:
            raise UserError("--html writes one step's report: drop it with --sweep.")
        return _run_sweep(args, model, setup, layout, gpu)
    result = _estimate(args, model, setup, layout)
    report = result.report
    table = module_table(result.step, report.peak_op_index, args.by_module) if args.by_module else None
    verdict = _verdict(report, gpu)
    if args.json:
        extra = ({"by_module": table} if table else {}) | _read_from(args)
        print(json.dumps(report.to_json() | _fit_json(report, gpu) | extra, indent=2))
    else:
        print(render_text(report, verdict) + (f"\n\n{render_module_table(table)}" if table else ""))
    if page:
        _write_page(page, model, setup, result, verdict, gpu)
        _progress(args, f"Wrote {page}.")
    return 0


def _read_from(args: argparse.Namespace) -> dict:
    """The recipe and configuration files the setup came from, for --json."""
    read = {"recipe": args.recipe} if args.recipe else {}
    return read | ({"config_files": [r.to_json() for r in args.config_reads]} if args.config_reads else {})


def _target_gpu(setup: TrainingSetup):
    """The GPU whose fit is judged; None with --target cpu, where there is none."""
    from tracer.gpus import find_gpu

    return find_gpu(setup.gpu) if setup.target is Target.CUDA else None


def _verdict(report, gpu) -> str | None:
    from analysis.budget import MemoryBudget

    return MemoryBudget(gpu.memory_bytes).verdict(report, gpu.description) if gpu else None


def _fit_json(report, gpu) -> dict:
    from analysis.budget import MemoryBudget

    return {"fit": MemoryBudget(gpu.memory_bytes).to_json(report)} if gpu else {}


def _title(model, setup: TrainingSetup, report) -> str:
    """A page's or plot's title: the model, the setup in a few words, the layout."""
    from analysis.export import setup_summary

    where = report.layout.describe() if not report.layout.plain else "one GPU"
    return f"{model.model_id}, {setup_summary(setup)}: {where}"


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
    from analysis.export import timeline_rows
    from analysis.modules import module_table, render_module_table
    from analysis.report import render_text
    from analysis.report_page import write_report_page

    report = result.report
    sections = {
        **(before or {}),
        "Report": render_text(report, verdict),
        "By module (depth 3)": render_module_table(module_table(result.step, report.peak_op_index, 3)),
    }
    rows = timeline_rows(result.step, result.line)
    write_report_page(
        path,
        _title(model, setup, report),
        rows,
        sections,
        gpu.memory_bytes if gpu else None,
        gpu.description if gpu else "",
    )


def _run_timeline(args: argparse.Namespace) -> int:
    from analysis.estimate import allocator_config
    from analysis.export import (
        FORMATS,
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
    setup = setup_of(args)
    if path.suffix == ".pickle" and setup.target is not Target.CUDA:
        raise UserError("A memory_viz snapshot describes the CUDA caching allocator: drop --target cpu.")
    model = resolve_model(args.model)
    result = _estimate(args, model, setup, layout_of(args))
    report = result.report
    rows = timeline_rows(result.step, result.line)
    title = _title(model, setup, report)
    if path.suffix == ".csv":
        write_csv(rows, path)
    elif path.suffix == ".json":
        write_json(rows, path, report.to_json())
    elif path.suffix == ".png":
        capacity = find_gpu(setup.gpu).memory_bytes if args.gpu is not None else None
        write_png(rows, path, title, capacity)
    elif path.suffix == ".html":
        gpu = _target_gpu(setup)
        _write_page(path, model, setup, result, _verdict(report, gpu), gpu)
    else:
        write_snapshot(result.step, path, allocator_config(setup))
    peak = format_bytes(report.peak_bytes)
    _progress(args, f"Wrote {path} ({len(rows):,} ops, peak allocated {peak} at op {report.peak_op_index:,}).")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from analysis.comparison import compare, comparison_json, render_comparison
    from analysis.formulas import formula_estimates, model_shape
    from tracer.resolve import resolve_model

    setup = setup_of(args)
    layout = layout_of(args)
    if setup.device_map is not None:
        raise UserError("compare's formulas count one GPU's share of a layout, not a device map's: drop --device-map.")
    model = resolve_model(args.model)
    result = _estimate(args, model, setup, layout)
    shape = model_shape(model, setup)
    comparison = compare(result.report, result.step, result.line, shape, formula_estimates(shape, setup, layout))
    gpu = _target_gpu(setup)
    if args.json:
        print(json.dumps(comparison_json(comparison) | _fit_json(result.report, gpu), indent=2))
    else:
        verdict = _verdict(result.report, gpu)
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

    setup = setup_of(args)
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


RUNNERS = {
    "analyze": _run_analyze,
    "serve": _run_serve,
    "measure": _run_measure,
    "timeline": _run_timeline,
    "compare": _run_compare,
    "plan": _run_plan,
    "gpus": _run_gpus,
    "models": _run_models,
}
