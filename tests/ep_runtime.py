"""Expert parallelism in training as torchtitan runs it, for one rank of N on CPU with a fake process group: the
reference the estimate of ``--ep`` is checked against. Real CPU tensors; the token dispatcher is torchtitan's
(transcribed in tracer/expert_parallel.py) with its real collectives, PyTorch's own functional ``all_to_all_single``
(with its registered autograd) over the process group; the data parallelism DDP, or FSDP2 applied as torchtitan's
``apply_fsdp`` applies it with expert parallelism (:func:`apply_fsdp`, on a 2-D mesh); every storage counted by the
project's recorder from before the step (parameters, optimizer states, the batch, DDP's buckets) to its last
reference, DTensors' local shards and FSDP2's storage resizes included (``_LocalStorageRecorder``), the third step
measured.

A fake process group moves no data, so what the other ranks would send is given: the router's choices are
replaced, where the experts receive them, by a fixed routing of every rank alike (the busiest rank's experts, this
rank's, get ``imbalance`` times their share), and the counts this rank receives are those the other ranks' same
routing sends it. The rows received are what the fake collective leaves in its output; their values do not
change what is allocated."""

from __future__ import annotations

import dataclasses

import torch
from pipeline_runtime import recorded_third_step
from runtimes import data_parallel, fake_process_group
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import _disable_current_modes

from analysis.peak import find_peak, timeline
from tracer.expert_parallel import _experts_styles, _matching, expert_weight, routing_of, shard_experts
from tracer.graph import StepGraph
from tracer.resolve import ResolvedModel
from tracer.training import TrainingSetup

try:  # torch 2.13: shard_placement_fn may give a parameter a mesh of its own
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
except ImportError:
    FSDPMeshInfo = ShardPlacementResult = None
PER_PARAMETER_MESH = ShardPlacementResult is not None
PER_PARAMETER_MESH_MISSING = (
    f"torch {torch.__version__}'s fully_shard takes only a Shard from shard_placement_fn, not a mesh of the "
    "parameter's own (ShardPlacementResult, torch 2.13): it cannot put a MoE layer's routed experts on the mesh of the "
    "ranks holding them within the layer's unit, as torchtitan's apply_fsdp does and the estimate of --ep with "
    "--zero 2/3 models"
)


class ProcessGroupExchange:
    """The dispatcher's collectives over the expert-parallel group, run by ``_functional_collectives``, for the
    rank at ``coordinate`` of the group."""

    def __init__(self, group, coordinate: int = 0) -> None:
        self.group, self.coordinate = group, coordinate

    def counts(self, sent: torch.Tensor) -> torch.Tensor:
        received = funcol.all_to_all_single(sent, None, None, self.group)
        received = torch.ops._c10d_functional.wait_tensor(received)
        received.copy_(sent[self.coordinate].expand_as(sent))  # every rank sends this one what it sends itself
        return received

    def split_sizes(self, sent: torch.Tensor, received: torch.Tensor, tokens: int) -> tuple[list[int], list[int]]:
        return sent.tolist(), received.tolist()

    def rows(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        return funcol.all_to_all_single(rows, output_splits, input_splits, self.group)


def forced_routing(
    tokens: int, top_k: int, experts: int, degree: int, imbalance: float, coordinate: int = 0
) -> torch.Tensor:
    """Each token's ``top_k`` distinct experts, such that the ``experts / degree`` experts of the rank at
    ``coordinate`` of the group get ``imbalance`` times their share of the ``tokens x top_k`` pairs (as evenly as
    the tokens allow), the rest spread over the other ranks' experts."""
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
    return (ids + coordinate * local) % experts


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
    with fake_process_group(degree, 0):
        mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("ep",))
        net = _expert_parallel_model(model, setup, mesh.get_group(), imbalance)
        wrapped, buckets = net, {}
        if ddp:
            left_out = [name for name, _ in net.named_parameters() if expert_weight(net._ep_plan, name)]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, left_out)
            wrapped, buckets = data_parallel(net, mesh.get_group())
        return find_peak(timeline(recorded_third_step(model, setup, net, wrapped, buckets), rounded=False)).bytes


