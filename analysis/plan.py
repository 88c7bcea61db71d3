"""The planner: every layout of a GPU budget, each with the largest micro-batch that fits and its step time,
ranked by training throughput (LLMem's decision, over many more layouts).

Each distinct single-GPU step (with or without checkpointing, and the low-precision step sharded mixed
precision traces) is traced at batch sizes 2 and 3 and, when a layout needs it, 1; with a global batch that
leaves a rank more than one sequence, so is its step of two accumulating micro-steps, before the search. Every
other batch size is a point on the line through 2 and 3 (analysis/batch_line.py), for the traced step and for each
rank's transformed step, so the batch search re-traces nothing. A layout whose throughput ceiling (its ops at their
roofline) is below the fastest layout found is listed rather than searched, unless the search is exhaustive.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import pickle
import queue
import signal
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, TypeVar

import torch

from analysis.budget import MemoryBudget
from analysis.collector import collector_paused
from analysis.estimate import LayoutEstimate, StepSource
from analysis.flags import PIPELINE_SEARCH
from analysis.report import MemoryReport
from analysis.steptime import (
    Cluster,
    StepTime,
    block_roofline_seconds_per_sequence,
    pipeline_step_time,
    roofline_seconds_per_sequence,
    step_time,
)
from strategies.layout import Layout, Rank, prepare
from strategies.pipeline import layer_split, rank_stages, schedule_takes
from strategies.tensor_parallel import TensorParallel
from tracer.errors import UserError
from tracer.expert_parallel import routed_experts
from tracer.gpus import find_gpu
from tracer.resolve import Model
from tracer.tracing import may_derive_accumulation, traced_micro_steps
from tracer.training import LoraSetup, Target, TrainingSetup
from tracer.units import format_bytes

MAX_MICRO_BATCH = 1024
# Pipelines the search tries: up to 8 stages, with at most twice as many microbatches as stages (a 1F1B bubble of
# (P - 1) / (3P - 1) at most that; each stage's step holds every microbatch's passes, so more cost more to search).
MAX_PIPELINE_STAGES = 8
# Sequences from this long are also split by context parallelism, over up to 8 GPUs (its ring's exchanges stay in
# a node); shorter ones fit a GPU's activations without it.
CONTEXT_PARALLEL_FROM = 16_384
MAX_CONTEXT_PARALLEL = 8
MICROBATCHES_PER_STAGE = 2
# Layouts searched in a round: those whose throughput ceiling is within this share of the highest left (at first, the
# layouts that do not recompute their forward, where some do); once one fits, the others only where their ceiling
# beats the fastest found.
CEILING_ROUND = 0.9
AS_FAST_WITHIN = 0.01  # a layout this much slower than the fastest (a share of its tokens/s) is as fast
LINE_BATCHES = (StepSource.LINE_FIRST, StepSource.LINE_FIRST + 1)
T = TypeVar("T")


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    checkpointing: str | None  # --grad-checkpointing

    def describe(self) -> str:
        scheme = self.layout.describe().partition(": ")[2] or "single GPU"
        return scheme + (f", {self.checkpointing} checkpointing" if self.checkpointing else "")


@dataclass
class Outcome:
    candidate: Candidate
    micro_batch: int = 0  # 0: not even one sequence fits
    accumulation: int = 1
    needed_at: int = 1  # the micro-batch needed_bytes was read at when nothing fits
    report: MemoryReport | None = None  # at micro_batch, or at batch 1 when nothing fits (None: see needed_is_floor)
    needed_bytes: int = 0
    # needed_bytes is only the allocated peak plus the CUDA context, which already rules the layout out: the caching
    # allocator's replay, which can only add to it, was not run (nor a report made)
    needed_is_floor: bool = False
    time: StepTime | None = None
    tokens_per_second: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.micro_batch > 0


@dataclass
class Plan:
    model_id: str
    setup: TrainingSetup
    cluster: Cluster
    budget: MemoryBudget
    gpus: int
    global_batch: int | None
    outcomes: list[Outcome]  # fitting ones fastest first, then the rest
    skipped: list[str]  # layouts not considered, with why
    suggestions: list[str] = field(default_factory=list)  # when nothing fits
    # layouts not searched, their throughput ceiling (tokens/s) below the best's: they cannot be as fast
    slower: dict[Candidate, float] = field(default_factory=dict)

    @property
    def best(self) -> Outcome | None:
        return self.outcomes[0] if self.outcomes and self.outcomes[0].fits else None


def candidates(
    model: Model,
    setup: TrainingSetup,
    gpus: int,
    cluster: Cluster,
    offload: bool = True,
    pipeline: str = "auto",
    routing_imbalance: float = 1.0,
) -> tuple[list[Candidate], list[str]]:
    """Every layout of ``gpus`` GPUs the model and step can be split into, each with and without full
    activation checkpointing (only the user's choice if they made one); and the layouts left out, with why.
    ``pipeline``: "on" adds pipeline-parallel layouts, "off" leaves them out, "only" gives them alone.
    ``routing_imbalance``: the routing expert-parallel layouts assume (--routing-imbalance)."""
    layers = getattr(model.config, "num_hidden_layers", None) if model.config is not None else None
    experts = routed_experts(model.config) if model.config is not None else None
    layouts: list[Layout] = []
    skipped: list[str] = []
    tensor_degrees = []
    context_degrees = _context_degrees(gpus, setup.seq_len)
    for tp in (t for t in range(1, gpus + 1) if gpus % t == 0):
        if tp > cluster.gpus_per_node:
            skipped.append(f"tensor parallel {tp}: wider than a node of {cluster.gpus_per_node} GPUs")
            continue
        try:
            if tp > 1 and model.config is not None:
                TensorParallel(tp).check(model.config)
            elif tp > 1 and not model.tp_plan:
                raise UserError("this custom model has no tp_plan")
        except UserError as error:
            skipped.append(f"tensor parallel {tp}: {error}")
            continue
        tensor_degrees.append(tp)
        if pipeline != "only":
            layouts += _data_parallel_layouts(gpus, tp, offload)
        if pipeline in ("on", "only") and layers is not None:
            layouts += _pipeline_layouts(gpus, tp, layers, context_degrees)
    if pipeline != "only":
        layouts += _context_parallel_layouts(gpus, tensor_degrees, context_degrees)
    if pipeline != "only" and gpus > 1 and setup.seq_len < CONTEXT_PARALLEL_FROM:
        skipped.append(
            f"context parallelism: searched for sequences from {CONTEXT_PARALLEL_FROM:,} tokens (this one has "
            f"{setup.seq_len:,}; analyze --cp models it at any length)"
        )
    if experts and pipeline != "only":
        expert_parallel, wide = _expert_parallel_layouts(gpus, experts, cluster.gpus_per_node, routing_imbalance)
        layouts += expert_parallel
        skipped += wide
    checkpointing = (setup.grad_checkpointing,) if setup.grad_checkpointing else (None, "full")
    chosen = []
    for layout in layouts:
        try:
            prepare(layout, setup, model.config)
        except UserError as error:
            skipped.append(f"{layout.describe()}: {error}")
            continue
        chosen += [Candidate(layout, mode) for mode in checkpointing]
    return chosen, skipped


def _context_degrees(gpus: int, seq_len: int) -> list[int]:
    """The context-parallel degrees searched: 2 to 8 GPUs splitting each sequence into twice as many equal chunks
    (torch's load-balanced context_parallel), for sequences from ``CONTEXT_PARALLEL_FROM`` tokens."""
    if seq_len < CONTEXT_PARALLEL_FROM:
        return []
    return [c for c in range(2, min(gpus, MAX_CONTEXT_PARALLEL) + 1) if gpus % c == 0 and seq_len % (2 * c) == 0]


def _context_parallel_layouts(gpus: int, tensor_degrees: list[int], context_degrees: list[int]) -> list[Layout]:
    """Long sequences split by context parallelism, alone or with each tensor-parallel degree the model takes, the
    parameters sharded over the data- and context-parallel GPUs (FSDP2, as torchtitan shards over its dp_shard x cp
    mesh)."""
    return [
        Layout(gpus=gpus, cp=cp, tp=tp, zero=3)
        for tp in tensor_degrees
        for cp in context_degrees
        if gpus % (cp * tp) == 0
    ]


def _expert_parallel_layouts(
    gpus: int, experts: int, gpus_per_node: int, routing_imbalance: float
) -> tuple[list[Layout], list[str]]:
    """The widest expert-parallel degree dividing the GPUs and the routed experts within a node, under the
    data-parallel runtimes torchtitan composes it with: FSDP2 over all the GPUs, resharding after forward or not,
    and DDP where each expert lives on one GPU (degree = GPUs; ``prepare`` refuses it below); and the degrees left
    out, with why.

    Each degree is a step of its own to trace (the rank's experts and exchanges). Under FSDP2 every degree shards
    the experts over all the GPUs alike and runs each GPU's routed tokens through the same FLOPs; a wider one
    gathers fewer experts' weights per layer (81.2, 81.9 and 82.7 GiB for degrees 8, 4 and 2 of Qwen3-30B-A3B
    over 8 H100s) for an all-to-all that stays in the node, so the narrower ones are left out rather than traced.
    Wider than a node, every MoE layer's all-to-all would cross the slower links between nodes."""
    degrees = [e for e in range(2, gpus + 1) if gpus % e == 0 and experts % e == 0]
    in_node = [e for e in degrees if e <= gpus_per_node]
    skipped = []
    layouts = []
    if in_node:
        ep = in_node[-1]
        if ep == gpus:
            layouts.append(Layout(gpus=gpus, ep=ep, routing_imbalance=routing_imbalance))
        layouts += [Layout(gpus=gpus, ep=ep, zero=zero, routing_imbalance=routing_imbalance) for zero in (2, 3)]
        narrower = [str(e) for e in in_node[:-1]]
        if narrower:
            skipped.append(
                f"expert parallel {', '.join(narrower)}: expert parallel {ep} holds less at the same FLOPs "
                "(--ep to analyze one)"
            )
    wide = [str(e) for e in degrees if e > gpus_per_node]
    if wide:
        skipped.append(f"expert parallel {', '.join(wide)}: wider than a node of {gpus_per_node} GPUs")
    return layouts, skipped


def _data_parallel_layouts(gpus: int, tp: int, offload: bool) -> list[Layout]:
    dp = gpus // tp
    if dp == 1:
        single = [Layout(gpus=gpus, tp=tp)]
        if offload and tp == 1:
            single.append(Layout(zero=2, engine="deepspeed", offload="optimizer"))
        return single
    layouts = [Layout(gpus=gpus, tp=tp, zero=zero) for zero in (0, 1, 2, 3)]
    layouts += [Layout(gpus=gpus, tp=tp, zero=zero, engine="deepspeed") for zero in (1, 2, 3)]
    if offload:
        layouts += [
            Layout(gpus=gpus, tp=tp, zero=2, engine="deepspeed", offload="optimizer"),
            Layout(gpus=gpus, tp=tp, zero=3, engine="deepspeed", offload="optimizer,params"),
            Layout(gpus=gpus, tp=tp, zero=3, offload="optimizer,params"),
        ]
    return layouts


def _pipeline_layouts(gpus: int, tp: int, layers: int, context_degrees: list[int]) -> list[Layout]:
    """Pipelines of up to ``MAX_PIPELINE_STAGES`` ranks dividing the GPUs left by tensor (and, for long sequences,
    context) parallelism, under 1F1B (GPipe holds more for the same bubble) and, where the layers make two stages a
    rank, interleaved 1F1B (a bubble halved for more microbatches in flight), each stage sharded as torchtitan
    shards it (FSDP2 without resharding after forward) over its data- and context-parallel GPUs; their microbatches
    are chosen by the search."""
    layouts = []
    for cp in (1, *context_degrees):
        left = gpus // (tp * cp)
        if gpus % (tp * cp):
            continue
        for pp in (p for p in range(2, min(left, layers, MAX_PIPELINE_STAGES) + 1) if left % p == 0):
            zero = 0 if left // pp == 1 and cp == 1 else 2
            schedules = ("1f1b", "interleaved-1f1b") if layers >= 2 * pp else ("1f1b",)
            layouts += [
                Layout(gpus=gpus, tp=tp, pp=pp, cp=cp, pp_schedule=schedule, microbatches=pp, zero=zero)
                for schedule in schedules
            ]
    return layouts


def plan(
    model: Model,
    setup: TrainingSetup,
    gpus: int,
    cluster: Cluster,
    budget: MemoryBudget,
    global_batch: int | None = None,
    offload: bool = True,
    jobs: int = 1,
    on_progress: Callable[[str, int, int], None] = lambda what, done, total: None,
    pipeline: str = "auto",
    routing_imbalance: float = 1.0,
    exhaustive: bool = False,
) -> Plan:
    """Every candidate layout's largest fitting micro-batch and step time, fastest first. The distinct steps
    are traced first; then ``jobs`` processes search the candidates (forked, sharing the traces). ``pipeline``
    "auto" searches pipeline-parallel layouts only when no other layout fits (a pipeline stage is the costliest
    to search, and within reach of a layout without a bubble it is rarely faster). ``routing_imbalance``: the
    busiest GPU's share of the routed tokens that expert-parallel layouts of a MoE model assume. Unless
    ``exhaustive``, a layout whose throughput ceiling is below the fastest layout found is not searched
    (:func:`_search_all`)."""
    if global_batch is not None and global_batch < 1:
        raise UserError(f"--global-batch must be at least 1 (got {global_batch}).")
    if pipeline not in PIPELINE_SEARCH:
        raise UserError(f"--pipeline must be one of {', '.join(PIPELINE_SEARCH)} (got {pipeline!r}).")
    if routing_imbalance != 1 and (model.config is None or not routed_experts(model.config)):
        raise UserError("--routing-imbalance applies to the expert-parallel layouts of a MoE model; this one has none.")
    compute_dtype = str(setup.autocast_dtype or setup.param_dtype).removeprefix("torch.")
    cluster.gpu.peak_flops(compute_dtype)  # refuses bf16 on GPUs without it, before any tracing
    searched = "off" if pipeline == "auto" else pipeline
    chosen, skipped = candidates(model, setup, gpus, cluster, offload, searched, routing_imbalance)
    if not chosen:
        raise UserError(f"No layout of {gpus} GPUs applies to this model and step: " + "; ".join(skipped))
    search = _Search(model, setup, cluster, budget, global_batch, compute_dtype)
    with collector_paused():
        outcomes, slower = _search_all(search, chosen, jobs, on_progress, exhaustive)
        if pipeline == "auto" and not any(o.fits for o in outcomes):
            on_progress("nothing fits: adding pipeline-parallel layouts", 0, 0)
            piped, piped_skipped = candidates(model, setup, gpus, cluster, offload, "only")
            piped_outcomes, piped_slower = _search_all(search, piped, jobs, on_progress, exhaustive)
            outcomes += piped_outcomes
            slower |= piped_slower
            skipped += piped_skipped
        elif pipeline == "auto":
            skipped.append("pipeline parallelism: searched when no other layout fits (--pipeline on to search it)")
        if not any(o.fits for o in outcomes):
            outcomes = _replayed_where_least(search, outcomes, jobs, on_progress)
        fitting = sorted((o for o in outcomes if o.fits), key=lambda o: -o.tokens_per_second)
        failing = sorted((o for o in outcomes if not o.fits), key=lambda o: o.needed_bytes)
        result = Plan(
            model.model_id, setup, cluster, budget, gpus, global_batch, fitting + failing, skipped, slower=slower
        )
        if not fitting:
            on_progress("nothing fits: looking for the smallest change that would", 0, 0)
            result.suggestions = _suggestions(search, gpus)
    return result


def _replayed_where_least(
    search: _Search, outcomes: list[Outcome], jobs: int, on_progress: Callable[[str, int, int], None]
) -> list[Outcome]:
    """When nothing fits, the plan names the layout that needs least: the layouts known only by their floor, where it
    is below the least any replayed layout needs, are searched again with the allocator replayed."""
    least = min((o.needed_bytes for o in outcomes if not o.needed_is_floor), default=math.inf)
    again = [index for index, o in enumerate(outcomes) if o.needed_is_floor and o.needed_bytes < least]
    search.replay_ruled_out = True
    replayed = _search_candidates(search, [outcomes[index].candidate for index in again], jobs, on_progress)
    search.replay_ruled_out = False
    outcomes = list(outcomes)
    for index, outcome in zip(again, replayed, strict=True):
        outcomes[index] = outcome
    return outcomes


def _search_all(
    search: _Search,
    chosen: list[Candidate],
    jobs: int,
    on_progress: Callable[[str, int, int], None],
    exhaustive: bool,
) -> tuple[list[Outcome], dict[Candidate, float]]:
    """Each candidate's outcome, and the candidates not searched, with their ceilings.

    Unless ``exhaustive``, the search runs in rounds by throughput ceiling (:meth:`_Search.ceiling`): each round the
    candidates within ``CEILING_ROUND`` of the highest ceiling left (those without one first), until a layout fits;
    then the rest, but only those whose ceiling is above the fastest layout found (by ``AS_FAST_WITHIN``): no
    micro-batch can make the others as fast (with both checkpointing modes searched, typically every layout that
    recomputes its forward, where one that does not fits)."""
    ceilings = {} if exhaustive else _ceilings(search, chosen, jobs, on_progress)
    outcomes: list[Outcome] = []
    slower: list[Candidate] = []
    remaining = chosen
    while remaining:
        best = max((o.tokens_per_second for o in outcomes if o.fits), default=None)
        if best is None:
            top = max(ceilings.get(c, math.inf) for c in remaining)
            searched = [c for c in remaining if ceilings.get(c, math.inf) >= CEILING_ROUND * top]
        else:
            slower = [c for c in remaining if c in ceilings and ceilings[c] * (1 + AS_FAST_WITHIN) < best]
            searched = [c for c in remaining if c not in slower]
        remaining = [c for c in remaining if c not in searched and c not in slower]
        outcomes += _search_candidates(search, searched, jobs, on_progress)
    return outcomes, {c: ceilings[c] for c in slower}


def _ceilings(
    search: _Search, chosen: list[Candidate], jobs: int, on_progress: Callable[[str, int, int], None]
) -> dict[Candidate, float]:
    """The throughput ceiling of each candidate that has one, from its step's line, traced for it."""
    _trace([(search.source(c), batch) for c in chosen for batch in LINE_BATCHES], jobs, on_progress)
    ceilings = {c: search.ceiling(c) for c in chosen}
    return {c: ceiling for c, ceiling in ceilings.items() if ceiling is not None}


def _search_candidates(
    search: _Search, chosen: list[Candidate], jobs: int, on_progress: Callable[[str, int, int], None]
) -> list[Outcome]:
    """Each candidate's outcome, the steps it reads traced first."""
    if not chosen:
        return []
    _trace([pair for candidate in chosen for pair in search.traces_needed(candidate)], jobs, on_progress)
    outcomes: list[Outcome | None] = [None] * len(chosen)
    searched = _in_processes(
        lambda index: _search(search, chosen[index]), len(chosen), jobs, lambda index: search.shares(chosen[index])
    )
    on_progress("largest micro-batch of each layout", 0, len(chosen))
    for done, (index, outcome) in enumerate(searched):
        outcomes[index] = outcome
        on_progress("largest micro-batch of each layout", done + 1, len(chosen))
    return outcomes


def _trace(needed: list[tuple[StepSource, int]], jobs: int, on_progress: Callable[[str, int, int], None]) -> None:
    """Make the traces ``needed`` lacks: the plain steps' in ``jobs`` processes, and each accumulating step's
    derived from its plain step's trace in this one while they trace (as each plain trace arrives, or at once
    where it was made before)."""
    needed = [(source, batch) for source, batch in dict.fromkeys(needed) if not source.has_trace(batch)]
    pairs = list(dict.fromkeys(source.traced_from(batch) for source, batch in needed))
    pairs = [(source, batch) for source, batch in pairs if not source.has_trace(batch)]
    # the longest first (more micro-steps, then more sequences), so that no process is left with one at the end
    pairs.sort(key=lambda pair: (traced_micro_steps(pair[0].setup), pair[1]), reverse=True)
    derived: dict[tuple[StepSource, int], list[StepSource]] = {}  # a plain trace -> the sources derived from it
    for source, batch in needed:
        origin = source.traced_from(batch)
        if origin != (source, batch):
            derived.setdefault(origin, []).append(source)
    tracing = f"{len(pairs)} traces of {len({source for source, _ in pairs})} distinct steps"
    if pairs:
        on_progress(tracing, 0, len(pairs))
    made_before = [(origin, derived[origin]) for origin in derived if origin[0].has_trace(origin[1])]

    def derive_from_traces_made_before() -> None:
        for (_, batch), sources in made_before:
            for accumulating in sources:
                accumulating.trace(batch)

    traced = _in_processes(
        lambda index: pairs[index][0].trace(pairs[index][1]), len(pairs), jobs, meanwhile=derive_from_traces_made_before
    )
    for done, (index, trace) in enumerate(traced):
        source, batch = pairs[index]
        source.add_trace(batch, trace)
        for accumulating in derived.get((source, batch), ()):  # while the other processes trace
            accumulating.trace(batch)
        on_progress(tracing, done + 1, len(pairs))


def _suggestions(search: _Search, gpus: int) -> list[str]:
    """What would fit one sequence when nothing does: more GPUs under FSDP2 with checkpointing, or LoRA."""
    found = []
    recompute = Candidate(Layout(), "full")
    for more in (2 * gpus, 4 * gpus, 8 * gpus):
        layout = Layout(gpus=more, zero=3)
        steps = search.layout_estimate(search.candidate_setup(recompute), layout)
        report = steps.evaluate(1).report
        if search.budget.fits(report):
            found.append(
                f"{more} GPUs: FSDP2 with full checkpointing fits micro-batch 1 "
                f"({format_bytes(search.budget.needed_bytes(report))} per GPU; --gpus {more})"
            )
            break
    if search.setup.lora is None and not search.setup.quantize and search.model.config is not None:
        lora = dataclasses.replace(search.candidate_setup(recompute), lora=LoraSetup(r=16))
        layout = Layout(gpus=gpus)
        steps = search.layout_estimate(lora, layout)
        report = steps.evaluate(1).report
        if search.budget.fits(report):
            found.append(
                f"LoRA rank 16 with full checkpointing fits micro-batch 1 on {layout.describe()} "
                f"({format_bytes(search.budget.needed_bytes(report))} per GPU; --lora-r 16 --grad-checkpointing full)"
            )
    return found


@dataclass
class _Search:
    model: Model
    setup: TrainingSetup
    cluster: Cluster
    budget: MemoryBudget
    global_batch: int | None
    compute_dtype: str
    # replay the allocator where even a layout's floor does not fit, for the figure it needs (when nothing fits)
    replay_ruled_out: bool = False
    sources: dict[TrainingSetup, StepSource] = field(default_factory=dict)
    _rooflines: dict[StepSource, float] = field(default_factory=dict)  # seconds per sequence
    _block_rooflines: dict[StepSource, dict[str, float]] = field(default_factory=dict)  # the same, each block's

    def candidate_setup(self, candidate: Candidate) -> TrainingSetup:
        return dataclasses.replace(self.setup, grad_checkpointing=candidate.checkpointing, reentrant=False)

    def traces_needed(self, candidate: Candidate) -> list[tuple[StepSource, int]]:
        """The traces the candidate's search reads, made before it (in parallel, once for all workers): its step's
        at batch sizes 2 and 3, and when a global batch leaves its ranks more than one sequence, the accumulating
        step's at 1, 2 and 3 (the whole per-rank batch rarely fits at once)."""
        needed = [(self.source(candidate), batch) for batch in LINE_BATCHES]
        if (self.per_rank_batch(candidate.layout) or 1) > 1 and _accumulates(candidate.layout):
            accumulating = self.accumulating_estimate(self.candidate_setup(candidate), candidate.layout).source
            needed += [(accumulating, batch) for batch in (1, 2, 3)]
        return needed

    def shares(self, candidate: Candidate) -> Hashable | None:
        """What the candidate's search shares with other candidates' (None: nothing worth keeping together): the
        model-parallel slices of its step, which the first candidate to need them builds."""
        estimate = self.layout_estimate(self.candidate_setup(candidate), candidate.layout)
        prepared = estimate.prepared
        if prepared.tensor is not None:  # pipelines of any stages and microbatches cut theirs from the slice
            return id(estimate.source), prepared.tensor_slice_key(Rank())
        return (id(estimate.source), prepared.model_parallel_key(Rank())) if prepared.splits_the_model else None

    def source(self, candidate: Candidate) -> StepSource:
        """The source of the traced step the candidate's ranks are built from (a pipeline's: two accumulating
        micro-steps, which its microbatches run)."""
        return self.layout_estimate(self.candidate_setup(candidate), candidate.layout).source

    def ceiling(self, candidate: Candidate) -> float | None:
        """Tokens per second that no micro-batch, accumulation or pipeline schedule of the candidate can exceed:
        every GPU running its share of its rank's traced step's forward and backward ops at their roofline, without
        the optimizer's step, any communication or idle time (None where the step's batch sizes are not on a line).
        A pipeline's stages share out the step's ops, so its busiest rank runs at least a ``pp``-th of them for
        every sequence of its pipeline; :meth:`_pipeline_ceiling` also counts its stages' layers and its bubble."""
        source = self.source(candidate)
        line = source.line()
        if line is None:
            return None
        if source not in self._rooflines:
            self._rooflines[source] = roofline_seconds_per_sequence(
                line.one, line.two, self.cluster.gpu, self.compute_dtype
            )
        if not self._rooflines[source]:
            return None
        layout = candidate.layout
        ceiling = layout.dp * layout.tp * layout.pp * self.setup.seq_len / self._rooflines[source]
        return ceiling if layout.pp == 1 else min(ceiling, self._pipeline_ceiling(source, layout) or ceiling)

    def _pipeline_ceiling(self, source: StepSource, layout: Layout) -> float | None:
        """A pipeline's ceiling from the layers each of its ranks runs (its stages' blocks, at their roofline per
        sequence; the embedding, the head and the parameter-free modules left out). Every schedule searched starts a
        rank with the first microbatch's forward through its first stage and ends it with the last microbatch's
        backward through it (``schedule_actions``): the rank cannot start before that forward has passed the stages
        before it, and that backward still has to pass back through them, so the step takes at least the layers
        before it once plus its own layers for every microbatch. That bound per sequence falls as the microbatches
        grow, and a pipeline runs at most its per-replica batch of them (with a global batch; else as many as it
        likes). None for a model without decoder blocks."""
        line = source.line()
        structure = line.one.structure
        if not structure.blocks:
            return None
        if source not in self._block_rooflines:
            self._block_rooflines[source] = block_roofline_seconds_per_sequence(
                line.one, line.two, self.cluster.gpu, self.compute_dtype
            )
        blocks = self._block_rooflines[source]
        stages = [
            sum(blocks[structure.blocks[layer]] for layer in layers)
            for layers in layer_split(len(structure.blocks), layout.pp * layout.stages_per_rank, layout.pp_split)
        ]
        microbatches = self.per_rank_batch(layout)
        busiest = 0.0  # seconds per sequence of each microbatch
        for rank in range(layout.pp):
            own = rank_stages(layout.pp, rank, layout.stages_per_rank)
            seconds = sum(stages[stage] for stage in own)
            if microbatches is not None:
                seconds += sum(stages[: own[0]]) / microbatches
            busiest = max(busiest, seconds)
        return layout.dp * layout.tp * self.setup.seq_len / busiest if busiest else None

    def per_rank_batch(self, layout: Layout) -> int | None:
        """Sequences of the global batch each data-parallel rank runs per step (None: no global batch, or it
        does not split evenly)."""
        if self.global_batch is None or self.global_batch % layout.dp:
            return None
        return self.global_batch // layout.dp

    def accumulating_estimate(self, candidate_setup: TrainingSetup, layout: Layout) -> LayoutEstimate:
        """The step of two accumulating micro-steps, whose memory stands for any number of them."""
        return self.layout_estimate(dataclasses.replace(candidate_setup, grad_accum=2), layout)

    def layout_estimate(self, candidate_setup: TrainingSetup, layout: Layout) -> LayoutEstimate:
        """The candidate's estimate over the step source its traced setup shares with other candidates."""
        prepared = prepare(layout, candidate_setup, self.model.config)
        traced = prepared.traced
        return LayoutEstimate(
            self.model.model_id, prepared, self._source(traced), dominant=True, capacity=self._allocator_capacity
        )

    @cached_property
    def _allocator_capacity(self) -> int | None:
        """Where the replayed allocator's ``cudaMalloc`` fails and it releases its cache (None: on CPU, never)."""
        if self.setup.target is not Target.CUDA:
            return None
        return self.budget.allocator_capacity(find_gpu(self.setup.gpu).context_bytes)

    def _source(self, traced: TrainingSetup) -> StepSource:
        """The source of a traced setup's steps, shared by every candidate that traces it; an accumulating step
        is derived from its plain step's source."""
        key = dataclasses.replace(traced, batch_size=1, grad_accum=traced_micro_steps(traced))
        if key not in self.sources:
            plain = self._source(dataclasses.replace(key, grad_accum=1)) if may_derive_accumulation(key) else None
            self.sources[key] = StepSource(self.model, key, lines=True, plain=plain)
        return self.sources[key]


def _in_processes(
    work: Callable[[int], T],
    count: int,
    jobs: int,
    together: Callable[[int], Hashable | None] = lambda index: None,
    meanwhile: Callable[[], None] = lambda: None,
) -> Iterator[tuple[int, T]]:
    """``(index, work(index))`` for every index below ``count``, in the order they finish, computed by up to
    ``jobs`` forked processes, which inherit everything ``work`` reads (the traces); only results travel back.
    ``meanwhile`` runs here once they have started (before the work, without them).

    Indices with the same ``together`` key (None: none) run in one process, one after another: they share what the
    first of them builds (a tensor-parallel slice of a step), which another process would build again. Each process
    takes the next group when it is done with one: the largest groups first, then the indices without a key."""
    context = multiprocessing.get_context("fork") if "fork" in multiprocessing.get_all_start_methods() else None
    if jobs <= 1 or count < 1 or context is None or not _autograd_forks(context):
        meanwhile()
        yield from ((index, work(index)) for index in range(count))
        return
    shared: dict[Hashable, list[int]] = {}
    alone: list[list[int]] = []
    for index in range(count):
        key = together(index)
        if key is None:
            alone.append([index])
        else:
            shared.setdefault(key, []).append(index)
    global _FORKED_WORK
    _FORKED_WORK = work
    tasks, results = context.SimpleQueue(), context.Queue()
    # what a group shares costs its first index most (a tensor-parallel slice): every group before the lone indices
    groups = sorted(shared.values(), key=len, reverse=True) + alone
    for group in groups:
        tasks.put(group)
    workers = [context.Process(target=_run_forked, args=(tasks, results)) for _ in range(min(jobs, len(groups)))]
    for _ in workers:
        tasks.put(None)
    try:
        for worker in workers:
            worker.start()
        meanwhile()
        for _ in range(count):
            index, failure, result = _next_result(results, workers)
            if failure is not None:
                raise failure
            yield index, result
    finally:
        _FORKED_WORK = None
        for worker in workers:
            worker.kill()
            worker.join()


_FORKED_WORK: Callable[[int], object] | None = None  # what forked workers run
_AUTOGRAD_FORKS = True  # False once a forked process could not run autograd: it never can again


def _autograd_forks(context) -> bool:
    """Whether a process forked now can run a backward (a trace does). Once this process's autograd engine has
    started device threads (at its first backward where torch sees a GPU), torch makes every process it forks refuse
    autograd (``in_bad_autograd_fork``, torch/csrc/autograd/engine.cpp): the work then runs here, one at a time."""
    global _AUTOGRAD_FORKS
    if _AUTOGRAD_FORKS:
        probe = context.Process(target=_backward_once)
        probe.start()
        probe.join()
        _AUTOGRAD_FORKS = probe.exitcode == 0
    return _AUTOGRAD_FORKS


def _backward_once() -> None:
    try:
        torch.ones((), requires_grad=True).backward()
    except RuntimeError:
        os._exit(1)


def _run_forked(tasks, results) -> None:
    """A worker: each group of indices it takes, one result at a time, a failure in place of a result. Ctrl-C is
    the parent's to handle: it stops the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while (group := tasks.get()) is not None:
        for index in group:
            try:
                results.put((index, None, _FORKED_WORK(index)))
            except Exception as error:  # travels to the parent, which raises it
                results.put((index, error if _picklable(error) else RuntimeError(repr(error)), None))
                return


def _picklable(error: Exception) -> bool:
    try:
        pickle.dumps(error)
    except Exception:
        return False
    return True


def _next_result(results, workers: list) -> tuple[int, Exception | None, object]:
    """The next result any worker sends; a worker that died without sending one fails the search."""
    while True:
        try:
            return results.get(timeout=1)
        except queue.Empty:
            dead = [worker.exitcode for worker in workers if worker.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a search process died (exit code {dead[0]}); retry with --jobs 1") from None


def _search(search: _Search, candidate: Candidate) -> Outcome:
    """The candidate's largest micro-batch that fits (a divisor of the per-rank batch with --global-batch),
    its gradient accumulation, memory and step time."""
    layout = candidate.layout
    outcome = Outcome(candidate)
    per_rank = search.per_rank_batch(layout)
    if search.global_batch is not None and per_rank is None:
        outcome.notes.append(f"global batch {search.global_batch} does not split over {layout.dp} data-parallel ranks")
        return outcome
    if layout.pp > 1:
        return _search_pipeline(search, candidate, per_rank)
    candidate_setup = search.candidate_setup(candidate)
    steps = search.layout_estimate(candidate_setup, layout)
    if per_rank is None:
        largest = _largest_fitting(steps, search.budget, MAX_MICRO_BATCH, search.replay_ruled_out)
        accumulation = 1
    else:
        largest, accumulation, steps = _largest_divisor_fitting(search, candidate_setup, layout, steps, per_rank)
    micro = largest.size
    if micro == 0:
        _needs(outcome, largest)
        if accumulation > 1:
            outcome.notes.append(f"at micro-batch 1 with {accumulation} accumulation steps")
        elif not _accumulates(layout) and per_rank is not None and per_rank > 1:
            outcome.notes.append("the per-rank batch in one micro-step: expert parallelism does not accumulate yet")
        return outcome
    estimate = steps.evaluate(micro)
    outcome.micro_batch, outcome.accumulation = micro, accumulation
    outcome.report = _with_accumulation(estimate.report, accumulation)
    outcome.needed_bytes = search.budget.needed_bytes(estimate.report)
    outcome.time = step_time(estimate.step, layout, search.cluster, search.compute_dtype, accumulation)
    tokens = micro * accumulation * layout.dp * search.setup.seq_len
    outcome.tokens_per_second = tokens / outcome.time.total_s
    return outcome


def _search_pipeline(search: _Search, candidate: Candidate, per_rank: int | None) -> Outcome:
    """A pipeline's microbatches are its accumulation. Without a global batch it runs
    ``MICROBATCHES_PER_STAGE`` per stage, of the largest size that fits; with one, each size dividing the
    per-rank batch into at least as many microbatches as stages (1F1B's least) and at most
    ``MICROBATCHES_PER_STAGE`` per stage (or the fewest there are) is tried, smallest first, and the fastest
    that fits is kept (fewer, larger microbatches leave a larger bubble)."""
    layout, outcome = candidate.layout, Outcome(candidate)
    candidate_setup = search.candidate_setup(candidate)
    if per_rank is None:
        microbatches = MICROBATCHES_PER_STAGE * layout.pp
        steps = search.layout_estimate(candidate_setup, dataclasses.replace(layout, microbatches=microbatches))
        largest = _largest_fitting(steps, search.budget, MAX_MICRO_BATCH, search.replay_ruled_out)
        if largest.size == 0:
            _needs(outcome, largest)
            return outcome
        options = [(largest.size, microbatches, steps, largest.report)]
    else:
        takes = [m for m in range(layout.pp, per_rank + 1) if schedule_takes(layout.pp_schedule, layout.pp, m)]
        counts = [m for m in takes if per_rank % m == 0]
        if not counts:
            outcome.notes.append(f"the global batch gives each pipeline fewer than {layout.pp} sequences")
            return outcome
        counts = [m for m in counts if m <= MICROBATCHES_PER_STAGE * layout.pp] or counts[:1]
        options = []
        for microbatches in sorted(counts, reverse=True):  # smallest microbatches first: memory grows with them
            micro = per_rank // microbatches
            steps = search.layout_estimate(candidate_setup, dataclasses.replace(layout, microbatches=microbatches))
            largest = _largest_fitting_of(steps, search.budget, [micro], search.replay_ruled_out and not options)
            if largest.size == 0:
                if not options:
                    outcome.candidate = Candidate(steps.prepared.layout, candidate.checkpointing)
                    _needs(outcome, largest)
                    outcome.accumulation = microbatches
                break
            options.append((micro, microbatches, steps, largest.report))
        if not options:
            return outcome
    for micro, microbatches, steps, report in options:
        traced = {rank.pp: steps.rank_step(rank, micro) for rank in steps.ranks}
        # a stage not searched stands behind stage 1, which runs as many layers or more
        stages = [traced.get(stage, traced.get(1)) for stage in range(layout.pp)]
        time = pipeline_step_time(stages, steps.prepared.layout, search.cluster, search.compute_dtype)
        tokens_per_second = micro * microbatches * layout.dp * search.setup.seq_len / time.total_s
        if tokens_per_second > outcome.tokens_per_second:
            outcome.candidate = Candidate(steps.prepared.layout, candidate.checkpointing)
            outcome.micro_batch, outcome.accumulation, outcome.time = micro, microbatches, time
            outcome.tokens_per_second = tokens_per_second
            outcome.report, outcome.needed_bytes = report, search.budget.needed_bytes(report)
    return outcome


def _largest_divisor_fitting(
    search: _Search, candidate_setup: TrainingSetup, layout: Layout, whole: LayoutEstimate, per_rank: int
) -> tuple[Largest, int, LayoutEstimate]:
    """The largest micro-batch dividing ``per_rank`` that fits (or what micro-batch 1 needs, if none does), its
    accumulation and the estimate it was read from.

    The whole per-rank batch in one micro-step is tried first; otherwise the micro-steps accumulate (where the
    layout can), whose gradients outlive each backward, so memory only grows: the proper divisors are searched on
    the step of two micro-steps (which stands for any number of them)."""
    alone = per_rank == 1 or not _accumulates(layout)
    largest = _largest_fitting_of(whole, search.budget, [per_rank], search.replay_ruled_out and alone)
    if largest.size or alone:
        return largest, 1, whole
    accumulating = search.accumulating_estimate(candidate_setup, layout)
    divisors = [d for d in range(1, per_rank) if per_rank % d == 0]
    largest = _largest_fitting_of(accumulating, search.budget, divisors, search.replay_ruled_out)
    return largest, (per_rank // largest.size if largest.size else per_rank), accumulating


def _accumulates(layout: Layout) -> bool:
    """Whether the layout's micro-steps can accumulate: not a pipeline's (its microbatches are its accumulation),
    nor expert parallelism's (``prepare`` refuses --grad-accum with it: not checked against a runtime yet)."""
    return layout.pp == 1 and layout.ep == 1


class Largest(NamedTuple):
    """The largest size that fits and its report; where none does (``size`` 0), what the smallest needs: its
    report's figure, or only its floor (``report`` None), which already rules it out."""

    size: int
    report: MemoryReport | None
    needed_bytes: int
    needed_at: int


def _needs(outcome: Outcome, largest: Largest) -> None:
    """What a layout that fits no size needs, and at which."""
    outcome.report, outcome.needed_bytes, outcome.needed_at = largest.report, largest.needed_bytes, largest.needed_at
    outcome.needed_is_floor = largest.report is None


def _largest_fitting(steps: LayoutEstimate, budget: MemoryBudget, cap: int, replay_ruled_out: bool) -> Largest:
    """The largest batch up to ``cap`` that fits."""
    return _largest_fitting_of(steps, budget, range(1, cap + 1), replay_ruled_out)


def _largest_fitting_of(
    steps: LayoutEstimate, budget: MemoryBudget, sizes: Sequence[int], replay_ruled_out: bool
) -> Largest:
    """The largest of ``sizes`` (ascending) that fits; if none does, what the smallest needs: its report's figure, or
    with ``replay_ruled_out`` False and the smallest's floor over the budget, that floor (no replay, no report).

    Memory grows with the batch. The allocated peak plus the CUDA context (``needed_floor``, no allocator
    replay) is at most what a report needs, so the search runs on it first: the largest size whose floor fits
    bounds the answer. Only then is the allocator replayed, at that size and, while it does not fit, at the
    largest smaller size whose floor leaves room for the slack the last replay found; the sizes between the one
    that fits and the smallest that does not are then bisected, the slack not being the same at every size; the
    smallest size is replayed before none is said to fit, a larger size's slack being no bound on a smaller one's."""
    floors: dict[int, int] = {}

    def floor(position: int) -> int:
        if position not in floors:
            floors[position] = steps.needed_floor(sizes[position])
        return floors[position]

    def largest_within(limit: int, below: int) -> int:
        """The largest position under ``below`` whose floor is at most ``limit`` (-1 if none)."""
        low, high, found = 0, below - 1, -1
        while low <= high:
            middle = (low + high) // 2
            if floor(middle) <= limit:
                found, low = middle, middle + 1
            else:
                high = middle - 1
        return found

    position = bad = largest_within(budget.usable_bytes, len(sizes))
    if position < 0 and not replay_ruled_out:
        return Largest(0, None, floor(0), sizes[0])
    bad += 1  # the smallest position known not to fit
    report = None
    while position >= 0:
        report = steps.evaluate(sizes[position]).report
        if budget.fits(report):
            break
        bad, slack = position, budget.needed_bytes(report) - floor(position)
        # the smallest size is tried whatever the slack: where the allocated peak is the optimizer step's, the floor
        # is flat and a large batch's cached activation segments leave it far more slack than a small batch's
        position = max(largest_within(budget.usable_bytes - slack, position), 0) if position else -1
    else:
        report = report if report is not None else steps.evaluate(sizes[0]).report
        return Largest(0, report, budget.needed_bytes(report), sizes[0])
    while bad - position > 1:  # the allocator's slack varies from size to size: close in on the edge
        middle = (position + bad) // 2
        middle_report = steps.evaluate(sizes[middle]).report
        if budget.fits(middle_report):
            position, report = middle, middle_report
        else:
            bad = middle
    return Largest(sizes[position], report, budget.needed_bytes(report), sizes[position])


def _with_accumulation(report: MemoryReport, accumulation: int) -> MemoryReport:
    """The report of two traced micro-steps, which stand for any number of them, saying how many there are."""
    if report.setup.grad_accum == accumulation:
        return report
    setup = dataclasses.replace(report.setup, grad_accum=accumulation)
    copy = dataclasses.replace(report, setup=setup)
    copy.ranks = [copy if rank is report else dataclasses.replace(rank, setup=setup) for rank in report.ranks]
    return copy
