"""The experts of one expert-parallel rank, as transformers runs them at inference and torchtitan in training.

Both shard the model's ``ep_plan`` the same way: ``grouped_gemm`` on the experts' weights (and gpt-oss's biases) is
``Shard(0)``, each rank holds ``num_experts / N`` whole experts, and the experts module's ``num_experts`` becomes that
local count. How the tokens reach them differs.

At inference, ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N, ep_size=N))`` (transformers 5.24,
distributed/expert_parallel.py) puts ``ep_dispatch_experts`` on the experts module with ``AutoEP``, which, where the
EP group is the TP group and shares one batch, runs ``AllReduceEP``: every rank runs its own experts on the whole
batch; a route to another rank's expert gets the local id ``num_experts`` and weight 0, a sentinel the experts forward
sorts to the tail and masks (``_is_expert_parallel``); the partial outputs are summed by an in-place all-reduce. Every
rank holds as many experts and runs the same ops, so rank 0 stands for all of them.

In training each rank holds its own batch, and torchtitan's routed experts (torchtitan/models/common/moe.py and
token_dispatcher.py at commit 73aed7f6, ``AllToAllTokenDispatcher`` with the ``partial_dtensor`` backend) exchange the
routed tokens: the token-expert pairs sorted by expert (``_local_reorder``), the per-expert counts exchanged by one
``all_to_all_single`` and read back to the host as split sizes, the rows sent to the ranks owning their experts by a
second one (autograd runs it backwards in backward), reordered from rank-major to expert-major (``_permute``), run
through the local experts by grouped matmuls over those rows (``GroupedExperts``, on the model's own expert weights
and activation), and on the way back unpermuted, returned by a third ``all_to_all_single``, weighted by the routing
scores in float32 and summed per token (``combine``). The split sizes are data: a trace has none, so they come from a
routing assumption (:class:`Routing`), and the rank traced is the busiest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed._functional_collectives  # registers the fake kernels of its ops
from torch import nn
from transformers.integrations.moe import _grouped_linear

from tracer.config_check import EXPERT_COUNTS
from tracer.errors import UserError
from tracer.modules import plan_pattern

EXPERT_WEIGHTS = "grouped_gemm"
DISPATCHED_EXPERTS = "ep_dispatch_experts"
LEGACY_ROUTER, LEGACY_EXPERTS = "ep_router", "moe_tp_experts"  # transformers 5.17's split of the same dispatch


@dataclass(frozen=True)
class Routing:
    """The token-expert pairs each rank of an expert-parallel group of ``degree`` exchanges in every MoE layer of a
    training step, where each rank routes ``tokens`` tokens to ``top_k`` of ``experts`` experts. Every rank routes
    alike; the busiest rank's experts (the rank traced, first of its group) receive ``imbalance`` times their share of
    the pairs, each other rank sending it as many, and the rest of a rank's pairs go evenly to the others. Balanced
    (1.0), every rank receives as many pairs as it sends. The memory of a rank depends on what it sends and receives,
    not on how its own experts split them."""

    degree: int
    experts: int
    top_k: int
    imbalance: float = 1.0

    def __post_init__(self) -> None:
        if self.experts % self.degree:
            raise UserError(f"--ep {self.degree} must divide the {self.experts} experts of each MoE layer.")
        if not 1 <= self.imbalance <= self.most:
            raise UserError(
                f"--routing-imbalance must be from 1 (balanced) to {self.most:g}: a token routes at most "
                f"{min(self.top_k, self.local)} of its {self.top_k} pairs to the {self.local} experts of one GPU, so "
                f"over --ep {self.degree} the busiest GPU receives at most {self.most:g} times its share "
                f"(got {self.imbalance:g})."
            )

    @property
    def local(self) -> int:
        return self.experts // self.degree

    @property
    def most(self) -> float:
        return self.degree * min(self.top_k, self.local) / self.top_k

    def received(self, tokens: int) -> int:
        return round(self.imbalance * tokens * self.top_k)

    def splits(self, tokens: int) -> tuple[list[int], list[int]]:
        """The rows the busiest rank sends to each rank of the group (itself first) and receives from each."""
        received = self.received(tokens)
        receive = [received // self.degree + (i < received % self.degree) for i in range(self.degree)]
        rest, others = tokens * self.top_k - receive[0], self.degree - 1
        send = [receive[0], *(rest // others + (i < rest % others) for i in range(others))]
        return send, receive

    def describe(self, tokens: int) -> str:
        sent, received = tokens * self.top_k, self.received(tokens)
        pairs = f"{received:,} token-expert pairs per MoE layer, {received / self.local:,.0f} per local expert"
        if self.imbalance == 1:
            return (
                f"balanced: each GPU receives its share, {pairs} (it sends its {tokens:,} tokens x top-{self.top_k}); "
                "--routing-imbalance X gives the busiest GPU X times that"
            )
        return (
            f"imbalanced: the busiest GPU (the one reported) receives {self.imbalance:g} times its share of the "
            f"{sent:,} pairs each GPU sends, {pairs}; the other GPUs receive fewer and hold less"
        )


def routed_experts(config) -> int | None:
    """The routed experts of each MoE layer a model's config gives (None: a dense model's)."""
    return next((getattr(config, name) for name in EXPERT_COUNTS if getattr(config, name, None)), None)


def routing_of(config, degree: int, imbalance: float = 1.0) -> Routing:
    """The routing assumed for a model's config (its experts per MoE layer and top-k)."""
    experts = routed_experts(config)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        raise UserError(f"--ep shards the experts of a MoE model; {type(config).__name__} has none: use --ep 1.")
    return Routing(degree, experts, top_k, imbalance)


