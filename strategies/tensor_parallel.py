"""Megatron-style 1D tensor parallelism, as PyTorch's DTensor runs it (``parallelize_module``), for one rank.

Each module of the plan has a style (transformers' names, torch/distributed/tensor/parallel/style.py):

* ``colwise`` (``ColwiseParallel``): weight and bias split along the output features. The output is the
  rank's slice. In backward the input gradient is a partial sum, all-reduced when it leaves the module
  (``_FromTorchTensor.backward`` redistributes it to ``Replicate``).
* ``rowwise`` (``RowwiseParallel``): weight split along the input features, bias replicated. The sliced
  input gives a full-size partial output, all-reduced into a new buffer (``funcol.all_reduce`` clones,
  then reduces in place) that takes over from it.
* ``embedding_rowwise`` (``RowwiseParallel`` on ``nn.Embedding``): the vocabulary split over ranks. Each
  rank looks up its rows into a full-size partial output (ids of other ranks masked to zero), all-reduced.
* ``colwise_gather_output`` (``ColwiseParallel(output_layouts=Replicate())``): ``colwise`` whose output
  is gathered: ``all_gather_into_tensor`` into a (ranks x slice) buffer, then ``cat`` into the full tensor.
  In backward the full gradient is split back to the rank's slice (a contiguous copy).
* ``rowwise_split_input`` (``RowwiseParallel(input_layouts=Replicate())``): ``rowwise`` whose input arrives
  whole: each rank copies out its slice of the input features (DTensor's ``Replicate -> Shard(-1)``) for its
  matmul. With ``colwise_gather_output`` before it (Phi-3's fused projections), every rank runs the attention
  and MLP on all heads and features, and caches every key/value head; only the weights are split. In training the
  slice is what the matmul saves for backward (the whole input is freed once nothing outside the module reads it),
  and the input's gradient, a slice, is all-gathered back to the whole input's (``Shard(-1) -> Replicate``).
* ``moe_tp_experts`` on a MoE layer's experts (transformers' ``MoeExpertsParallel``), with ``packed_colwise`` on
  their ``gate_up_proj`` (``PackedColwiseParallel``: the gate and up halves each split along the intermediate
  dimension) and ``rowwise`` on their ``down_proj`` (split along it too): every rank runs every expert on its
  slice of the intermediate dimension, on its local weights, and sums the partial outputs with an in-place
  all-reduce (``_AllReduceForward``). In backward the gradients of the experts' input and routing weights are such
  partial sums, all-reduced in place as they leave (``_AllReduceBackward``); the weights' gradients are the rank's
  slices. The same in training (the rest of the plan then DTensor's, as above) and at inference. Experts stored
  input-first (Llama 4's, run through ``bmm``) get ``packed_rowwise`` on ``gate_up_proj`` and ``colwise`` on
  ``down_proj`` instead, which split the same intermediate features; Llama 4 trains under none of this
  (:data:`ADDS_INTO_ROWWISE_OUTPUT`).
* ``mla_kv_a_proj`` on multi-head latent attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2, transformers'
  ``MlaKvAProjParallel``): the weight stays whole, the output is split into the latent and the rotary key part and
  joined again by ``torch.cat`` (a copy of the output that takes over from it). The rotary key is shared by every
  head, so its gradient is summed over the rank's heads only: a partial sum of full size, which the style's
  ``_AllReduceBackward`` makes contiguous (a copy of that part) and all-reduces in place, before the split's
  backward joins the two gradients into a new one.

Activations follow from the weights: the step is walked in op order and each new storage gets the share
of its single-GPU bytes this rank holds. A matmul with a sharded weight makes a slice from a full input,
and a partial sum from a sliced one; any other op's output is as sliced as its inputs. Gradients,
optimizer states and optimizer temporaries take the share of their parameter.

Inference (``--mode inference --tp N``) follows transformers' own runtime instead (``from_pretrained(tp_plan="auto",
tp_size=N)``, transformers 5.24 distributed/tensor_parallel.py): the same styles from the model's plan, the lm_head
``colwise_gather_output``, the token embedding vocabulary-parallel only where the plan names it
(:func:`planned_embedding`: 5.24 adds it to every plan, 5.17 only with tied embeddings), but under ``no_grad`` a Linear
runs on its local weight and a row-wise one all-reduces its partial output in place (``dist.all_reduce``), adding its
bias afterwards into a new tensor. Each rank's KV cache holds its share of the key/value heads (``generation/utils.py``
sizes it by ``num_key_value_heads / tp``).

A ``log_softmax`` over a vocabulary-sliced input is ``loss_parallel()``'s vocabulary-parallel loss
(torch/distributed/tensor/parallel/loss.py), whose slice-sized temporaries are added op by op: forward
``shifted = x - max`` and ``exp(shifted)``; backward ``zeros_like(x)``, ``exp(x)``, their sum, and the
product that is the logits' gradient. Its per-token temporaries (masks, indices) are left out, as are the
embedding's: they hold a few bytes per token, against the logits' vocabulary-sized rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property
from types import SimpleNamespace
from typing import TYPE_CHECKING

from strategies.collectives import recorded
from strategies.rewrite import Point, Rewrite
from strategies.sharding import chunk_length
from tracer.errors import UserError
from tracer.gradient_sums import hands_over
from tracer.graph import ALL_REDUCE, TENSOR_PARALLEL, Collective, StepGraph, StorageRow, replaced
from tracer.modules import plan_pattern, within
from tracer.roles import Phase, Role
from tracer.trace import ModelStructure, Op
from tracer.training import TORCH_OPTIMIZERS, Target, TrainingSetup

if TYPE_CHECKING:  # annotations only: the command line's help need not import transformers
    from transformers import PretrainedConfig

    from strategies.layout import Layout

COLWISE = "colwise"
ROWWISE = "rowwise"
EMBEDDING_ROWWISE = "embedding_rowwise"
COLWISE_GATHER_OUTPUT = "colwise_gather_output"
ROWWISE_SPLIT_INPUT = "rowwise_split_input"
PACKED_COLWISE = "packed_colwise"
PACKED_ROWWISE = "packed_rowwise"
MOE_TP_EXPERTS = "moe_tp_experts"
MLA_KV_A_PROJ = "mla_kv_a_proj"
# The styles of a MoE layer's experts: the module's, and its packed expert weights' (3-D parameters named in the plan).
MOE_STYLES = (MOE_TP_EXPERTS, PACKED_COLWISE, PACKED_ROWWISE)
# Decoder-layer styles that gather a layer's output or take its input whole (Phi-3, OLMoE, Qwen3-Next's linear
# attention).
WHOLE_ACTIVATION_STYLES = (COLWISE_GATHER_OUTPUT, ROWWISE_SPLIT_INPUT)
# The decoder layers' styles modelled, in training and at inference.
DECODER_STYLES = (COLWISE, ROWWISE, *MOE_STYLES, *WHOLE_ACTIVATION_STYLES, MLA_KV_A_PROJ)
# transformers' style for a parameter every rank holds whole (Qwen3's and Gemma 3's q/k norms, which see the rank's
# heads only) and whose gradient it all-reduces in place: in memory, what a module outside the plan gets.
REPLICATED_WITH_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"

# Models whose forward adds in place into a row-wise layer's output (Llama 4's shared expert): autograd refuses it on
# the view DTensor's to_local() returns, so only their inference runs tensor parallel.
ADDS_INTO_ROWWISE_OUTPUT = ("llama4_text",)

# Which dimension of a style's weight and bias is split (None: replicated).
_WEIGHT_DIM = {COLWISE: 0, COLWISE_GATHER_OUTPUT: 0, ROWWISE: 1, ROWWISE_SPLIT_INPUT: 1, EMBEDDING_ROWWISE: 0}
_BIAS_DIM = {COLWISE: 0, COLWISE_GATHER_OUTPUT: 0, ROWWISE: None, ROWWISE_SPLIT_INPUT: None, EMBEDDING_ROWWISE: None}
# Which dimension of an expert weight (a 3-D parameter the plan names) is split. Stored experts x out x in (Qwen3-MoE,
# Mixtral, DeepSeek-V3): PackedColwiseParallel's output features, RowwiseParallel's Shard(-1). Stored experts x in x
# out (Llama 4, Aria), the plan swaps the styles: PackedRowwiseParallel's _StridedShard(-1) on the gate and up
# features, ColwiseParallel's Shard(ndim - 2) on the down projection's input features.
_EXPERT_WEIGHT_DIM = {PACKED_COLWISE: 1, ROWWISE: 2, PACKED_ROWWISE: 2, COLWISE: 1}
# Styles of packed gate and up halves, each split alike (a split factor of 2).
_PACKED = (PACKED_COLWISE, PACKED_ROWWISE)
# Projections whose output holds the keys: a plan that splits one column-wise splits the cache's heads too
# (transformers' get_kv_heads_per_rank, distributed/tensor_parallel.py).
_KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value")
_QUERY_PROJECTIONS = ("q_proj", "q_b_proj", "qkv_proj", "query_key_value")

_MATMULS = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten._grouped_mm.default",  # transformers' grouped_mm experts
    }
)
_EMBEDDING = "aten.embedding.default"
_SUM = "aten.sum.dim_IntList"
_EMBEDDING_BACKWARD = "aten.embedding_dense_backward.default"
_LOG_SOFTMAX = "aten._log_softmax.default"
_NLL_LOSS_BACKWARD = "aten.nll_loss_backward.default"
_LOG_SOFTMAX_BACKWARD = "aten._log_softmax_backward_data.default"
GRADIENT_SHAPED_STATE = ".momentum_buffer"


@dataclass(frozen=True)
class TensorParallel:
    """The runtime of ``--tp``: DTensor's ``parallelize_module`` over ``degree`` ranks with the model's own plan
    (:func:`megatron_plan`), optionally sequence parallel, the lm_head's output kept sliced or gathered."""

    degree: int
    sequence_parallel: bool = False
    gathered_output: bool = False
    inference: bool = False  # transformers' runtime under no_grad (tp_plan="auto"), not parallelize_module
    expert_parallel: bool = False  # the experts are split whole over the same ranks (ep_plan), not by this plan

    @classmethod
    def for_inference(cls, degree: int, expert_parallel: bool = False) -> TensorParallel:
        """``from_pretrained(tp_plan="auto", tp_size=degree)``: its plan gathers the lm_head's output. With
        ``expert_parallel``, ``DistributedConfig(tp_size=degree, ep_size=degree)``, whose ep_plan takes the
        experts over from the tp_plan."""
        return cls(degree, gathered_output=True, inference=True, expert_parallel=expert_parallel)

    @property
    def note(self) -> str:
        if self.inference:
            experts = (
                f"; the MoE experts split whole (ep_size={self.degree}, AllReduceEP: each GPU holds 1/{self.degree} "
                "of them and runs them on the whole batch, the outputs all-reduced in place)"
                if self.expert_parallel
                else ""
            )
            return (
                f'transformers from_pretrained(tp_plan="auto", tp_size={self.degree}): the model\'s TP plan for the '
                "decoder layers (row-wise outputs all-reduced in place), the embedding vocabulary-parallel where "
                "the plan names it (transformers 5.24 names it in every plan) and whole otherwise, lm_head "
                "output gathered to the full vocabulary; each GPU caches its share of the key/value heads" + experts
            )
        loss = (
            "lm_head output all-gathered to the full vocabulary on every GPU"
            if self.gathered_output
            else "lm_head output kept sliced over the vocabulary, loss_parallel() cross-entropy"
        )
        return (
            "PyTorch DTensor parallelize_module: the model's transformers TP plan for the decoder layers "
            f"(colwise/rowwise), vocabulary-parallel embedding (DTensor computes its gradient at full size); {loss}"
            + ("; sequence parallel as torchtitan lays it out" if self.sequence_parallel else "")
        )

    def check(self, config: PretrainedConfig) -> None:
        """Refuse a model this degree cannot split."""
        plan = getattr(config, "base_model_tp_plan", None) or {}
        name = type(config).__name__.removesuffix("Config")
        if not plan:
            raise UserError(
                f"--tp needs the model's tensor-parallel plan, and transformers defines none for {name}. "
                "Tensor parallelism is modelled for models that have one (Llama, Mistral, Qwen2, Qwen3, Gemma-2, "
                "Gemma 3, SmolLM3, GPT-NeoX/Pythia, Phi-3, Qwen3-MoE, Mixtral, GLM-4.5, DeepSeek-V2 and V3, "
                "Qwen3-Next); use --tp 1."
            )
        vocab = getattr(config, "vocab_size", None)
        if self.inference and vocab and vocab % self.degree and not gathers_uneven_outputs():
            raise UserError(
                f"--tp {self.degree} at inference: this transformers refuses to gather the lm_head's {vocab} outputs "
                f"over {self.degree} GPUs that do not divide them (ColwiseParallel.validate_param; transformers 5.24 "
                f"gives the last GPU a shorter slice). Use a --tp dividing {vocab}, or a newer transformers."
            )
        if splits_query_heads(plan) and config.num_attention_heads % self.degree:
            raise UserError(
                f"--tp {self.degree} must divide the {config.num_attention_heads} attention heads of this model."
            )
        if splits_key_heads(plan):
            kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            if kv_heads % self.degree:
                raise UserError(f"--tp {self.degree} must divide the {kv_heads} key/value heads of this model.")
        if not self.inference and getattr(config, "model_type", None) in ADDS_INTO_ROWWISE_OUTPUT:
            raise UserError(
                f"--tp in training: {name}'s MoE layer adds the routed experts' output into its shared expert's in "
                "place (out.add_ in its forward), and the shared expert's row-wise down projection returns a view "
                "DTensor made: autograd refuses the in-place add, so tensor-parallel training of this model stops "
                "in transformers (5.17 to 5.24) and in parallelize_module alike. Use --tp 1 with FSDP (--zero 3); "
                "--mode inference --tp runs."
            )
        # the token embedding's "embedding_rowwise" (GPT-NeoX's plan from transformers 5.24) is the vocabulary-parallel
        # embedding every plan gets here
        modelled = (*DECODER_STYLES, EMBEDDING_ROWWISE, REPLICATED_WITH_GRAD_ALLREDUCE)
        unsupported = sorted({style for style in plan.values() if style not in modelled})
        if unsupported:
            raise UserError(
                f"--tp: {name}'s tensor-parallel plan uses {', '.join(unsupported)}, which is not modelled "
                "(only colwise, rowwise, their gathered variants, MoE experts' layers and mla_kv_a_proj are); "
                "use --tp 1."
            )

    def distinct_ranks(self, step: StepGraph) -> list[int]:
        """Rank 0, and the last rank when a split dimension does not divide evenly (``torch.chunk`` leaves it
        a shorter slice)."""
        shapes = [row.shape for row in step.storages.values() if row.role is Role.PARAMETER]
        uneven = any(size % self.degree for shape in shapes for size in shape[:2])
        return [0, self.degree - 1] if uneven else [0]

    def apply(self, step: StepGraph, setup: TrainingSetup, rank: int) -> StepGraph:
        if self.inference:
            return recorded(self.slice(step, setup, rank), inference_all_reduce(step))
        return recorded(self.slice(step, setup, rank), activation_all_reduce(step, hidden_state_bytes(step)))

    def slice(self, step: StepGraph, setup: TrainingSetup, rank: int) -> StepGraph:
        """The rank's slice of every op and storage, without the all-reduces' record (:meth:`apply` adds it)."""
        sequence = setup.seq_len if self.sequence_parallel else None
        plan = megatron_plan(
            step.structure,
            self.degree,
            rank,
            self.gathered_output,
            sequence,
            whole_experts=self.expert_parallel,
            embedding_as_planned=self.inference,
        )
        if self.inference:
            plan = dataclasses.replace(plan, reduce_in_place=True)
        return tensor_parallel(step, plan)

    def staged(self, stage: StepGraph, traced: StepGraph) -> StepGraph:
        """A pipeline stage cut from a :meth:`slice` of the traced step, with the all-reduces of its layers, each of
        one microbatch's hidden state (the traced step's)."""
        return recorded(stage, activation_all_reduce(stage, hidden_state_bytes(traced)))


