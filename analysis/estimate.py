"""The one estimate pipeline: prepare the layout, trace the single-GPU step it needs, transform that step for
each distinct rank, and read each rank's peak off its step. ``analyze``, ``plan``, ``sweep``, ``compare`` and
``timeline`` all go through it.

A :class:`StepSource` holds the traces of one step at any batch size; a :class:`LayoutEstimate` the ranks of
one prepared layout over such a source. ``estimate`` traces the batch size asked for; the planner and sweeps
ask the source for a batch line (analysis/batch_line.py), so that a batch size costs a resize, not a trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

from analysis.allocator import AllocatorConfig, OutOfMemory
from analysis.batch_line import BatchLine, BatchShapeError
from analysis.cudagraphs import compiled_decode
from analysis.peak import PeakLine, Timeline, find_peak, timeline
from analysis.replay import replay_step
from analysis.report import MemoryReport, build_report
from strategies.layout import Layout, PreparedLayout, Rank, prepare
from strategies.tensor_parallel import foreach_refuses_mixed_parameters
from tracer.gpus import find_gpu
from tracer.gradient_sums import as_run
from tracer.graph import StepGraph, build_graph
from tracer.resolve import Model, as_model
from tracer.trace import Trace
from tracer.tracing import Progress, accumulating_step, trace_step
from tracer.training import Target, TrainingSetup

SINGLE_GPU = Layout()
T = TypeVar("T")
SHARED_STEPS = 8  # transformed steps a source keeps for layouts that share them


@dataclass(frozen=True)
class StepResult:
    """A report with the step it was read from: an estimated rank's step after the layout's transforms, or
    a measured step (on CPU, every storage's real lifetime)."""

    report: MemoryReport
    step: StepGraph
    line: Timeline  # live bytes per category at every op (on CUDA estimates, as the allocator counts them)


def analyze(
    model: str | Model,
    setup: TrainingSetup,
    layout: Layout = SINGLE_GPU,
    progress: Progress | None = None,
    capacity: int | None = None,
) -> MemoryReport:
    """Predicted peak allocated GPU memory of one steady-state training step, on the most loaded GPU.

    On CUDA the allocations are replayed through the caching allocator model: its allocated bytes (whole
    blocks) are the peak, and its reserved bytes plus the CUDA context what ``nvidia-smi`` shows. ``capacity``:
    what ``cudaMalloc`` can reserve before it fails (:meth:`MemoryBudget.allocator_capacity`), where the allocator
    releases its cached segments and retries; None: it never fails."""
    return estimate(model, setup, layout, progress, capacity).report


def estimate(
    model: str | Model,
    setup: TrainingSetup,
    layout: Layout = SINGLE_GPU,
    progress: Progress | None = None,
    capacity: int | None = None,
) -> StepResult:
    """:func:`analyze`, keeping the busiest rank's step and timeline (for timelines and per-module tables)."""
    model = as_model(model)
    prepared = prepare(layout, setup, model.config)
    source = StepSource(model, prepared.traced, progress)
    return LayoutEstimate(model.model_id, prepared, source, capacity=capacity).evaluate(setup.batch_size, progress)


class StepSource:
    """The traced single-GPU step of one setup at any batch size, each traced when first asked for. With
    ``lines``, a batch size from 2 on is a point on the line through the steps at batches 2 and 3."""

    LINE_FIRST = 2  # batch 1 is off the line (analysis/batch_line.py)

    def __init__(
        self,
        model: Model,
        setup: TrainingSetup,
        progress: Progress | None = None,
        lines: bool = False,
        plain: StepSource | None = None,
    ) -> None:
        """``plain``: the same step without gradient accumulation, whose traces this accumulating step's are
        derived from (tracer/accumulation.py) rather than traced."""
        self.model, self.setup, self.progress, self.lines, self.plain = model, setup, progress, lines, plain
        self._traces: dict[int, Trace] = {}
        self._steps: dict[int, StepGraph] = {}
        self._line: BatchLine | None = None
        self._shared: dict[Hashable, object] = {}

    def trace(self, batch: int) -> Trace:
        if batch not in self._traces:
            self._traces[batch] = self._made(dataclasses.replace(self.setup, batch_size=batch))
        return self._traces[batch]

    def _made(self, setup: TrainingSetup) -> Trace:
        if self.plain is not None:
            return accumulating_step(self.model, setup, self.plain.trace(setup.batch_size), self.progress)
        return trace_step(self.model, setup, self.progress)

    def traced_from(self, batch: int) -> tuple[StepSource, int]:
        """The source and batch size whose trace gives this source's at ``batch``: its own, or the plain step's
        it is derived from."""
        return (self, batch) if self.plain is None else (self.plain, batch)

    def has_trace(self, batch: int) -> bool:
        return batch in self._traces

    def add_trace(self, batch: int, trace: Trace) -> None:
        """A trace made elsewhere (the planner traces in worker processes)."""
        self._traces[batch] = trace

    def some_batch(self) -> int:
        """A batch size already traced (the setup's own if none is): for what does not depend on the batch
        (assumptions, counts, which ranks differ)."""
        return next(iter(self._traces), self.setup.batch_size)

    def traced_step(self, batch: int) -> StepGraph:
        if batch not in self._steps:
            self._steps[batch] = build_graph(as_run(self.trace(batch), self.setup))
        return self._steps[batch]

    def step(self, batch: int) -> StepGraph:
        line = self.line() if self.lines and batch >= self.LINE_FIRST else None
        return line.at(batch) if line is not None else self.traced_step(batch)

    def shared(self, key: Hashable, build: Callable[[], T]) -> T:
        """A transformed step (or a line of them) that layouts of this source share (the same tensor-parallel
        slice under different data parallelism, as the planner tries them one after another), kept for the last
        few keys."""
        if key in self._shared:
            self._shared[key] = self._shared.pop(key)  # most recently used last
        else:
            self._shared[key] = build()
            while len(self._shared) > SHARED_STEPS:
                del self._shared[next(iter(self._shared))]
        return self._shared[key]

    def keep_line_if_it_reaches(self, batch: int) -> None:
        """Trace ``batch`` and read every batch size off the line only if the line reproduces that step: a kernel
        that switches with the batch (bitsandbytes' 4-bit decode matmul above 4 rows) changes more than sizes
        between the traced points and ``batch``; then every batch size is traced."""
        line = self.line() if self.lines and batch > self.LINE_FIRST + 1 else None
        if line is None:
            return
        reached, traced = line.at(batch), self.traced_step(batch)
        if (reached.ops, reached.storages, reached.transfers) != (traced.ops, traced.storages, traced.transfers):
            self.lines = False

    def line(self) -> BatchLine | None:
        """None if the steps at batch 2 and 3 differ in more than sizes: then every batch is traced."""
        if self._line is None:
            try:
                first = self.LINE_FIRST
                self._line = BatchLine(self.traced_step(first), self.traced_step(first + 1), first=first)
            except BatchShapeError:
                return None
        return self._line


class LayoutEstimate:
    """One prepared layout's rank steps and reports at any batch size of its source. With a source that draws
    lines, a batch size costs a resize, a timeline and an allocator replay: the model-parallel steps at batches 2
    and 3 give a line, and the data-parallel runtime, which changes nothing the batch flows through, rewrites
    the step once."""

    def __init__(
        self,
        model_id: str,
        prepared: PreparedLayout,
        source: StepSource,
        dominant: bool = False,
        capacity: int | None = None,
    ) -> None:
        """``dominant``: only the ranks no other holds more than (a pipeline's dominant stages), for a search that
        reads the busiest rank. ``capacity``: where each rank's ``cudaMalloc`` fails (:func:`rank_estimate`)."""
        self.model_id, self.prepared, self.source, self.dominant = model_id, prepared, source, dominant
        self.capacity = capacity
        self._parts: dict[Rank, tuple[StepGraph, BatchLine] | None] = {}
        self._off_line: dict[tuple[Rank, int], StepGraph] = {}  # the last rank steps made off the line (batch 1)
        self._peak_lines: dict[Rank, PeakLine] = {}
        self._results: dict[int, StepResult] = {}

    @cached_property
    def trace(self) -> Trace:
        """A trace of the step with the layout's assumptions: what the reports share whatever the batch."""
        trace = self.source.trace(self.source.some_batch())
        return dataclasses.replace(trace, assumptions=trace.assumptions | self.prepared.assumptions)

    @cached_property
    def ranks(self) -> list[Rank]:
        return self.prepared.ranks(self.source.traced_step(self.source.some_batch()), self.dominant)

    def rank_step(self, rank: Rank, batch: int) -> StepGraph:
        if self.source.lines and batch >= StepSource.LINE_FIRST and self.source.line() is not None:
            parts = self._line_parts(rank)
            if parts is not None:
                base, line = parts
                return line.at(batch) if base is line.one else line.onto(base, batch)
        if (rank, batch) not in self._off_line:  # a search reads a batch size's floor, then its report
            if len(self._off_line) >= len(self.ranks):
                self._off_line.clear()
            self._off_line[rank, batch] = self._transformed(rank, batch)
        return self._off_line[rank, batch]

    def _line_parts(self, rank: Rank) -> tuple[StepGraph, BatchLine] | None:
        """The rank's step at 2 and the line its sizes follow: the model-parallel steps' line (shared by the
        layouts that split the model alike) and the data-parallel runtime's rewrite of its first step, made once;
        else the line through the rank's whole steps at 2 and 3; None when the steps differ in more than sizes."""
        if rank in self._parts:
            return self._parts[rank]
        line, parts = self._model_parallel_line(rank), None
        if line is not None and self.prepared.data is None:
            parts = (line.one, line)
        elif line is not None:
            rewritten = self.prepared.data_parallel_step(line.one, rank)
            if line.carries(rewritten):
                parts = (rewritten, line)
        if parts is None:
            try:
                whole = BatchLine(self._transformed(rank, 2), self._transformed(rank, 3), first=2)
                parts = (whole.one, whole)
            except BatchShapeError:
                pass
        self._parts[rank] = parts
        return parts

    def _model_parallel_line(self, rank: Rank) -> BatchLine | None:
        prepared = self.prepared
        if not prepared.splits_the_model:
            return self.source.line()

        def build() -> BatchLine | None:
            try:
                return BatchLine(self._model_parallel(rank, 2), self._model_parallel(rank, 3), first=2)
            except BatchShapeError:
                return None

        return self.source.shared(("line", prepared.model_parallel_key(rank)), build)

    def _model_parallel(self, rank: Rank, batch: int) -> StepGraph:
        prepared, source = self.prepared, self.source
        key = (batch, prepared.model_parallel_key(rank))

        def build() -> StepGraph:
            step = source.step(batch)
            sliced = None
            if prepared.pipeline is not None and prepared.tensor is not None:  # pipelines cut their stages from it
                slice_key = (batch, "slice", prepared.tensor_slice_key(rank))
                sliced = source.shared(slice_key, lambda: prepared.tensor_slice(step, rank))
            return prepared.model_parallel_step(step, rank, sliced)

        return source.shared(key, build)

    def _transformed(self, rank: Rank, batch: int) -> StepGraph:
        return self.prepared.data_parallel_step(self._model_parallel(rank, batch), rank)

    def needed_floor(self, batch: int) -> int:
        """At most what :class:`MemoryBudget` reads off :meth:`evaluate`'s report at ``batch`` (the busiest rank's
        allocated peak, plus the CUDA context on CUDA), without the allocator's replay: enough to rule a batch
        size out, at a fraction of the cost."""
        peak = max(self._allocated_peak(rank, batch) for rank in self.ranks)
        setup = self.prepared.setup
        return peak + (find_gpu(setup.gpu).context_bytes if setup.target is Target.CUDA else 0)

    def _allocated_peak(self, rank: Rank, batch: int) -> int:
        """The rank's allocated peak at ``batch``: off its lifetimes with the line's sizes, without building the
        step, where the batch is on a line."""
        on_line = self.source.lines and batch >= StepSource.LINE_FIRST and self.source.line()
        parts = self._line_parts(rank) if on_line else None
        if parts is None:
            return find_peak(timeline(self.rank_step(rank, batch))).bytes
        if rank not in self._peak_lines:
            base, line = parts
            self._peak_lines[rank] = PeakLine.of(base, line.slopes(), line.first)
        return self._peak_lines[rank].peak(batch)

    def evaluate(self, batch: int, progress: Progress | None = None) -> StepResult:
        """The busiest rank's result at ``batch``, carrying every distinct rank's report."""
        if batch not in self._results:
            setup = dataclasses.replace(self.prepared.setup, batch_size=batch)
            estimates = []
            for done, rank in enumerate(self.ranks):
                if progress is not None:
                    progress("each rank's step and peak", done, len(self.ranks))
                step = self.rank_step(rank, batch)
                estimates.append(
                    rank_estimate(self.model_id, setup, self.prepared.layout, self.trace, rank, step, self.capacity)
                )
            self._results[batch] = busiest(estimates, self.prepared.layout)
        return self._results[batch]


def rank_estimate(
    model_id: str,
    setup: TrainingSetup,
    layout: Layout,
    trace: Trace,
    rank: Rank,
    rank_step: StepGraph,
    capacity: int | None = None,
) -> StepResult:
    """The report of one rank from its step: its timeline, and on CUDA the caching allocator's replay. With a
    ``capacity``, a ``cudaMalloc`` that would reserve more fails, and the allocator releases its cached segments and
    retries, as PyTorch's does; where even that fails, the step does not fit, and the replay without a capacity
    says how much it would need."""
    line = timeline(rank_step)
    replay = None
    if setup.target is Target.CUDA:
        compiled = compiled_decode(setup, find_gpu(setup.gpu), trace.structure.model_class)
        try:
            replay = replay_step(rank_step, allocator_config(setup, capacity), compiled=compiled)
        except OutOfMemory:
            replay = replay_step(rank_step, allocator_config(setup), compiled=compiled)
        line = line.with_allocator_slack(replay.allocated_at)
    report = build_report(model_id, setup, trace, rank_step, line, find_peak(line), layout, rank)
    if replay is not None:
        report.set_device_memory(replay.peak_reserved, find_gpu(setup.gpu).context_bytes)
        report.allocator_retries = replay.retries
    refused = foreach_refuses_mixed_parameters(setup, layout)
    if refused:
        report.extra["optimizer_runtime"] = refused
    return StepResult(report, rank_step, line)


def busiest(estimates: list[StepResult], layout: Layout) -> StepResult:
    """The rank with the highest peak, carrying every rank's report when there are several."""
    top = max(estimates, key=lambda estimate: estimate.report.peak_bytes)
    if not layout.plain:
        top.report.ranks = [estimate.report for estimate in estimates]
    return top


def allocator_config(setup: TrainingSetup, capacity: int | None = None) -> AllocatorConfig:
    return AllocatorConfig(expandable_segments=setup.expandable_segments, capacity=capacity)
