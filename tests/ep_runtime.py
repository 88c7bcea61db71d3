"""Expert parallelism in training as torchtitan runs it, for one rank of N on CPU with a fake process group: the
reference the estimate of ``--ep`` is checked against. Real CPU tensors; the token dispatcher is torchtitan's
(transcribed in tracer/expert_parallel.py) with its real collectives, PyTorch's own functional ``all_to_all_single``
(with its registered autograd) over the process group; every storage counted by the project's recorder from
before the step (parameters, optimizer states, the batch, DDP's buckets) to its last reference, the third step
measured.

A fake process group moves no data, so what the other ranks would send is given: the router's choices are
replaced, where the experts receive them, by a fixed routing of every rank alike (the busiest rank's experts, this
rank's, get ``imbalance`` times their share), and the counts this rank receives are those the other ranks' same
routing sends it. The rows received are what the fake collective leaves in its output; their values do not
change what is allocated."""

from __future__ import annotations

from functools import partial

import torch
from pipeline_runtime import _LocalStorageRecorder
from runtimes import data_parallel, fake_process_group
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import _disable_current_modes

from analysis.peak import find_peak, timeline
from tracer.baseline import register_baseline
from tracer.expert_parallel import DISPATCHED_EXPERTS, _matching, expert_weight, routing_of, shard_experts
from tracer.graph import build_graph
from tracer.modules import ModuleScope
from tracer.resolve import ResolvedModel
from tracer.roles import Role
from tracer.step import TrainingStep, build_optimizer
from tracer.training import TrainingSetup


class ProcessGroupExchange:
    """The dispatcher's collectives over the expert-parallel group, run by ``_functional_collectives``."""

    def __init__(self, group) -> None:
        self.group = group

    def counts(self, sent: torch.Tensor) -> torch.Tensor:
        received = funcol.all_to_all_single(sent, None, None, self.group)
        received = torch.ops._c10d_functional.wait_tensor(received)
        received.copy_(sent[0].expand_as(sent))  # every rank sends this one what it sends itself
        return received

    def split_sizes(self, sent: torch.Tensor, received: torch.Tensor, tokens: int) -> tuple[list[int], list[int]]:
        return sent.tolist(), received.tolist()

    def rows(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        return funcol.all_to_all_single(rows, output_splits, input_splits, self.group)


def forced_routing(tokens: int, top_k: int, experts: int, degree: int, imbalance: float) -> torch.Tensor:
    """Each token's ``top_k`` distinct experts, such that the first rank's ``experts / degree`` experts get
    ``imbalance`` times their share of the ``tokens x top_k`` pairs (as evenly as the tokens allow), the rest
    spread over the other ranks' experts."""
    local = experts // degree
    mine = round(imbalance * tokens * top_k / degree)
    most = min(top_k, local)
    ids = torch.empty(tokens, top_k, dtype=torch.long)
    counts = [mine // tokens + (t < mine % tokens) for t in range(tokens)]
    if max(counts) > most or any(top_k - c > experts - local for c in counts):
        raise ValueError("the imbalance cannot be routed with distinct experts per token")
    for token, count in enumerate(counts):
        for slot in range(top_k):
            if slot < count:
                ids[token, slot] = (token + slot) % local
            else:
                ids[token, slot] = local + (token + slot - count) % (experts - local)
    return ids


def _force(experts: nn.Module, ids: torch.Tensor) -> None:
    """The router's choices replaced where the experts receive them, in place and out of the recorder's sight (the
    routing's own tensors are the ones allocated, and ``ids`` is no part of the step; ``.data`` keeps autograd's
    saved copy of them valid)."""
    forward = experts.forward

    def forced(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():
            top_k_index.data.copy_(ids)
        return forward(hidden_states, top_k_index, top_k_weights)

    experts.forward = forced


def expert_parallel_peak(
    model: ResolvedModel, setup: TrainingSetup, degree: int, imbalance: float = 1.0, ddp: bool = True
) -> int:
    """Peak bytes of the first rank of ``degree`` (the busiest) over its third step, under DDP over all of them with
    the experts' weights left out, or with ``ddp`` False, the step alone (a plain optimizer, no gradient sync)."""
    routing = routing_of(model.config, degree, imbalance)
    ids = forced_routing(setup.batch_size * setup.seq_len, routing.top_k, routing.experts, degree, imbalance)
    with fake_process_group(degree, 0):
        mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("ep",))
        torch.manual_seed(0)
        net = model.build(setup)
        shard_experts(net, degree, exchange=ProcessGroupExchange(mesh.get_group()))
        plan = net._ep_plan
        for pattern, style in plan.items():
            if style == DISPATCHED_EXPERTS:
                for module in _matching(net, pattern):
                    _force(module, ids)
        with torch.no_grad():  # the local experts were made with new_empty
            for name, parameter in net.named_parameters():
                if expert_weight(plan, name):
                    parameter.uniform_(-1e-2, 1e-2)
        wrapped, buckets = net, {}
        if ddp:
            left_out = [name for name, _ in net.named_parameters() if expert_weight(plan, name)]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, left_out)
            wrapped, buckets = data_parallel(net, mesh.get_group())
        optimizer = build_optimizer(net, setup, foreach=None)
        step = TrainingStep(wrapped, optimizer, loss_fn=model.loss_fn)
        if setup.autocast_dtype is not None:
            step.autocast = partial(torch.autocast, "cpu", dtype=setup.autocast_dtype)
        batch = model.batch(setup, "cpu")
        step.run(batch)
        step.run(batch)
        recorder = _LocalStorageRecorder(ModuleScope(net), device_type="cpu")
        register_baseline(recorder, step, batch, step_counters_on_host=False)
        for index, buffer in buckets.items():
            recorder.track_existing(buffer, Role.COMMUNICATION, f"DDP bucket {index}")
        with recorder.recording():
            step.run(batch, recorder.enter)
        return find_peak(timeline(build_graph(recorder.trace()), rounded=False)).bytes