def expert_rules(styles: Mapping[str, str]) -> dict[str, str]:
    """The rules of a plan for MoE layers' experts: each experts module's (``moe_tp_experts``) and its parameters'."""
    experts = [pattern for pattern, style in styles.items() if style == MOE_TP_EXPERTS]
    return {p: style for p, style in styles.items() if any(p == e or p.startswith(e + ".") for e in experts)}


@cache
def gathers_uneven_outputs() -> bool:
    """Whether transformers' tensor parallelism gathers a column-wise output its ranks do not divide (5.24: the last
    rank's slice is shorter), asked of its ``colwise_gather_output`` style for a layer of 3 outputs over 2 ranks;
    5.17's ``ColwiseParallel.validate_param`` refuses it (ValueError) before loading the weights."""
    from torch import nn
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    two_ranks = SimpleNamespace(size=lambda: 2)
    try:
        ALL_PARALLEL_STYLES[COLWISE_GATHER_OUTPUT].validate_param(nn.Linear(2, 3, device="meta"), "weight", two_ranks)
    except ValueError:
        return False
    return True


def planned_embedding(structure: ModelStructure) -> bool:
    """Whether the model's own plan splits its token embedding over the vocabulary (``embedding_rowwise``)."""
    return any(
        style == EMBEDDING_ROWWISE and plan_pattern(pattern).fullmatch(structure.input_embedding)
        for pattern, style in structure.tp_plan.items()
    )


