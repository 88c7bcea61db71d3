"""PyTorch's own distributed runtimes, run for one rank of N on CPU with a fake process group under
FakeTensorMode, and the peak their memory trackers report. The references the strategies are checked
against."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from analysis.peak import find_peak, timeline
from tracer.baseline import register_baseline
from tracer.graph import build_graph
from tracer.meta_fixes import MetaFixes
from tracer.modules import ModuleScope, decoder_blocks
from tracer.recorder import StepRecorder
from tracer.resolve import ResolvedModel
from tracer.roles import Role
from tracer.step import TrainingStep, build_model, build_optimizer, make_batch
from tracer.training import TrainingSetup


@contextmanager
def fake_process_group(world: int, rank: int) -> Iterator[None]:
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _peak_of_step(model: ResolvedModel, setup: TrainingSetup, parallelize: Callable[[nn.Module], None]) -> int:
    """Build under FakeTensorMode, parallelize, run two steps, and track the third with FSDPMemTracker
    (which tracks plain modules as well as FSDP ones)."""
    with FakeTensorMode(), MetaFixes():
        torch.manual_seed(0)
        net = build_model(model.config, setup)
        parallelize(net)
        step = TrainingStep(net, build_optimizer(net, setup, foreach=None))
        batch = make_batch(model.config, setup, "cpu")
        step.run(batch)
        step.run(batch)
        tracker = FSDPMemTracker(net, step.optimizer)
        tracker.track_inputs((batch.input_ids, batch.labels))
        with tracker:
            step.run(batch)
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def fsdp2_peak(model: ResolvedModel, setup: TrainingSetup, world: int, rank: int = 0, mixed_precision=False) -> int:
    """``fully_shard`` on every decoder layer and on the root; fp32 model, or bf16 compute with fp32 reduce."""
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()

    with fake_process_group(world, rank):
        mesh: DeviceMesh = init_device_mesh("cpu", (world,))  # outside FakeTensorMode: it reads its ranks

        def parallelize(net: nn.Module) -> None:
            for block in decoder_blocks(net):
                fully_shard(net.get_submodule(block), mesh=mesh, mp_policy=policy)
            fully_shard(net, mesh=mesh, mp_policy=policy)

        return _peak_of_step(model, setup, parallelize)


def ddp_peak(model: ResolvedModel, setup: TrainingSetup, world: int) -> int:
    """``DistributedDataParallel`` with its defaults, on real CPU tensors (its reducer is C++ and does not run
    on fake ones). A pass-through communication hook hands back each bucket's flat buffer, which the
    recorder counts from before the step as the reducer keeps it for the module's life."""
    with fake_process_group(world, 0):
        torch.manual_seed(0)
        net = build_model(model.config, setup)
        ddp = DistributedDataParallel(net)
        buckets: dict[int, torch.Tensor] = {}

        def keep_bucket(state, bucket):  # unannotated: DDP checks annotations, which are strings here
            buckets[bucket.index()] = bucket.buffer()
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        ddp.register_comm_hook(None, keep_bucket)
        step = TrainingStep(ddp, build_optimizer(net, setup, foreach=None))
        batch = make_batch(model.config, setup, "cpu")
        step.run(batch)
        step.run(batch)  # the reducer rebuilds its buckets in gradient-ready order after the first step
        recorder = StepRecorder(ModuleScope(net), device_type="cpu")
        register_baseline(recorder, step, batch, step_counters_on_host=False)
        for index, buffer in buckets.items():
            recorder.track_existing(buffer, Role.COMMUNICATION, f"bucket {index}")
        with recorder.recording():
            step.run(batch, on_phase=recorder.enter)
        return find_peak(timeline(build_graph(recorder.trace()), rounded=False)).bytes