def expert_parallel_fsdp_step(
    model: ResolvedModel,
    setup: TrainingSetup,
    gpus: int,
    degree: int,
    imbalance: float = 1.0,
    reshard_after_forward: bool = True,
    rank: int = 0,
) -> StepGraph:
    """The third step of ``rank`` of ``gpus`` as recorded, expert parallel over groups of ``degree`` ranks and
    under FSDP2 as torchtitan applies it (:func:`apply_fsdp`) on the 2-D mesh (``gpus / degree``, ``degree``) of
    its sparse dimensions ("efsdp", "ep"), the dense parameters over the flattened mesh. The rank's experts get
    ``imbalance`` times their share. With ``setup.mixed_precision``, torchtitan's ``MixedPrecisionPolicy(param_dtype,
    reduce_dtype=float32)`` over float32 weights instead of autocast; low-precision weights run without either (as
    the estimate's FSDP2 runs them)."""
    if not PER_PARAMETER_MESH:
        raise NotImplementedError(PER_PARAMETER_MESH_MISSING)
    mixed = setup.mixed_precision is not None and setup.dtype == "fp32"
    setup = dataclasses.replace(setup, mixed_precision=None)
    with fake_process_group(gpus, rank):
        mesh = init_device_mesh("cpu", (gpus // degree, degree), mesh_dim_names=("efsdp", "ep"))
        dense = mesh["efsdp", "ep"]._flatten("fsdp")
        net = _expert_parallel_model(model, setup, mesh["ep"].get_group(), imbalance, rank % degree)
        low, reduce = (torch.bfloat16, torch.float32) if mixed else (None, None)
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=reduce, cast_forward_inputs=False)
        apply_fsdp(net, dense, mesh["efsdp"], policy, reshard_after_forward)
        return recorded_third_step(model, setup, net, net, {})


def apply_fsdp(
    net: nn.Module, dense: DeviceMesh, experts: DeviceMesh, policy: MixedPrecisionPolicy, reshard_after_forward: bool
) -> None:
    """torchtitan's ``apply_fsdp`` with expert parallelism (torchtitan/distributed/fsdp.py ``apply_fsdp_to_decoder``
    and the transformers backend's parallelize.py, commit 73aed7f6), on a transformers causal LM with untied
    embeddings: ``fully_shard`` on the token embedding, on each decoder layer (a MoE layer's routed experts in a
    parameter group of their own on the ``experts`` mesh, ``Shard(1)`` when that mesh is larger than the local
    experts, the rest on ``dense``), on the final norm with the output layer (never resharded after forward: the
    ``default`` and ``never`` policies), and on the model; the gradient divide factor 1; forward and backward
    prefetching set explicitly, one module ahead."""
    config = {"mesh": dense, "mp_policy": policy}
    base = net.model
    fully_shard(base.embed_tokens, **config, reshard_after_forward=reshard_after_forward)
    expert_mesh = FSDPMeshInfo(mesh=experts, shard_mesh_dim=0)
    dense_mesh = FSDPMeshInfo(mesh=dense, shard_mesh_dim=0)
    for block in base.layers:
        routed_experts = getattr(block.mlp, "experts", None)  # a dense layer has none
        if routed_experts is None:
            fully_shard(block, **config, reshard_after_forward=reshard_after_forward)
            continue
        routed = set(routed_experts.parameters())
        placement = Shard(1) if experts.size() > routed_experts.num_experts else Shard(0)  # the local experts

        def place(param: nn.Parameter, routed: set = routed, placement: Shard = placement) -> ShardPlacementResult:
            if param in routed:
                return ShardPlacementResult(placement=placement, mesh_info=expert_mesh)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dense_mesh)

        fully_shard(block, **config, reshard_after_forward=reshard_after_forward, shard_placement_fn=place)
    fully_shard([base.norm, net.lm_head], **config, reshard_after_forward=False)
    fully_shard(net, **config)
    for module in net.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    blocks = list(base.layers)
    base.embed_tokens.set_modules_to_forward_prefetch([blocks[0]])
    for block, following in zip(blocks, [*blocks[1:], None], strict=True):
        block.set_modules_to_forward_prefetch([following] if following is not None else [base.norm, net.lm_head])
    net.lm_head.set_modules_to_backward_prefetch([blocks[-1]])
    for block, previous in zip(blocks[::-1], [*blocks[-2::-1], None], strict=True):
        block.set_modules_to_backward_prefetch([previous] if previous is not None else [base.embed_tokens])


def _expert_parallel_model(
    model: ResolvedModel, setup: TrainingSetup, group, imbalance: float, coordinate: int = 0
) -> nn.Module:
    """The model with the experts of the rank at ``coordinate`` of its expert-parallel ``group``, their router
    forced so that they receive ``imbalance`` times their share, and their token exchange run over ``group``."""
    degree = group.size()
    routing = routing_of(model.config, degree, imbalance)
    tokens = setup.batch_size * setup.seq_len
    ids = forced_routing(tokens, routing.top_k, routing.experts, degree, imbalance, coordinate)
    torch.manual_seed(0)
    net = model.build(setup)
    shard_experts(net, degree, exchange=ProcessGroupExchange(group, coordinate))
    plan = net._ep_plan
    for pattern, style in plan.items():
        if style in _experts_styles(plan):  # transformers 5.17 names the experts modules moe_tp_experts
            for module in _matching(net, pattern):
                _force(module, ids)
    with torch.no_grad():  # the local experts were made with new_empty
        for name, parameter in net.named_parameters():
            if expert_weight(plan, name):
                parameter.uniform_(-1e-2, 1e-2)
    return net