def splits_query_heads(styles: Mapping[str, str]) -> bool:
    """Whether a plan splits the attention's query heads (latent attention's among them: DeepSeek-V2's q_proj or
    q_b_proj)."""
    return any(
        pattern.rpartition(".")[2] in _QUERY_PROJECTIONS and style == COLWISE for pattern, style in styles.items()
    )


def splits_key_heads(styles: Mapping[str, str]) -> bool:
    """Whether a plan splits the attention heads, and with them each rank's key/value cache."""
    return any(pattern.rpartition(".")[2] in _KEY_PROJECTIONS and style == COLWISE for pattern, style in styles.items())


def hidden_state_bytes(step: StepGraph) -> int:
    """The hidden state of one (micro)batch: what the embedding makes in forward (in backward it makes its weight's
    gradient)."""
    embedding = step.structure.input_embedding
    states = (
        row.nbytes
        for row in step.storages.values()
        if row.producer is not None and row.module == embedding and step.ops[row.producer].phase is Phase.FORWARD
    )
    return max(states, default=0) if embedding else 0


def activation_all_reduce(step: StepGraph, hidden_state: int) -> Collective:
    """Megatron's pattern, on the compute stream: each layer all-reduces its attention and MLP outputs in forward
    and their input gradients in backward (again in forward when recomputed), plus the embedding's output and
    the lm_head's input gradient; one hidden-state tensor each (sequence parallelism's all-gather and
    reduce-scatter pair moves the same bytes)."""
    recomputed = any(op.recompute for op in step.ops)
    count = (6 if recomputed else 4) * len(step.structure.blocks) + 2
    return Collective(
        ALL_REDUCE, TENSOR_PARALLEL, count * hidden_state, Phase.FORWARD, True, False, "layer outputs and gradients"
    )


def inference_all_reduce(step: StepGraph) -> Collective:
    """transformers' inference runtime: each forward (the prefill and every decode step) all-reduces the
    embedding's output and each layer's attention and MLP outputs, one hidden-state tensor each."""
    embedding = step.structure.input_embedding
    produced = sum(row.nbytes for row in step.storages.values() if row.producer is not None and row.module == embedding)
    count = 2 * len(step.structure.blocks) + 1
    return Collective(ALL_REDUCE, TENSOR_PARALLEL, count * produced, Phase.PREFILL, False, False, "layer outputs")


@dataclass(frozen=True)
class TpPlan:
    degree: int
    rank: int = 0
    styles: Mapping[str, str] = field(default_factory=dict)  # module path pattern ("*" = a layer index) -> style
    sequence_length: int | None = None  # set for sequence parallelism: the length the sequence slices split
    output_embedding: str | None = None  # gathers its own input under sequence parallelism
    reduce_in_place: bool = False  # a row-wise layer without bias all-reduces its partial output in place

    def style_of(self, module: str) -> str | None:
        for pattern, style in self.styles.items():
            if plan_pattern(pattern).fullmatch(module):
                return style
        return None


def foreach_refuses_mixed_parameters(setup: TrainingSetup, layout: Layout) -> str | None:
    """Why the step cannot run as set up, where torch's own optimizer would take its foreach path on CUDA over
    DTensors and plain tensors at once: tensor parallelism without sequence parallelism leaves the norms' weights
    plain, and DTensor's foreach ops refuse the mix ("got mixed torch.Tensor and DTensor"; DTensor is among
    ``torch.optim.optimizer._foreach_supported_types``, so CUDA's default picks foreach). FSDP2 makes every
    parameter a DTensor, and a LoRA step's trainable adapters are of one kind."""
    default_foreach = setup.optimizer in TORCH_OPTIMIZERS and setup.optimizer_impl is None
    fsdp = layout.engine == "fsdp" and layout.zero >= 2
    if not (setup.mode == "train" and setup.target is Target.CUDA and default_foreach and setup.lora is None):
        return None
    if layout.tp == 1 or layout.sequence_parallel or fsdp:
        return None
    return (
        f"torch's {setup.optimizer} takes its foreach path on CUDA, which refuses the plain norm weights that "
        "tensor parallelism without --sequence-parallel leaves beside DTensors; runs pass foreach=False "
        "(--optimizer-impl for-loop estimates that) or shard the norms (--sequence-parallel)"
    )