class TokenExchange(Protocol):
    """The collectives of torchtitan's token dispatcher over the expert-parallel group: how the traced rank gets
    the split sizes and the rows (:class:`AssumedExchange`), or a runtime its real ones."""

    def counts(self, sent: torch.Tensor) -> torch.Tensor:
        """``all_to_all_single`` of the (ranks, local experts) counts this rank sends: the counts it receives."""
        ...

    def split_sizes(self, sent: torch.Tensor, received: torch.Tensor, tokens: int) -> tuple[list[int], list[int]]:
        """The rows sent to and received from each rank, from their sums per rank (read back to the host)."""
        ...

    def rows(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        """``all_to_all_single`` of ``rows`` with autograd: the exchange backwards in backward."""
        ...


@dataclass(frozen=True)
class AssumedExchange:
    """The exchange on fake tensors: the collectives are PyTorch's functional ``all_to_all_single`` (its fake kernel
    allocates the output of the rows received; in backward, of the rows sent), so the trace records each as the op
    it is (:data:`ALL_TO_ALL_SINGLE`, what strategies read the exchanged bytes from); the split sizes come from
    ``routing``."""

    routing: Routing

    def counts(self, sent: torch.Tensor) -> torch.Tensor:
        return _all_to_all_single(sent, sent.shape[0], sent.shape[0])

    def split_sizes(self, sent: torch.Tensor, received: torch.Tensor, tokens: int) -> tuple[list[int], list[int]]:
        return self.routing.splits(tokens)

    def rows(self, rows: torch.Tensor, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
        return _AllToAll.apply(rows, sum(output_splits), sum(input_splits))


# The op of every exchange in a traced step: ``torch.ops._c10d_functional.all_to_all_single`` (group name aside, what
# ``_functional_collectives.all_to_all_single`` runs), its first input the rows a rank sends, its own included.
ALL_TO_ALL_SINGLE = "_c10d_functional.all_to_all_single.default"


def _all_to_all_single(tensor: torch.Tensor, received: int, sent: int) -> torch.Tensor:
    """The functional collective on a fake tensor (its registered fake kernel; the group is never looked up)."""
    return torch.ops._c10d_functional.all_to_all_single(tensor, [received], [sent], "expert_parallel")


class _AllToAll(torch.autograd.Function):
    """``torch.ops._c10d_functional.all_to_all_single`` and its registered backward (torch 2.13,
    _functional_collectives.py): a new tensor of the rows received; backward, one of the rows sent, from the
    gradient made contiguous."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: int, sent: int) -> torch.Tensor:
        ctx.sent, ctx.received = sent, received
        return _all_to_all_single(rows, received, sent)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all_single(grad.contiguous(), ctx.sent, ctx.received), None, None


def shard_experts(model: nn.Module, degree: int, rank: int = 0, exchange: TokenExchange | None = None) -> None:
    """Give ``model`` the experts of expert-parallel ``rank`` of ``degree``, run as ``AllReduceEP`` runs them, or
    with ``exchange``, as torchtitan's all-to-all token dispatcher runs them in training."""
    plan = getattr(model, "_ep_plan", None) or {}  # full module and parameter paths, "*" for a layer index
    if not plan:
        raise UserError(f"--ep: transformers defines no expert-parallel plan for {type(model).__name__}; use --ep 1.")
    modules = [m for p, style in plan.items() if style in _experts_styles(plan) for m in _matching(model, p)]
    for experts in modules:
        if experts.num_experts % degree:
            raise UserError(f"--ep {degree} must divide the {experts.num_experts} experts of each MoE layer.")
    for name, parameter in list(model.named_parameters()):
        if expert_weight(plan, name):
            owner, _, leaf = name.rpartition(".")
            local = parameter.new_empty((parameter.shape[0] // degree, *parameter.shape[1:]))
            model.get_submodule(owner)._parameters[leaf] = nn.Parameter(local, requires_grad=parameter.requires_grad)
    for experts in modules:
        experts.num_experts //= degree
        experts.expert_parallel_degree = degree  # the model's parameters are counted over all the ranks
        if exchange is not None:
            experts.forward = _AllToAllExperts(experts, degree, exchange)
            continue
        experts._is_expert_parallel = True
        experts.forward = _all_reduce_dispatch(experts.forward, experts.num_experts, rank)


def _experts_styles(plan: dict[str, str]) -> tuple[str, ...]:
    """The styles of the experts modules in ``plan``. Transformers before ``ep_dispatch_experts`` (5.17) ran the same
    dispatch in two parts (distributed/tensor_parallel.py): ``ep_router`` on the router (``EpRouterParallel``: routes
    to other ranks' experts get the local id ``num_local_experts`` and weight 0, this rank's their local id) and
    ``moe_tp_experts`` on the experts module (``MoeExpertsParallel``: the output summed over the group by an in-place
    all-reduce), with ``grouped_gemm`` setting the experts module's ``num_experts`` to the local count
    (``MoEParamShard``)."""
    return (DISPATCHED_EXPERTS, LEGACY_EXPERTS) if LEGACY_ROUTER in plan.values() else (DISPATCHED_EXPERTS,)


def expert_weight(plan: dict[str, str], name: str | None) -> bool:
    """Whether the parameter ``name`` is an expert weight that ``plan`` (an ep_plan) splits over the ranks."""
    patterns = [pattern for pattern, style in plan.items() if style == EXPERT_WEIGHTS]
    return name is not None and any(plan_pattern(pattern).fullmatch(name) for pattern in patterns)


def _matching(model: nn.Module, pattern: str) -> list[nn.Module]:
    return [module for name, module in model.named_modules() if plan_pattern(pattern).fullmatch(name)]


def _all_reduce_dispatch(experts_forward, local_experts: int, rank: int):
    """``AllReduceEP.__call__``: routes to other ranks' experts masked, this rank's experts run, the output summed
    over the group in place (no new memory)."""

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        off_rank = (top_k_index // local_experts) != rank
        local_index = torch.where(off_rank, local_experts, top_k_index % local_experts)
        return experts_forward(hidden_states, local_index, top_k_weights.masked_fill(off_rank, 0.0))

    return forward


class _AllToAllExperts:
    """The experts module's forward as torchtitan's ``MoE`` counts the routed tokens and its ``RoutedExperts`` runs
    ``AllToAllTokenDispatcher.dispatch``, ``GroupedExperts`` and ``combine``, statement for statement, on the
    model's router output; its transformers signature kept."""

    def __init__(self, experts: nn.Module, degree: int, exchange: TokenExchange) -> None:
        if not all(hasattr(experts, name) for name in ("has_gate", "has_bias", "is_transposed")):
            raise UserError(
                f"--ep in training runs the experts by grouped matmuls over their stacked weights; "
                f"{type(experts).__name__} does not keep them as transformers' grouped experts do: use --ep 1."
            )
        self.experts, self.degree, self.exchange = experts, degree, exchange

    def __call__(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        degree, local = self.degree, self.experts.num_experts
        top_k = top_k_index.shape[-1]
        # MoE.forward: a one-hot routing map, alive until the layer returns, and the pairs this rank sends each expert
        routing_map = torch.zeros((x.shape[0], degree * local), dtype=torch.bool, device=x.device)
        routing_map.scatter_(-1, top_k_index, True)
        counts = routing_map.sum(dim=0)
        # dispatch: _local_reorder
        order = torch.argsort(top_k_index.view(-1), stable=True)
        scores = top_k_weights.reshape(-1)[order]
        order = order // top_k
        routed = x[order]
        with torch.no_grad():  # the count exchange, and its sums read back as split sizes
            received = self.exchange.counts(counts.view(degree, -1)).reshape(-1)
            send, receive = _split_sizes(self.exchange, counts.view(degree, -1), received.view(degree, -1), x.shape[0])
        routed = self.exchange.rows(routed, receive, send)
        # _permute: rank-major to expert-major
        counts_matrix = received.view(degree, local)
        starts = (received.cumsum(0) - received).view(degree, local)
        lengths = counts_matrix.t().reshape(-1)
        starts = starts.t().reshape(-1)
        segments = torch.arange(lengths.shape[0], device=x.device).repeat_interleave(lengths, output_size=sum(receive))
        output_starts = lengths.cumsum(0) - lengths
        permuted = starts[segments] + torch.arange(segments.shape[0], device=x.device) - output_starts[segments]
        per_expert = counts_matrix.sum(0)
        shape = routed.shape
        routed = routed[permuted, :]
        output = _grouped_experts(self.experts, routed, per_expert)
        # combine: _unpermute, the exchange back, the scores in float32, scatter_add per token
        unpermuted = output.new_empty(shape)
        unpermuted[permuted, :] = output
        output = self.exchange.rows(unpermuted, send, receive)
        out = torch.zeros_like(x)
        output = (output.to(torch.float32) * scores.reshape(-1, 1)).to(output.dtype)
        return out.scatter_add(0, order.reshape(-1, 1).expand(-1, out.shape[-1]), output)


def _split_sizes(exchange: TokenExchange, sent: torch.Tensor, received: torch.Tensor, tokens: int):
    """``_sync_token_count_exchange``: the sums per rank, copied to the host and read (their device copies freed
    when it returns)."""
    input_splits = sent.sum(dim=1).to(torch.device("cpu"), non_blocking=True)
    output_splits = received.sum(dim=1).to(torch.device("cpu"))
    return exchange.split_sizes(input_splits, output_splits, tokens)


def _grouped_experts(experts: nn.Module, rows: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts.forward`` on the model's own stacked weights and activation: grouped matmuls over the
    rows, already sorted by local expert, at the offsets of their counts (transformers' ``_grouped_linear``, the
    kernel its grouped_mm experts run)."""
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
    ids = None
    if experts.has_bias:
        ids = torch.arange(per_expert.shape[0], device=rows.device)
        ids = ids.repeat_interleave(per_expert, output_size=rows.shape[0])
    up = experts.gate_up_proj if experts.has_gate else experts.up_proj
    up_bias = None if ids is None else (experts.gate_up_proj_bias if experts.has_gate else experts.up_proj_bias)[ids]
    hidden = _grouped_linear(rows, up, offsets, bias=up_bias, is_transposed=experts.is_transposed)
    hidden = experts._apply_gate(hidden) if experts.has_gate else experts.act_fn(hidden)
    down_bias = None if ids is None else experts.down_proj_bias[ids]
    output = _grouped_linear(hidden, experts.down_proj, offsets, bias=down_bias, is_transposed=experts.is_transposed)
    norm = getattr(experts, "has_post_expert_norm", False)  # transformers 5.17's experts have none
    return experts.post_expert_norm(output) if norm else output
