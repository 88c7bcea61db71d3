"""The experts of one expert-parallel rank at inference, as transformers runs them.

``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N, ep_size=N))`` (transformers 5.24,
distributed/expert_parallel.py) applies the model's ``ep_plan``:

* ``grouped_gemm`` on the experts' weights (and gpt-oss's biases): ``Shard(0)``, each rank holds
  ``num_experts / N`` whole experts, and the experts module's ``num_experts`` becomes that local count;
* ``ep_dispatch_experts`` on the experts module, with ``AutoEP``: at inference, where the EP group is the TP group
  and shares one batch, ``AllReduceEP``. Every rank runs its own experts on the whole batch; a route to another
  rank's expert gets the local id ``num_experts`` and weight 0, a sentinel the experts forward sorts to the tail
  and masks (``_is_expert_parallel``); the partial outputs are summed by an in-place all-reduce.

The rank is traced as it runs: its experts' weights, and the masking ops around and inside the experts. Every
rank holds as many experts and runs the same ops, so rank 0 stands for all of them.
"""

from __future__ import annotations

import torch
from torch import nn

from tracer.errors import UserError
from tracer.modules import plan_pattern

EXPERT_WEIGHTS = "grouped_gemm"
DISPATCHED_EXPERTS = "ep_dispatch_experts"


def shard_experts(model: nn.Module, degree: int, rank: int = 0) -> None:
    """Give ``model`` the experts of expert-parallel ``rank`` of ``degree``, run as ``AllReduceEP`` runs them."""
    plan = getattr(model, "_ep_plan", None) or {}  # full module and parameter paths, "*" for a layer index
    if not plan:
        raise UserError(f"--ep: transformers defines no expert-parallel plan for {type(model).__name__}; use --ep 1.")
    modules = [m for p, style in plan.items() if style == DISPATCHED_EXPERTS for m in _matching(model, p)]
    for experts in modules:
        if experts.num_experts % degree:
            raise UserError(f"--ep {degree} must divide the {experts.num_experts} experts of each MoE layer.")
    weights = [p for p, style in plan.items() if style == EXPERT_WEIGHTS]
    for name, parameter in list(model.named_parameters()):
        if any(plan_pattern(pattern).fullmatch(name) for pattern in weights):
            owner, _, leaf = name.rpartition(".")
            local = parameter.new_empty((parameter.shape[0] // degree, *parameter.shape[1:]))
            model.get_submodule(owner)._parameters[leaf] = nn.Parameter(local, requires_grad=parameter.requires_grad)
    for experts in modules:
        experts.num_experts //= degree
        experts._is_expert_parallel = True
        experts.forward = _all_reduce_dispatch(experts.forward, experts.num_experts, rank)


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