def megatron_plan(
    structure: ModelStructure,
    degree: int,
    rank: int,
    gathered_output: bool,
    sequence_length: int | None = None,
    whole_experts: bool = False,
    embedding_as_planned: bool = False,
) -> TpPlan:
    """transformers' own plan for the decoder layers (``_tp_plan``), with Megatron's vocabulary-parallel
    embedding and lm_head; the lm_head output stays sliced for ``loss_parallel()``, or is gathered. With
    ``embedding_as_planned`` (transformers' runtime), the token embedding is vocabulary-parallel only where the model's
    plan names it: transformers 5.24 adds it to every plan, 5.17 only with tied embeddings (configuration_utils.py),
    and leaves it whole on every rank otherwise. With a
    ``sequence_length``, sequence parallelism as torchtitan lays it out: the embedding and the row-wise layers
    reduce-scatter into sequence slices, norms and residuals run on them (``SequenceParallel``), and the
    attention, the MLP (``PrepareModuleInput``) and the lm_head all-gather their input."""
    if not structure.blocks:
        raise UserError(f"--tp: no repeated decoder layers were found in {structure.model_class}.")
    layers = structure.blocks[0].rpartition(".")[0] + ".*."
    styles = {
        pattern: style
        for pattern, style in structure.tp_plan.items()
        if pattern.startswith(layers) and style != REPLICATED_WITH_GRAD_ALLREDUCE
    }
    if whole_experts:  # expert parallelism holds them: the experts' rules of the plan do not apply
        experts = expert_rules(styles)
        styles = {pattern: style for pattern, style in styles.items() if pattern not in experts}
    elif not styles:
        raise UserError(
            f"--tp needs a tensor-parallel plan for the decoder layers, and {structure.model_class} has none. "
            "transformers defines one for Llama, Mistral, Qwen2, Qwen3, Gemma-2, Gemma 3 and GPT-NeoX/Pythia; a "
            "custom model gives one as CustomModel(tp_plan=...). Otherwise use --tp 1."
        )
    whole = sorted({style for style in styles.values() if style in (MOE_TP_EXPERTS, *WHOLE_ACTIVATION_STYLES)})
    if sequence_length and whole:
        raise UserError(
            f"--sequence-parallel with {structure.model_class}'s {', '.join(whole)} is not modelled: transformers' "
            "styles run them on the whole sequence (MoeExpertsParallel all-reduces its output, the gathered "
            "projections replicate theirs), which torchtitan's sequence-parallel layout does not compose with. "
            "Drop --sequence-parallel."
        )
    for pattern, style in styles.items():
        if style not in DECODER_STYLES:
            raise UserError(
                f"--tp: {structure.model_class}'s tensor-parallel plan splits {pattern} as {style!r}, which is "
                f"not modelled (only {', '.join(DECODER_STYLES)} are); use --tp 1."
            )
    if structure.input_embedding and (not embedding_as_planned or planned_embedding(structure)):
        styles[structure.input_embedding] = EMBEDDING_ROWWISE
    if structure.output_embedding:
        styles[structure.output_embedding] = COLWISE_GATHER_OUTPUT if gathered_output else COLWISE
    return TpPlan(degree, rank, styles, sequence_length, structure.output_embedding)


@dataclass(frozen=True)
class _Share:
    """The part of a storage's single-GPU bytes this rank holds: ``local`` of the ``length`` of the split
    dimension."""

    local: int = 1
    length: int = 1
    partial: bool = False  # full size, but a partial sum until all-reduced
    parameter: str | None = None  # the split parameter this is (or a view, copy or cast of)
    matrix: bool = False  # the parameter is a weight (2-D, or 3-D experts), not a bias
    sequence: bool = False  # split along the sequence (sequence parallelism), not the features

    @property
    def fraction(self) -> float:
        """For ordering shares only; bytes are scaled exactly (:meth:`scaled`)."""
        return self.local / self.length

    def scaled(self, nbytes: int) -> int:
        return nbytes * self.local // self.length

    @property
    def sliced(self) -> bool:
        return self.local < self.length

    def slice(self) -> _Share:
        """The same split, as an activation."""
        return _Share(self.local, self.length, sequence=self.sequence)


_REPLICATED = _Share()


@dataclass(frozen=True)
class _Anchor:
    """Where to insert ops: after ``op``, or before it (credited to ``module``)."""

    op: Op
    after: bool
    module: str | None = None

    def insert(self, rw: Rewrite, target: str) -> Point:
        module = self.module if self.module is not None else self.op.module
        if self.after:
            return rw.after(self.op.index, target, module, self.op.phase)
        return rw.before(self.op.index, target, module, self.op.phase)


def tensor_parallel(step: StepGraph, plan: TpPlan) -> StepGraph:
    """The step of tensor-parallel rank ``plan.rank`` of ``plan.degree``."""
    if plan.degree < 2:
        raise ValueError("tensor parallelism needs at least 2 ranks")
    return _TensorParallel(dtensor_sums_out_of_place(step, plan), plan).build()


def dtensor_sums_out_of_place(step: StepGraph, plan: TpPlan) -> StepGraph:
    """The step with the gradient sums of DTensors out of place again: DTensor is a tensor subclass, so the autograd
    engine adds its gradients into a new tensor (tracer/gradient_sums.py), where a plain run adds in place. The
    gradients that are DTensors here: those summed into a parameter's gradient (a tied embedding's, whose weight
    ``parallelize_module`` made a DTensor) and, under sequence parallelism, those of a module's gathered input, which
    stays a DTensor. Every other activation gradient is a plain local tensor (the styles' ``use_local_output``),
    summed in place as in a plain run. Each gradient an in-place sum took over and that is a DTensor lives through
    the sum that reads it again."""
    gatherers = _input_gatherers(plan)
    restored = {}
    for op in step.ops:
        if not (op.sums_gradients and hands_over(op, step.storages)):  # the cheap test first
            continue
        row = step.storages[op.inputs[0]]
        made_in = step.ops[row.producer].module if row.producer is not None else ""
        gathered = plan.sequence_length and any(_within_pattern(made_in, pattern) for pattern in gatherers)
        if gathered or any(step.storages[made].param is not None for made in op.outputs):
            restored[row.id] = replaced(row, freed_after=op.index)
    return dataclasses.replace(step, storages=step.storages | restored) if restored else step


