"""Rank 0 of a parallel layout, run for real on one device with a fake process group.

Each layout is built as torchtitan builds it: on the meta device, parallelized there, then given its storage
(tracer/materialize.py), so that no unsharded weight passes through the device's cache. Its runtime makes the
same choices as the CPU references in tests/runtimes.py: DDP (ZeroRedundancyOptimizer for ZeRO-1), FSDP2
``fully_shard`` on every decoder layer and the root (``MixedPrecisionPolicy`` for mixed precision), DTensor tensor
parallelism with the Megatron plan the estimate assumes and ``loss_parallel()``, and the first rank of a pipeline
as tests/pipeline_runtime.py builds it (torch.distributed.pipelining). Collectives move no data; memory is
allocated as on a real rank. Two warm-up steps, then the measured one.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from pipeline_runtime import pipeline_rank
from runtimes import fake_process_group, tensor_parallelize
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from strategies.layout import Layout, Rank
from strategies.tensor_parallel import megatron_plan
from tracer.modules import decoder_blocks, model_structure
from tracer.resolve import ResolvedModel
from tracer.step import TrainingStep, build_optimizer, load_model, make_batch, optimizer_recipe
from tracer.training import Target, TrainingSetup


def _in_place_all_reduce(state, bucket):  # unannotated: DDP checks annotations, which are strings here
    """What all-reduce hands back: the bucket's own buffer (the fake process group's future holds None)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def measure_rank0(model: ResolvedModel, setup: TrainingSetup, layout_flags: dict[str, Any], target: Target) -> dict:
    layout = Layout(**layout_flags)
    device = torch.device(target.value)
    if layout.pp > 1:
        return _measure_pipeline_rank0(model, setup, layout, device)
    fsdp = layout.zero >= 2 and layout.tp == 1
    run_setup = dataclasses.replace(setup, mixed_precision=None) if fsdp else setup
    with fake_process_group(layout.gpus, 0):
        mesh = init_device_mesh(device.type, (layout.gpus,))
        torch.manual_seed(0)
        context = loss_parallel if layout.tp > 1 else nullcontext

        def parallelize(net: nn.Module) -> None:
            if layout.tp > 1:
                tensor_parallelize(net, mesh, megatron_plan(model_structure(net), layout.tp, 0, False, None))
            elif fsdp:
                mixed = setup.mixed_precision is not None
                shard = partial(
                    fully_shard,
                    mesh=mesh,
                    mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else MixedPrecisionPolicy(),
                    reshard_after_forward=None if layout.zero == 3 else False,  # None: FSDP2's default, root stays
                )
                for block in decoder_blocks(net):
                    shard(net.get_submodule(block))
                shard(net)

        net = load_model(model.config, run_setup, device, parallelize)  # torchtitan's build: sharded on meta
        wrapped: nn.Module = net
        optimizer = build_optimizer(net, run_setup, foreach=None)
        if not (layout.tp > 1 or fsdp):
            wrapped = DistributedDataParallel(net)
            wrapped.register_comm_hook(None, _in_place_all_reduce)
            if layout.zero == 1:
                optimizer_class, arguments = optimizer_recipe(run_setup)
                trainable = [p for p in net.parameters() if p.requires_grad]
                optimizer = ZeroRedundancyOptimizer(trainable, optimizer_class, **arguments)
        step = TrainingStep(wrapped, optimizer)
        if run_setup.autocast_dtype is not None:
            step.autocast = partial(torch.autocast, device.type, dtype=run_setup.autocast_dtype)
        batch = make_batch(model.config, run_setup, device)
        with context():
            step.run(batch)
            step.run(batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            step.run(batch)
    return _device_memory(device)


def _measure_pipeline_rank0(model: ResolvedModel, setup: TrainingSetup, layout: Layout, device: torch.device) -> dict:
    """The first pipeline rank, its stages built and stepped as the CPU reference builds them
    (tests/pipeline_runtime.py: ``PipelineStage``s under the layout's schedule, each stage under its tensor and
    data parallelism as torchtitan composes them)."""
    with pipeline_rank(model, setup, layout, Rank(), device) as built:
        built.step()
        built.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        built.step()
    return _device_memory(device)


def _device_memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"max_memory_allocated": None, "max_memory_reserved": None, "device_used_bytes": None}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "device_used_bytes": total - free,
    }