def _input_gatherers(plan: TpPlan) -> list[str]:
    """The modules (plan patterns) that gather their input whole under sequence parallelism: the attention and the
    MLP around the column-wise layers (``PrepareModuleInput``), and the lm_head."""
    layers = {p: style for p, style in plan.styles.items() if p != plan.output_embedding}
    gatherers = [p.rpartition(".")[0] for p, style in layers.items() if style == COLWISE]
    return gatherers + ([plan.output_embedding] if plan.output_embedding else [])


def _within_pattern(module: str, pattern: str) -> bool:
    """Whether the module at path ``module`` is, or lies in, a module the plan's ``pattern`` names."""
    parts = module.split(".")
    return any(plan_pattern(pattern).fullmatch(".".join(parts[:depth])) for depth in range(len(parts), 0, -1))


class _TensorParallel:
    def __init__(self, step: StepGraph, plan: TpPlan) -> None:
        self.step, self.plan = step, plan
        self.rw = Rewrite(step)
        self.share: dict[int, _Share] = {}  # what each storage holds now, for the ops that read it
        self.size: dict[int, _Share] = {}  # what each storage holds when made: its bytes
        self.param_share: dict[str, _Share] = {}
        self.param_shape: dict[str, tuple[int, ...]] = {}
        self.module_weight: dict[str, _Share] = {}  # the split weight each module's matmuls use
        self.pending: dict[int, tuple[str, Op]] = {}  # partial sums -> module they stay partial in, its last op
        self.gathered: dict[int, str] = {}  # gathered sequence slices -> the module that reads them whole
        self.gathered_by: dict[str, str] = {}  # module of a layer reading a gathered input -> who gathered it
        self.split_inputs: dict[int, tuple[str, _Share]] = {}  # whole inputs -> the module whose backward reads a slice
        layers = {p: style for p, style in plan.styles.items() if p != plan.output_embedding}
        self.forward_gatherers = _input_gatherers(plan)
        self.backward_gatherers = [p for p, style in layers.items() if style in (ROWWISE, EMBEDDING_ROWWISE)]
        # multi-head latent attention modules, whose heads share a rotary key that their latent projection splits off
        self.latent_attention = [p.rpartition(".")[0] for p, style in layers.items() if style == MLA_KV_A_PROJ]
        self.rejoined: set[int] = set()  # latent projections' output gradients already joined anew
        self._styles: dict[str, str | None] = {}
        self._gatherers: dict[tuple[bool, str], str | None] = {}
        # this rank's key/value heads (they divide evenly), or all of them when the plan leaves attention whole
        self._cache_share = _Share(1, plan.degree) if splits_key_heads(plan.styles) else _REPLICATED

    def build(self) -> StepGraph:
        self.shard_parameters()
        walked = [op for op in self.step.ops if op.phase is not Phase.OPTIMIZER]
        for op in walked:
            self.visit(op)
        for storage_id, (scope, last) in list(self.pending.items()):
            self.reduce_partial_sum(storage_id, _Anchor(last, after=True), scope)
        self.shard_optimizer()
        self.redistribute_replicated()
        self.resize()
        return self.rw.build()

    # Parameters and what derives from them.

    def shard_parameters(self) -> None:
        for row in self.step.storages.values():
            if row.role is not Role.PARAMETER or row.param is None:
                continue
            dim = self._split_dim(row)
            if dim is None or dim >= len(row.shape):
                continue
            length = row.shape[dim]
            local = chunk_length(length, self.plan.degree, self.plan.rank)
            self.param_share[row.param] = _Share(local, length, parameter=row.param, matrix=len(row.shape) >= 2)
            self.param_shape[row.param] = (*row.shape[:dim], local, *row.shape[dim + 1 :])
        for row in self.step.storages.values():
            if row.role is Role.KV_CACHE:  # made by any op, or before the traced decode step
                self.share[row.id] = self.size[row.id] = self._cache_share
                continue
            if row.producer is not None or row.role is Role.OPTIMIZER_STATE:
                continue
            share = self.param_share.get(row.param or "", _REPLICATED) if row.role is Role.PARAMETER else _REPLICATED
            self.share[row.id] = self.size[row.id] = share
            if share.sliced:  # distribute_tensor pads a short shard to the first one's length, keeps a view
                self.size[row.id] = _Share(chunk_length(share.length, self.plan.degree, 0), share.length)

    def shard_optimizer(self) -> None:
        """Optimizer states and temporaries of a split parameter the size of the parameter hold its slice;
        SGD's momentum buffer starts as a copy of the gradient (``torch.clone(grad)`` in torch/optim/sgd.py),
        so it holds what the gradient holds."""
        gradient = {row.param: self.size[row.id] for row in self.step.storages.values() if row.role is Role.GRADIENT}
        for row in self.step.storages.values():
            if not (row.role is Role.OPTIMIZER_STATE or self.step.made_in(row, Phase.OPTIMIZER)):
                continue
            share = self.param_share.get(row.param or "")
            if share is None or not self._same_size(row):
                share = _REPLICATED
            elif row.name.endswith(GRADIENT_SHAPED_STATE):
                share = gradient.get(row.param, share).slice()
            self.share[row.id] = self.size[row.id] = share.slice()

    def _split_dim(self, row: StorageRow) -> int | None:
        """The dimension of a parameter the plan splits: by its module's style, or, for experts' weights, by the
        style the plan gives the parameter itself."""
        style = self.plan.style_of(row.param)
        if style is not None and len(row.shape) == 3:
            dim = _EXPERT_WEIGHT_DIM.get(style)
            halves = 2 if style in _PACKED else 1
            if dim is not None and row.shape[dim] % (halves * self.plan.degree):
                raise UserError(
                    f"--tp {self.plan.degree} must divide the experts' intermediate size ({row.shape[dim] // halves}) "
                    f"of {row.param}."
                )
            return dim
        module, _, leaf = row.param.rpartition(".")
        style = self.plan.style_of(module)
        return (_WEIGHT_DIM if leaf == "weight" else _BIAS_DIM).get(style) if style else None

    @cached_property
    def _param_rows(self) -> dict[str, int]:
        return {row.param: row.id for row in self.step.storages.values() if row.role is Role.PARAMETER and row.param}

    def _param_row(self, name: str) -> int:
        return self._param_rows[name]

    # The walk.

    def visit(self, op) -> None:
        self.settle_partial_sums(op)
        if self.plan.sequence_length:
            self.gather_sequence_inputs(op)
        style = self._style(op.module)
        if not op.runs_forward and style == COLWISE_GATHER_OUTPUT:
            self.split_incoming_gradients(op)
        elif op.runs_forward and style == ROWWISE_SPLIT_INPUT:
            self.split_inputs_entering(op)
        elif not op.runs_forward and style == MLA_KV_A_PROJ:
            self.rejoin_latent_gradient(op)
        storages = self.step.storages
        made = [s for s in op.outputs if storages[s].producer == op.index and s not in self.share]
        if not made:
            return
        inputs = [self.input_share(op, s) for s in op.inputs if s not in made]
        parameters = [share for share in inputs if share.parameter]
        weights = [share for share in parameters if share.matrix]
        activations = [share for share in inputs if not share.parameter]
        gather = False
        if op.target in _MATMULS and weights:
            weight = weights[0]
            self.module_weight.setdefault(op.module, weight)
            out = _Share(partial=True) if any(share.sliced for share in activations) else weight.slice()
            # colwise_gather_output's output; in backward, rowwise_split_input's input gradient (Shard(-1) -> Replicate)
            gather = out.sliced and style == (COLWISE_GATHER_OUTPUT if op.runs_forward else ROWWISE_SPLIT_INPUT)
        elif op.target == _EMBEDDING and weights:
            out = _Share(partial=True)
        elif op.target == _EMBEDDING_BACKWARD:  # DTensor has no vocabulary-sharded strategy for it
            out = _REPLICATED
        elif len(parameters) == 1 and not activations:  # a copy, cast or view of the parameter
            out = parameters[0]
        elif any(share.partial for share in inputs):  # scaled or accumulated, still a partial sum
            out = _Share(partial=True)
        elif self.sums_shared_rotary_key(op, made[0]):
            out = _REPLICATED
        else:
            out = min(inputs, key=lambda share: share.fraction, default=_REPLICATED).slice()
            if out.sliced and op.phase is Phase.BACKWARD:
                self.slice_replicated_operands(op, made, out)
        for storage_id in made:
            self.share[storage_id] = self.size[storage_id] = out
        if op.target == _LOG_SOFTMAX and out.sliced:
            self.parallel_log_softmax(op, made[0])
        elif op.target == _NLL_LOSS_BACKWARD and out.sliced:
            self.parallel_nll_loss_backward(op, made[0])
        for storage_id in made:
            if out.partial:
                self.pending[storage_id] = (self.partial_scope(op), op)
            elif gather:
                self.all_gather(op, storage_id)
            elif op.runs_forward and style == MLA_KV_A_PROJ and op.target in _MATMULS:
                self.join_latent_output(op, storage_id)

    def slice_replicated_operands(self, op, made: list[int], out: _Share) -> None:
        """A backward op that combines a sliced gradient with a replicated one of the same shape (a tied embedding's
        gradient sum: the output layer's slice and the embedding's gradient, which DTensor does not split)
        redistributes the replicated one to the slice first (``Replicate -> Shard(0)``), a contiguous copy held
        until the op."""
        shape = self.step.storages[made[0]].shape
        for storage_id in op.inputs:
            row = self.step.storages[storage_id]
            share = self.input_share(op, storage_id)
            if share.sliced or share.partial or row.role is Role.PARAMETER or row.shape != shape:
                continue
            nbytes = self._bytes(row, out)
            point = self.rw.before(op.index, "tp.redistribute", op.module, op.phase)
            self.rw.add(nbytes, Role.TEMPORARY, point, self._at(op.index), f"{row.name} slice", row.dtype)

    def split_inputs_entering(self, op) -> None:
        """``rowwise_split_input``: the rank's slice of the whole input, copied out as it enters the module
        (DTensor's ``Replicate -> Shard(-1)`` in the input hook), which the module reads instead from then on, in
        its forward (a recomputed one too) and its backward. The slice is held until the module returns; in
        training, until the backward node that saved it releases it (the weight's gradient read it), and the whole
        input only as long as something outside the module reads it."""
        module = op.module
        for storage_id in op.inputs:
            row = self.step.storages[storage_id]
            made_inside = row.producer is not None and within(self.step.ops[row.producer].module, module)
            share = self.input_share(op, storage_id)
            if row.role is Role.PARAMETER or share.parameter or share.sliced or made_inside:
                continue
            weight = self.param_share[f"{module}.weight"]
            self.split_inputs[storage_id] = (module, weight.slice())
            point = self.rw.before(op.index, "tp.split_input", module, op.phase)
            end = self._run_end(op.index, module)
            backward = [u for u in row.users if not self.step.ops[u].runs_forward]
            mine = [u for u in backward if within(self.step.ops[u].module, module)]
            nbytes = self._bytes(row, weight.slice())
            if not mine:
                self.rw.add(nbytes, Role.TEMPORARY, point, Point(end, 0), "input slice", row.dtype)
                continue
            _, released = self.rw.lifetime(storage_id)
            self.rw.add(nbytes, Role.ACTIVATION, point, released, "input slice", row.dtype)
            if set(backward) == set(mine):
                outside = [u for u in row.users if u not in mine and not within(self.step.ops[u].module, module)]
                self.rw.retime(storage_id, last=Point(max([*outside, end]), 0))
                self.rw.set_role(storage_id, Role.TEMPORARY)

    def input_share(self, op, storage_id: int) -> _Share:
        """What ``op`` reads: a sequence slice gathered for a module is full inside it; a whole input a
        ``rowwise_split_input`` module split is its slice inside that module."""
        scope = self.gathered.get(storage_id)
        if scope is not None and within(op.module, scope):
            return _REPLICATED
        split = self.split_inputs.get(storage_id)
        if split is not None and within(op.module, split[0]):
            return split[1]
        return self.share.get(storage_id, _REPLICATED)

    # Partial sums: reduced when the computation leaves the module that holds them.

    def partial_scope(self, op) -> str:
        """Where a partial sum stays partial: the module that made it (its output hook reduces it, or
        ``_FromTorchTensor.backward`` for an input gradient), or, under sequence parallelism, the module
        that gathered that input (``PrepareModuleInput``: the gradients of q, k and v add up first)."""
        if not op.runs_forward:
            return self.gathered_by.get(op.module, op.module)
        return op.module

    def settle_partial_sums(self, op) -> None:
        """Reduce the partial sums ``op`` is outside the module of. In forward the collective runs in the
        module's output hook, before leaving it frees anything: right after its last op that allocated. In
        backward it runs in the next autograd node, after the module's nodes released what they saved."""
        for storage_id, (scope, last) in list(self.pending.items()):
            if within(op.module, scope):
                if any(self.step.storages[s].producer == op.index for s in op.outputs):
                    self.pending[storage_id] = (scope, op)
                continue
            del self.pending[storage_id]
            if last.runs_forward:
                self.reduce_partial_sum(storage_id, _Anchor(last, after=True), scope)
            else:
                self.reduce_partial_sum(storage_id, _Anchor(op, after=False, module=last.module), scope)

    def reduce_partial_sum(self, storage_id: int, anchor: _Anchor, scope: str) -> None:
        row = self.step.storages[storage_id]
        if not self.plan.sequence_length:
            if self._reduced_in_place(scope):
                anchor.insert(self.rw, "c10d.allreduce_")
            else:
                point = anchor.insert(self.rw, "_c10d_functional.all_reduce")
                self._hand_over(storage_id, point, row.nbytes, "all-reduce output")
            self.share[storage_id] = _REPLICATED
            return
        sliced = self._sequence_slice()
        cat = anchor.insert(self.rw, "tp.cat_for_reduce_scatter")
        scatter = anchor.insert(self.rw, "_c10d_functional.reduce_scatter_tensor")
        self.rw.add(row.nbytes, Role.TEMPORARY, cat, scatter, "reduce-scatter input", row.dtype)
        self._hand_over(storage_id, scatter, self._bytes(row, sliced), "reduce-scatter output")
        self.share[storage_id] = sliced

    def _reduced_in_place(self, module: str) -> bool:
        """transformers' local inference kernel of a row-wise Linear: ``dist.all_reduce`` on its own output; with
        a bias, ``output + bias`` then takes over from it, as a new buffer would. MoE experts always reduce theirs
        in place."""
        if self._style(module) == MOE_TP_EXPERTS:  # MoeExpertsParallel's _AllReduceForward and _AllReduceBackward
            return True
        if not self.plan.reduce_in_place or self._style(module) not in (ROWWISE, ROWWISE_SPLIT_INPUT):
            return False
        return f"{module}.bias" not in self._param_rows

    def _sequence_slice(self) -> _Share:
        length = self.plan.sequence_length or 1
        return _Share(chunk_length(length, self.plan.degree, self.plan.rank), length, sequence=True)

    # Sequence parallelism: slices of the sequence gathered where the tensor-parallel region needs them.

    def gather_sequence_inputs(self, op) -> None:
        """Sequence slices entering a module that needs them whole are gathered first: in forward the
        attention and the MLP (``PrepareModuleInput``) and the lm_head; in backward the row-wise layers and
        the embedding, whose outputs were reduce-scattered."""
        gatherer = self._gathering_module(op)
        needs_whole = op.runs_forward or op.target in _MATMULS or op.target == _EMBEDDING_BACKWARD
        if gatherer is None or not needs_whole:  # in backward, gradients merely added stay slices
            return
        for storage_id in op.inputs:
            row = self.step.storages[storage_id]
            made_inside = row.producer is not None and within(self.step.ops[row.producer].module, gatherer)
            if made_inside or not self.input_share(op, storage_id).sequence:
                continue
            if op.runs_forward:
                self.gather_module_input(op, storage_id, gatherer)
            else:
                self.gather_output_gradient(op, storage_id, gatherer)
            self.gathered[storage_id] = gatherer
        if op.runs_forward:
            self.gathered_by[op.module] = gatherer

    def gather_module_input(self, op, storage_id: int, module: str) -> None:
        """The gathered input lives as long as the module keeps it for backward, or until the module
        returns; the slice until the module returns, or, for the lm_head's, the end of the forward (the
        model's output holds it)."""
        row = self.step.storages[storage_id]
        cat = self._all_gather_sequence(op, row)
        _, last = self.rw.lifetime(storage_id)
        saved = any(
            not self.step.ops[user].runs_forward and within(self.step.ops[user].module, module) for user in row.users
        )
        end = last if saved else Point(self._run_end(op.index, module), 0)
        self.rw.add(row.nbytes, row.role if saved else Role.TEMPORARY, cat, end, "gathered sequence", row.dtype)
        keeper = "" if module == self.plan.output_embedding else module
        self.rw.retime(storage_id, last=Point(self._run_end(op.index, keeper), 0))
        if row.role is Role.ACTIVATION:
            self.rw.set_role(storage_id, Role.TEMPORARY)

    def gather_output_gradient(self, op, storage_id: int, module: str) -> None:
        """The gathered gradient lives while the module's backward reads it; the slice as before."""
        row = self.step.storages[storage_id]
        cat = self._all_gather_sequence(op, row)
        inside = [user for user in row.users if user >= op.index and within(self.step.ops[user].module, module)]
        self.rw.add(row.nbytes, Role.TEMPORARY, cat, Point(max(inside), 0), "gathered gradient", row.dtype)
        if all(within(self.step.ops[user].module, module) for user in row.users if user >= op.index):
            self.rw.retime(storage_id, last=cat)

    def _all_gather_sequence(self, op, row: StorageRow) -> Point:
        share = self.share[row.id]
        piece = chunk_length(share.length, self.plan.degree, 0)
        gather = self.rw.before(op.index, "_c10d_functional.all_gather_into_tensor", op.module, op.phase)
        cat = self.rw.before(op.index, "tp.cat_gathered", op.module, op.phase)
        buffer = row.nbytes * piece * self.plan.degree // share.length
        self.rw.add(buffer, Role.COMMUNICATION, gather, cat, "all-gather buffer", row.dtype)
        return cat

    def _gathering_module(self, op) -> str | None:
        key = (op.runs_forward, op.module)
        if key not in self._gatherers:
            patterns = self.forward_gatherers if op.runs_forward else self.backward_gatherers
            parts = op.module.split(".")
            prefixes = (".".join(parts[:depth]) for depth in range(len(parts), 0, -1))
            matches = (m for m in prefixes if any(plan_pattern(p).fullmatch(m) for p in patterns))
            self._gatherers[key] = next(matches, None)
        return self._gatherers[key]

    def _style(self, module: str) -> str | None:
        if module not in self._styles:
            self._styles[module] = self.plan.style_of(module)
        return self._styles[module]

    # Collectives: each replaces a storage from a point on by a new one (the storage stops there).

    def all_gather(self, op, storage_id: int) -> None:
        """``Shard -> Replicate`` of a slice: every rank sends a piece of the first rank's length, so a
        shorter slice is padded first, and a gathered tensor longer than the original is cut back by a copy
        (``_to_replicate_tensor``)."""
        row, share = self.step.storages[storage_id], self.share[storage_id]
        piece = chunk_length(share.length, self.plan.degree, 0)
        gathered_length = piece * self.plan.degree

        def nbytes(length: int) -> int:
            return row.nbytes * length // share.length

        pad = self.rw.after(op.index, "tp.pad_slice", op.module, op.phase) if share.local < piece else None
        gather = self.rw.after(op.index, "_c10d_functional.all_gather_into_tensor", op.module, op.phase)
        cat = self.rw.after(op.index, "tp.cat_gathered", op.module, op.phase)
        unpad = self.rw.after(op.index, "tp.unpad_gathered", op.module, op.phase)
        done = unpad if gathered_length != share.length else cat
        if pad is not None:
            self.rw.add(nbytes(piece), Role.TEMPORARY, pad, done, "padded slice", row.dtype)
        self.rw.add(nbytes(gathered_length), Role.COMMUNICATION, gather, cat, "all-gather buffer", row.dtype)
        if done is unpad:
            self.rw.add(nbytes(gathered_length), Role.TEMPORARY, cat, unpad, "padded gathered", row.dtype)
        self._hand_over(storage_id, done, row.nbytes, "gathered output")
        self.share[storage_id] = _REPLICATED

    def split_incoming_gradients(self, op) -> None:
        """A gather-output module's backward receives the full gradient and keeps its own slice."""
        weight = self.module_weight.get(op.module)
        if weight is None:
            return
        for storage_id in op.inputs:
            row = self.step.storages[storage_id]
            share = self.share.get(storage_id, _REPLICATED)
            made_here = row.producer is not None and self.step.ops[row.producer].module == op.module
            gradient = row.producer is not None and not self.step.ops[row.producer].runs_forward
            if share.sliced or share.parameter or made_here or not gradient:
                continue
            point = self.rw.before(op.index, "tp.split_gradient", op.module, op.phase)
            sliced = weight.slice()
            self._hand_over(storage_id, point, self._bytes(row, sliced), "gradient slice")
            self.share[storage_id] = sliced

    # Multi-head latent attention (MlaKvAProjParallel).

    def join_latent_output(self, op, storage_id: int) -> None:
        """The latent projection's output, split into the latent and the rotary key and joined again by
        ``torch.cat``: a copy that takes over from it (in forward, recomputation and inference alike)."""
        cat = self.rw.after(op.index, "tp.mla_cat", op.module, op.phase)
        self._hand_over(storage_id, cat, self.step.storages[storage_id].nbytes, "latent and rotary key joined")

    def sums_shared_rotary_key(self, op, made: int) -> bool:
        """Whether a backward op sums the gradient of the rotary key over the rank's heads (``expand``'s backward):
        every head shares the key, so the sum is a partial one of full size. The latent projection's style all-reduces
        it in place (:meth:`rejoin_latent_gradient`), so it is no pending partial sum here."""
        if op.target != _SUM or op.runs_forward or not self._in_latent_attention(op.module):
            return False
        source, result = self.step.storages[op.inputs[0]], self.step.storages[made]
        summed_heads = len(source.shape) == len(result.shape) and any(
            kept == 1 < size for size, kept in zip(source.shape, result.shape, strict=True)
        )
        return summed_heads and self.input_share(op, source.id).sliced

    def rejoin_latent_gradient(self, op) -> None:
        """Where the latent projection's output gradient arrives, its style's backward: the rotary key's part made
        contiguous (a copy, ``grad.contiguous()``) and all-reduced in place, then the split's backward joins both
        parts into a new gradient that takes over from the arriving one."""
        rotary = self.step.structure.rotary_key_dim
        for storage_id in op.inputs:
            row = self.step.storages[storage_id]
            if storage_id in self.rejoined or row.producer is None or row.role is Role.PARAMETER:
                continue
            producer = self.step.ops[row.producer]
            if producer.runs_forward or within(producer.module, op.module):
                continue
            if rotary is None:
                raise UserError(f"--tp: {op.module} is split as {MLA_KV_A_PROJ!r}; the config has no qk_rope_head_dim.")
            copy = self.rw.before(op.index, "tp.mla_rotary_key_contiguous", op.module, op.phase)
            self.rw.before(op.index, "c10d.allreduce_", op.module, op.phase)
            cat = self.rw.before(op.index, "tp.mla_split_backward", op.module, op.phase)
            rotary_bytes = row.nbytes * rotary // row.shape[-1]
            self.rw.add(rotary_bytes, Role.TEMPORARY, copy, cat, "rotary key gradient", row.dtype)
            self._hand_over(storage_id, cat, row.nbytes, "latent gradient joined")
            self.rejoined.add(storage_id)

    def _in_latent_attention(self, module: str) -> bool:
        return any(plan_pattern(pattern).fullmatch(module) for pattern in self.latent_attention)

    def _hand_over(self, storage_id: int, point, nbytes: int, name: str) -> None:
        row = self.step.storages[storage_id]
        _, last = self.rw.lifetime(storage_id)
        self.rw.add(nbytes, row.role, point, last, name, row.dtype, row.param)
        self.rw.retime(storage_id, last=point)
        if row.role is Role.ACTIVATION:
            self.rw.set_role(storage_id, Role.TEMPORARY)

    def redistribute_replicated(self) -> None:
        """An optimizer op that updates a parameter's slice from a full-size storage of it (the embedding's
        gradient, which DTensor does not split, or a momentum buffer copied from it) redistributes that to
        the slice first, a contiguous copy per argument: twice for ``exp_avg_sq.addcmul_(grad, grad)``."""
        for op in self.step.ops:
            if op.phase is not Phase.OPTIMIZER:
                continue
            by_param: dict[str, list[StorageRow]] = {}
            for storage_id in op.inputs:
                row = self.step.storages[storage_id]
                if row.param in self.param_share and self._same_size(row):
                    by_param.setdefault(row.param, []).append(row)
            for param, rows in by_param.items():
                if not any(self.size[row.id].sliced for row in rows):
                    continue
                for row in rows:
                    if self.size[row.id].sliced:
                        continue
                    nbytes = self._bytes(row, self.param_share[param].slice())
                    for _ in range(2 if "addcmul" in op.target else 1):
                        point = self.rw.before(op.index, "tp.redistribute", op.module, op.phase)
                        self.rw.add(nbytes, Role.TEMPORARY, point, self._at(op.index), f"{row.name} slice", row.dtype)

    # loss_parallel()

    def parallel_log_softmax(self, op, output: int) -> None:
        row = self.step.storages[output]
        nbytes = self._bytes(row, self.share[output])
        shifted = self.rw.before(op.index, "tp.loss_parallel.sub_max", op.module, op.phase)
        exp = self.rw.before(op.index, "tp.loss_parallel.exp", op.module, op.phase)
        self.rw.add(nbytes, Role.TEMPORARY, shifted, self._at(op.index), "x - max(x)", row.dtype)
        self.rw.add(nbytes, Role.TEMPORARY, exp, exp, "exp(x - max(x))", row.dtype)

    def parallel_nll_loss_backward(self, op, zeros: int) -> None:
        """The gradient of nll_loss and log_softmax together: ``(zeros_like(x) + exp(x)) * grad``."""
        row = self.step.storages[zeros]
        consumer = next((self.step.ops[u] for u in row.users if self.step.ops[u].target == _LOG_SOFTMAX_BACKWARD), None)
        if consumer is None:
            return
        nbytes = self._bytes(row, self.share[zeros])
        exp = self.rw.after(op.index, "tp.loss_parallel.exp", op.module, op.phase)
        add = self.rw.after(op.index, "tp.loss_parallel.add", op.module, op.phase)
        mul = self.rw.after(op.index, "tp.loss_parallel.mul", op.module, op.phase)
        self.rw.add(nbytes, Role.TEMPORARY, exp, add, "exp(log_softmax)", row.dtype)
        self.rw.add(nbytes, Role.TEMPORARY, add, mul, "zeros + exp", row.dtype)
        self.rw.retime(zeros, last=mul)
        for gradient in consumer.outputs:
            if self.step.storages[gradient].producer == consumer.index:
                self.rw.retime(gradient, first=mul)

    # Sizes.

    def resize(self) -> None:
        for storage_id, share in self.size.items():
            if not share.sliced:
                continue
            row = self.step.storages[storage_id]
            shape = self.param_shape.get(row.param) if row.param and self._same_size(row) else None
            self.rw.resize(storage_id, self._bytes(row, share), shape=shape)

    def _same_size(self, row: StorageRow) -> bool:
        """Whether the storage is as large as its parameter (not, say, a 0-dim step counter)."""
        return row.numel == self.step.storages[self._param_row(row.param)].numel

    def _bytes(self, row: StorageRow, share: _Share) -> int:
        return share.scaled(row.nbytes)

    def _run_end(self, index: int, scope: str) -> int:
        """The last op of the forward run (or checkpointed recomputation) of ``scope`` that ``index`` is in."""
        end = index
        while end + 1 < len(self.step.ops):
            following = self.step.ops[end + 1]
            if not following.runs_forward or not within(following.module, scope):
                break
            end += 1
        return end

    def _at(self, index: int) -> Point:
        return Point(index, 0)
