"""The planner: the batch line against fresh traces, its chosen batch against analyze, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
from tiny_models import tiny_model

from analysis.batch_line import BatchLine
from analysis.budget import MemoryBudget
from analysis.cli import main
from analysis.estimate import LayoutEstimate, StepSource, analyze
from analysis.peak import find_peak, timeline
from analysis.plan import AS_FAST_WITHIN, Candidate, _in_processes, _largest_fitting, _Search, candidates, plan
from analysis.plan_render import render_plan
from analysis.report import MemoryReport
from analysis.steptime import Cluster, schedule_makespan, step_time
from analysis.sweep import run_sweep
from strategies.layout import Layout, Rank, prepare
from tracer import tracing
from tracer.gpus import CUDA_CONTEXT_BYTES, find_gpu
from tracer.gradient_sums import as_run
from tracer.graph import build_graph
from tracer.roles import Phase
from tracer.tracing import trace_step
from tracer.training import TrainingSetup

SETUP = TrainingSetup(seq_len=64, dtype="bf16")
LAYOUTS = (Layout(gpus=4), Layout(gpus=4, zero=3), Layout(gpus=4, zero=2, engine="deepspeed"), Layout(gpus=4, tp=2))


MIB = 1024**2


def _beyond_context(nbytes: int) -> int:
    """A GPU's memory sized by what it leaves beyond the CUDA context, which is what the planner's tests size."""
    return CUDA_CONTEXT_BYTES + nbytes


def _step(model, setup: TrainingSetup, batch: int):
    setup = dataclasses.replace(setup, batch_size=batch)
    return build_graph(as_run(trace_step(model, setup), setup))


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("checkpointing", [None, "full"])
def test_batch_line_equals_fresh_traces(family, checkpointing):
    """The planner's batch sizes come off the line through batches 2 and 3: at 5 and 8 every storage, op and
    transfer equals a fresh trace's, single-GPU and for each rank of each layout."""
    model = tiny_model(family)
    setup = dataclasses.replace(SETUP, grad_checkpointing=checkpointing)
    steps = {batch: _step(model, setup, batch) for batch in (2, 3, 5, 8)}
    line = BatchLine(steps[2], steps[3])
    for batch in (5, 8):
        got = line.at(batch)
        assert (got.ops, got.storages) == (steps[batch].ops, steps[batch].storages)
    for layout in LAYOUTS:
        if layout.tp > 1 and family == "gpt2":
            continue  # no tensor-parallel plan in transformers
        prepared = prepare(layout, setup, model.config)
        for rank in prepared.ranks(steps[2]):
            ranked = {b: prepared.rank_step(steps[b], rank) for b in steps}
            rank_line = BatchLine(ranked[2], ranked[3])
            for batch in (5, 8):
                got, fresh = rank_line.at(batch), ranked[batch]
                assert (got.ops, got.storages, got.transfers) == (fresh.ops, fresh.storages, fresh.transfers)


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        (Layout(gpus=4), {"grad_accum": 2}),
        (Layout(gpus=4, zero=1), {}),
        (Layout(gpus=4, zero=3), {"mixed_precision": "bf16", "grad_checkpointing": "full"}),
        (Layout(gpus=4, zero=2), {"grad_accum": 2}),
        (Layout(gpus=4, zero=3, offload="optimizer,params"), {}),
        (Layout(gpus=4, zero=3, engine="deepspeed"), {"mixed_precision": "bf16"}),
        (Layout(gpus=4, zero=2, engine="deepspeed", offload="optimizer"), {"grad_accum": 2}),
        (Layout(gpus=8, tp=2, zero=3), {}),
        (Layout(gpus=8, pp=2, zero=3, microbatches=2), {"mixed_precision": "bf16"}),
    ],
    ids=lambda value: value.describe() if isinstance(value, Layout) else str(value),
)
def test_data_parallel_rewrite_carries_the_line(layout, options):
    """The planner rewrites each rank's model-parallel step for its data-parallel runtime once, at batch 2, and
    carries the batch line onto it: at 5 and 8 every op, storage, transfer and collective equals the rank's step
    transformed from a fresh trace at that batch."""
    model = tiny_model("llama")
    setup = dataclasses.replace(SETUP, **({"dtype": "fp32"} | options))
    prepared = prepare(layout, setup, model.config)
    source = StepSource(model, prepared.traced, lines=True)
    estimate = LayoutEstimate(model.model_id, prepared, source)
    context = find_gpu(setup.gpu).context_bytes
    for batch in (5, 8):
        peaks = []
        for rank in estimate.ranks:
            got = estimate.rank_step(rank, batch)
            fresh = prepared.rank_step(_step(model, prepared.traced, batch), rank)
            assert got.rewritten_ops is not None  # carried, not a line through two rewrites
            assert (got.ops, got.storages) == (fresh.ops, fresh.storages)
            assert (got.transfers, got.collectives) == (fresh.transfers, fresh.collectives)
            peaks.append(find_peak(timeline(fresh)).bytes)
        assert estimate.needed_floor(batch) == max(peaks) + context  # the sizes' line, no step built


@pytest.mark.slow
def _analyze(budget: MemoryBudget, model, setup: TrainingSetup, layout: Layout) -> MemoryReport:
    """``analyze`` as the planner runs it (and the command line): the allocator's cudaMalloc fails where the budget
    ends, and there it releases its cache and retries."""
    return analyze(model, setup, layout, capacity=budget.allocator_capacity(find_gpu(setup.gpu).context_bytes))


def test_chosen_batch_is_the_largest_that_fits_by_analyze():
    """For every layout the planner keeps, ``analyze`` at its micro-batch fits the budget and at one more
    does not (or the micro-batch is the per-rank share of the global batch)."""
    model = tiny_model("llama")
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(112 * MIB))
    budget = MemoryBudget(gpu.memory_bytes)
    result = plan(model, SETUP, 4, Cluster(gpu), budget, global_batch=None, offload=False)
    checked = floors = 0
    for outcome in result.outcomes:
        layout = outcome.candidate.layout
        setup = dataclasses.replace(SETUP, grad_checkpointing=outcome.candidate.checkpointing)
        if outcome.fits:
            chosen = dataclasses.replace(setup, batch_size=outcome.micro_batch)
            assert budget.fits(_analyze(budget, model, chosen, layout))
        larger = _analyze(budget, model, dataclasses.replace(setup, batch_size=outcome.micro_batch + 1), layout)
        assert not budget.fits(larger)
        if not outcome.fits and outcome.needed_is_floor:  # a floor: over the budget, and no more than batch 1 needs
            floors += 1
            assert budget.usable_bytes < outcome.needed_bytes <= budget.needed_bytes(larger)
        elif not outcome.fits:
            assert outcome.needed_bytes == budget.needed_bytes(larger)
        checked += 1
    assert checked >= 10 and floors
    assert any(o.micro_batch > 3 for o in result.outcomes)  # batches off the line were chosen, not only traced ones


@pytest.mark.parametrize(
    ("family", "setup", "layout"),
    [
        ("llama", TrainingSetup(mixed_precision="bf16"), Layout(gpus=2, zero=3)),
        ("llama", TrainingSetup(mode="inference", dtype="bf16", max_new_tokens=4), Layout()),
        ("gemma3_text", TrainingSetup(mode="inference", dtype="bf16", cache="static", max_new_tokens=4), Layout()),
        ("qwen2", TrainingSetup(mode="inference", dtype="bf16", max_new_tokens=4), Layout(gpus=2, tp=2)),
        # bitsandbytes' 4-bit decode matmul switches kernels above 4 rows: the line through 2 and 3 does not reach 7
        ("llama", TrainingSetup(mode="inference", dtype="bf16", quantize="fp4", max_new_tokens=4), Layout()),
    ],
    ids=["train-fsdp", "inference", "static-cache", "inference-tp", "inference-4bit"],
)
def test_sweep_reads_batch_sizes_off_the_line(monkeypatch, family, setup, layout):
    """``analyze --sweep`` uses the planner's machinery: each sequence length is traced at batch sizes 1, 2 and 3
    and at the largest swept, which the line must reproduce; every other batch size is read off the line, and each
    point is analyze's own estimate of it (the allocator's replay included), in training and in inference."""
    import analysis.estimate

    model = tiny_model(family)
    traced = []

    def counted(model, setup, progress=None):
        traced.append(setup.batch_size)
        return trace_step(model, setup, progress)

    monkeypatch.setattr(analysis.estimate, "trace_step", counted)
    sweep = run_sweep(model, setup, layout, {"seq-len": (16, 32), "batch": (1, 4, 5, 6, 7)}, find_gpu("h100"))
    lines_hold = setup.quantize is None
    expected = [1, 2, 3, 7] if lines_hold else [1, 2, 3, 4, 5, 6, 7]  # 7 checks the line, or each point is traced
    assert sorted(traced) == sorted(expected * 2)
    monkeypatch.undo()
    for point in sweep.points:
        single = dataclasses.replace(setup, seq_len=point.values["seq-len"], batch_size=point.values["batch"])
        expected = analyze(model, single, layout)
        assert (point.report.peak_bytes, point.report.reserved_bytes) == (expected.peak_bytes, expected.reserved_bytes)


def test_global_batch_sets_accumulation_and_time_ranks_fitting_layouts():
    model = tiny_model("llama")
    whole = 512  # a micro-batch of 32 to 128 fits: every layout accumulates
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(112 * MIB))
    result = plan(model, SETUP, 2, Cluster(gpu), MemoryBudget(gpu.memory_bytes), global_batch=whole, offload=False)
    fitting = [o for o in result.outcomes if o.fits]
    assert fitting and result.best is fitting[0]
    for outcome in fitting:
        assert outcome.micro_batch * outcome.accumulation * outcome.candidate.layout.dp == whole
        assert outcome.time.total_s > 0
    speeds = [o.tokens_per_second for o in fitting]
    assert speeds == sorted(speeds, reverse=True)
    assert any(1 < o.accumulation < whole // o.candidate.layout.dp for o in fitting)  # neither end of the search
    budget = MemoryBudget(gpu.memory_bytes)

    def fits(outcome, micro: int) -> bool:
        per_rank = whole // outcome.candidate.layout.dp
        setup = dataclasses.replace(
            SETUP, batch_size=micro, grad_accum=per_rank // micro, grad_checkpointing=outcome.candidate.checkpointing
        )
        return budget.fits(_analyze(budget, model, setup, outcome.candidate.layout))

    for outcome in fitting[::3]:  # the choice against fresh traces: it fits, the next larger divisor does not
        per_rank = whole // outcome.candidate.layout.dp
        assert fits(outcome, outcome.micro_batch), outcome.candidate.describe()
        larger = [d for d in range(outcome.micro_batch + 1, per_rank + 1) if per_rank % d == 0]
        assert not larger or not fits(outcome, larger[0]), outcome.candidate.describe()


@pytest.mark.parametrize("layout", [Layout(), Layout(gpus=4), Layout(gpus=4, zero=1), Layout(gpus=4, zero=3)])
def test_accumulated_step_time_is_its_micro_steps_plus_one_optimizer_step(layout, monkeypatch):
    """Two traced micro-steps stand for K: the step time from them equals the one from a trace of all K
    micro-steps (each timed op by op), and its compute is K forward and backward passes plus one optimizer
    step."""
    model = tiny_model("llama")
    cluster = Cluster(find_gpu("h100"))

    def timed(accumulation: int):
        setup = dataclasses.replace(SETUP, batch_size=2, grad_accum=accumulation)
        prepared = prepare(layout, setup, model.config)
        single = build_graph(trace_step(model, prepared.traced))
        rank_step = prepared.rank_step(single, Rank())
        return step_time(rank_step, layout, cluster, "bfloat16", accumulation), rank_step

    extrapolated, _ = timed(4)
    with monkeypatch.context() as patched:
        patched.setattr(tracing, "traced_micro_steps", lambda setup: setup.grad_accum)
        every_pass, traced = timed(4)
    assert len(traced.micro_steps()) == 4
    for field in ("forward_s", "backward_s", "optimizer_s", "communication_s", "total_s"):
        assert getattr(extrapolated, field) == pytest.approx(getattr(every_pass, field), rel=1e-12), field
    compute = 4 * (every_pass.forward_s + every_pass.backward_s) + every_pass.optimizer_s
    assert every_pass.total_s - every_pass.exposed_communication_s == pytest.approx(compute, rel=1e-12)


def test_nothing_fits_names_a_change_that_would():
    """Model states of ~200 MB on one GPU that leaves 190 MiB beyond the CUDA context: nothing fits one GPU (916 MiB
    needed, the context and training's two cuBLAS workspaces included, against 95% of 948), and sharding over more
    GPUs is the change named (8 GPUs of FSDP2 need 886 MiB, 26 MiB of it the segments of FSDP2's side-stream
    pools)."""
    model = tiny_model("llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=4)
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(190 * MIB))
    budget = MemoryBudget(gpu.memory_bytes)
    result = plan(model, SETUP, 1, Cluster(gpu), budget, offload=False)
    assert result.best is None
    assert any("--gpus" in suggestion for suggestion in result.suggestions), result.suggestions
    least = result.outcomes[0]  # the one the recommendation names: replayed, and no floor below what it needs
    assert not least.needed_is_floor and least.report is not None
    for outcome in result.outcomes:
        setup = dataclasses.replace(SETUP, grad_checkpointing=outcome.candidate.checkpointing, batch_size=1)
        needed = budget.needed_bytes(_analyze(budget, model, setup, outcome.candidate.layout))
        if outcome.needed_is_floor:  # a floor: at most what the layout needs, and no less than the least's need
            assert least.needed_bytes <= outcome.needed_bytes <= needed and outcome.report is None
        else:
            assert outcome.needed_bytes == needed


def test_candidates_cover_data_and_tensor_parallel_with_and_without_checkpointing():
    model = tiny_model("llama")
    gpu = find_gpu("h100")
    result = plan(model, SETUP, 4, Cluster(gpu), MemoryBudget(gpu.memory_bytes), exhaustive=True)
    seen = {o.candidate for o in result.outcomes}
    assert Candidate(Layout(gpus=4), None) in seen and Candidate(Layout(gpus=4), "full") in seen
    assert Candidate(Layout(gpus=4, tp=4), None) not in seen  # 2 key/value heads
    assert any("tensor parallel 4" in reason for reason in result.skipped)
    assert Candidate(Layout(gpus=4, tp=2, zero=3), None) in seen
    assert Candidate(Layout(gpus=4, zero=3, engine="deepspeed", offload="optimizer,params"), "full") in seen


@pytest.mark.parametrize("global_batch", [None, 64])
def test_layouts_left_unsearched_are_slower_than_the_best(global_batch):
    """Every layout's throughput is at most its ceiling (its ops at their roofline), across data and tensor
    parallelism, checkpointing and offloading, so the layouts the default search leaves out could not have been
    as fast as the best; the ones it searches come out as the exhaustive search finds them."""
    model, gpu = tiny_model("llama"), find_gpu("h100")
    cluster, budget = Cluster(gpu), MemoryBudget(gpu.memory_bytes)
    every = plan(model, SETUP, 4, cluster, budget, global_batch, exhaustive=True)
    default = plan(model, SETUP, 4, cluster, budget, global_batch)
    search = _Search(model, SETUP, cluster, budget, global_batch, "bfloat16")
    for outcome in every.outcomes:
        ceiling = search.ceiling(outcome.candidate)
        assert ceiling is not None and outcome.tokens_per_second <= ceiling, outcome.candidate.describe()
    found = {o.candidate: o for o in default.outcomes}
    assert default.best.candidate == every.best.candidate
    left_out = [o for o in every.outcomes if o.candidate not in found]
    assert left_out and set(default.slower) == {o.candidate for o in left_out}
    for outcome in left_out:
        assert outcome.tokens_per_second <= default.slower[outcome.candidate]
        assert default.slower[outcome.candidate] * (1 + AS_FAST_WITHIN) < every.best.tokens_per_second
    assert "(--exhaustive searches them)" in render_plan(default) and not every.slower
    for outcome in every.outcomes:
        if outcome.candidate in found:
            same = found[outcome.candidate]
            assert (same.micro_batch, same.accumulation, same.needed_bytes, same.tokens_per_second) == (
                outcome.micro_batch,
                outcome.accumulation,
                outcome.needed_bytes,
                outcome.tokens_per_second,
            )


@pytest.mark.parametrize(
    ("family", "overrides", "flags", "gpus", "memory_mib", "global_batch", "plan_options"),
    [
        pytest.param(
            "llama",
            {"num_hidden_layers": 4},
            {},
            4,
            624,
            16,
            {"pipeline": "on"},
            id="pipelines",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "llama",
            {"num_hidden_layers": 2, "max_position_embeddings": 16384},
            {"seq_len": 16384, "grad_checkpointing": "full"},
            4,
            7792,
            None,
            {"pipeline": "off"},
            id="context-parallel",
        ),
        pytest.param(
            "qwen3_moe", {}, {"grad_checkpointing": "full"}, 2, 160, None, {"routing_imbalance": 1.5}, id="experts"
        ),
    ],
)
def test_no_layout_beats_its_ceiling(family, overrides, flags, gpus, memory_mib, global_batch, plan_options):
    """Pipelines (their stages share the step's ops out), context-parallel ranks and expert-parallel ranks (steps
    of their own) stay under the ceiling too, so the default search may leave any of them out."""
    model, setup = tiny_model(family, **overrides), dataclasses.replace(SETUP, **flags)
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(memory_mib * MIB))
    cluster, budget = Cluster(gpu), MemoryBudget(gpu.memory_bytes)
    result = plan(model, setup, gpus, cluster, budget, global_batch, offload=False, exhaustive=True, **plan_options)
    search = _Search(model, setup, cluster, budget, global_batch, "bfloat16")
    fitting = [o for o in result.outcomes if o.fits]
    assert any(o.candidate.layout.pp * o.candidate.layout.cp * o.candidate.layout.ep > 1 for o in fitting)
    for outcome in fitting:
        assert outcome.tokens_per_second <= search.ceiling(outcome.candidate), outcome.candidate.describe()


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_moe"])
@pytest.mark.parametrize("checkpointing", [None, "full"])
def test_each_op_grows_by_a_part_per_sequence(family, checkpointing):
    """What the ceiling rests on: every forward and backward op's FLOPs and bytes are a part that does not grow
    with the batch, never negative, plus a part per sequence (the line through batches 2 and 3 meets batch 0 at or
    above 0)."""
    setup = dataclasses.replace(SETUP, grad_checkpointing=checkpointing)
    source = StepSource(tiny_model(family), setup, lines=True)
    line = source.line()
    for one, two in zip(line.one.ops, line.two.ops, strict=True):
        if one.phase in (Phase.FORWARD, Phase.BACKWARD):
            assert one.flops >= 2 * (two.flops - one.flops), one.target
            assert one.bytes_moved >= 2 * (two.bytes_moved - one.bytes_moved), one.target


def test_search_processes_keep_groups_together_and_raise_failures():
    """Candidates that share a model-parallel slice run in one process; a failure in a worker is raised here."""
    results = dict(_in_processes(lambda index: (index * index, os.getpid()), 9, 2, lambda index: index % 3 or None))
    assert [square for square, _ in sorted(results.values())] == [index * index for index in range(9)]
    for group in ([1, 4, 7], [2, 5, 8]):
        assert len({results[index][1] for index in group}) == 1
    assert {pid for _, pid in results.values()} - {os.getpid()}  # forked workers did the work

    def fail(index: int) -> int:
        if index == 5:
            raise ValueError("layout 5 failed")
        return index

    with pytest.raises(ValueError, match="layout 5 failed"):
        list(_in_processes(fail, 8, 2))


def test_plan_cli_json(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(tiny_model("llama").config.to_json_string())
    memory = f"{_beyond_context(112 * MIB) // MIB}MiB"
    argv = ["plan", str(config), "--gpus", "2", "--seq-len", "64", "--dtype", "bf16", "--gpu-memory", memory]
    assert main([*argv, "--global-batch", "16", "--json", "--jobs", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["fits"] and data["global_batch"] == 16
    assert len(data["candidates"]) >= 10
    tokens_per_second = data["recommended"]["tokens_per_second"]
    assert all(0 < left["ceiling_tokens_per_second"] < tokens_per_second for left in data["slower"])
    assert main([*argv, "--quiet", "--jobs", "2", "--no-offload"]) == 0
    assert "Recommended:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "0"], "--gpus must be at least 1"),
        (["--margin", "1.5"], "--margin"),
        (["--gpu-memory", "lots"], "--gpu-memory takes a size"),
        (["--grad-accum", "4"], "--global-batch instead"),
        (["--global-batch", "0"], "--global-batch must be at least 1"),
        (["--gpu", "v100-32gb", "--dtype", "bf16"], "no bfloat16"),
        (["--tflops", "0"], "--tflops must be a finite positive number"),
        (["--internode-gbps", "-1"], "--internode-gbps must be a finite positive number"),
        (["--routing-imbalance", "2"], "--routing-imbalance applies to the expert-parallel layouts of a MoE model"),
    ],
)
def test_plan_cli_errors(tmp_path, capsys, flags, message):
    config = tmp_path / "config.json"
    config.write_text(tiny_model("llama").config.to_json_string())
    assert main(["plan", str(config), "--seq-len", "64", "--quiet", *flags]) == 2
    assert message in capsys.readouterr().err


def test_gpus_catalog(capsys):
    assert main(["gpus", "--json"]) == 0
    names = {gpu["name"] for gpu in json.loads(capsys.readouterr().out)}
    for name in ("v100-16gb", "v100-32gb", "t4", "a10g", "rtx3090", "rtx4090", "l4", "l40s", "a100-40gb"):
        assert name in names
    assert {"a100-80gb", "h100", "h200", "b200", "mi300x"} <= names


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_pipeline_makespan_is_the_textbook_bubble(schedule, stages, microbatches):
    """Equal stages, nothing in flight between them: both schedules take (M + P - 1) forward-and-backward times,
    the bubble (P - 1) of them (GPipe, arXiv 1811.06965; 1F1B, PipeDream-Flush)."""
    forward, backward = 1.0, 2.0
    layout = Layout(gpus=stages, pp=stages, pp_schedule=schedule, microbatches=microbatches)
    durations = [
        {(kind, rank, mb): forward if kind == "F" else backward for kind in "FB" for mb in range(microbatches)}
        for rank in range(stages)
    ]
    makespan = schedule_makespan(layout, durations, [0.0] * stages)
    assert makespan == pytest.approx((microbatches + stages - 1) * (forward + backward))


@pytest.mark.parametrize(("ranks", "per_rank", "microbatches"), [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 4, 6)])
def test_interleaved_makespan_divides_the_bubble_by_the_stages_per_rank(ranks, per_rank, microbatches):
    """Interleaved 1F1B with V stages per rank, each 1/V of a rank's work: the bubble shrinks to (P - 1) / V
    forward-and-backward times (Narayanan et al., arXiv 2104.04473, section 2.2.2)."""
    forward, backward = 1.0, 2.0
    layout = Layout(
        gpus=ranks, pp=ranks, pp_schedule="interleaved-1f1b", microbatches=microbatches, pp_stages_per_rank=per_rank
    )
    durations = [
        {
            (kind, stage, mb): (forward if kind == "F" else backward) / per_rank
            for kind in "FB"
            for stage in range(rank, ranks * per_rank, ranks)
            for mb in range(microbatches)
        }
        for rank in range(ranks)
    ]
    makespan = schedule_makespan(layout, durations, [0.0] * ranks)
    assert makespan == pytest.approx((microbatches + (ranks - 1) / per_rank) * (forward + backward))


@pytest.mark.slow
def test_pipeline_layouts_are_planned_with_their_bubble():
    """--pipeline on adds 1F1B and interleaved 1F1B layouts whose microbatches come from the global batch; each kept
    layout's report is analyze's at its micro-batch and microbatches, and its step time carries the pipeline's
    bubble."""
    model = tiny_model("llama", num_hidden_layers=4)
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(624 * MIB))
    budget = MemoryBudget(gpu.memory_bytes)
    result = plan(model, SETUP, 4, Cluster(gpu), budget, global_batch=16, offload=False, pipeline="on", exhaustive=True)
    piped = [o for o in result.outcomes if o.candidate.layout.pp > 1 and o.fits]
    assert {o.candidate.layout.pp_schedule for o in piped} == {"1f1b", "interleaved-1f1b"}
    for outcome in piped:
        layout = outcome.candidate.layout
        assert layout.stage_microbatches == outcome.accumulation >= layout.pp
        assert outcome.micro_batch * outcome.accumulation * layout.dp == 16
        assert outcome.time.pipeline_bubble_s > 0
        setup = dataclasses.replace(SETUP, grad_checkpointing=outcome.candidate.checkpointing)
        report = _analyze(budget, model, dataclasses.replace(setup, batch_size=outcome.micro_batch), layout)
        assert budget.needed_bytes(report) == outcome.needed_bytes
    none = plan(model, SETUP, 4, Cluster(gpu), budget, offload=False, pipeline="auto")
    assert all(o.candidate.layout.pp == 1 for o in none.outcomes)
    assert any("pipeline parallelism" in reason for reason in none.skipped)


@pytest.mark.parametrize(
    "layout",
    [
        Layout(gpus=4, pp=4, microbatches=8),
        Layout(gpus=8, pp=4, zero=2, microbatches=4),
        Layout(gpus=4, pp=4, pp_schedule="interleaved-1f1b", microbatches=8),
        Layout(gpus=5, pp=5, pp_schedule="interleaved-1f1b", microbatches=5),  # 10 stages of 12 layers: uneven
    ],
    ids=lambda layout: layout.describe(),
)
def test_the_dominant_stages_hold_the_busiest(layout):
    """The planner reads the first, second and last ranks of a 1F1B or interleaved 1F1B pipeline of alike layers:
    every middle rank's report (analyze's) peaks no higher than the second's."""
    model = tiny_model("llama", num_hidden_layers=12)
    setup = dataclasses.replace(SETUP, batch_size=2)
    prepared = prepare(layout, setup, model.config)
    dominant = LayoutEstimate(model.model_id, prepared, StepSource(model, prepared.traced), dominant=True)
    assert [rank.pp for rank in dominant.ranks] == [0, 1, layout.pp - 1]
    every = analyze(model, setup, layout)
    assert dominant.evaluate(2).report.peak_bytes == every.peak_bytes
    peaks = [rank.peak_bytes for rank in every.ranks]
    assert len(peaks) == layout.pp and max(peaks[2:-1], default=0) <= peaks[1]


def test_long_sequences_are_planned_with_context_parallelism():
    """From 16k tokens the planner adds context-parallel layouts (FSDP2 over the dp x cp GPUs), alone and with tensor
    parallelism, whose reports are analyze's and whose step time prices the ring's exchanges."""
    model = tiny_model("llama", num_hidden_layers=2, max_position_embeddings=16384)
    setup = dataclasses.replace(SETUP, seq_len=16384, grad_checkpointing="full")
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(7792 * MIB))
    budget = MemoryBudget(gpu.memory_bytes)
    result = plan(model, setup, 4, Cluster(gpu), budget, offload=False, pipeline="off", exhaustive=True)
    ringed = [o for o in result.outcomes if o.candidate.layout.cp > 1 and o.fits]
    assert {(o.candidate.layout.cp, o.candidate.layout.tp) for o in ringed} == {(2, 1), (4, 1), (2, 2)}
    for outcome in ringed:
        chosen = dataclasses.replace(setup, batch_size=outcome.micro_batch)
        report = _analyze(budget, model, chosen, outcome.candidate.layout)
        assert budget.needed_bytes(report) == outcome.needed_bytes
        assert outcome.time.communication_s > 0


def test_shorter_sequences_say_why_context_parallelism_is_not_searched():
    model = tiny_model("llama", max_position_embeddings=16384)
    gpu = find_gpu("h100")
    short, skipped = candidates(model, dataclasses.replace(SETUP, seq_len=8192), 4, Cluster(gpu))
    assert not any(c.layout.cp > 1 for c in short)
    assert any(reason.startswith("context parallelism: searched for sequences from 16,384") for reason in skipped)
    long, skipped = candidates(model, dataclasses.replace(SETUP, seq_len=16384), 4, Cluster(gpu))
    assert any(c.layout.cp > 1 for c in long) and not any("context parallelism" in reason for reason in skipped)


@pytest.mark.slow
def test_long_sequences_are_pipelined_with_context_parallelism():
    """--pipeline on at 16k tokens adds pipelines whose stages run context parallel (torchtitan's pp x dp x cp mesh),
    each one's memory analyze's for that layout at its micro-batch and microbatches."""
    model = tiny_model("llama", num_hidden_layers=4, max_position_embeddings=16384)
    setup = dataclasses.replace(SETUP, seq_len=16384, grad_checkpointing="full")
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(7792 * MIB))
    budget = MemoryBudget(gpu.memory_bytes)
    result = plan(model, setup, 4, Cluster(gpu), budget, global_batch=4, offload=False, pipeline="on", exhaustive=True)
    ringed = [o for o in result.outcomes if o.candidate.layout.cp > 1 and o.candidate.layout.pp > 1]
    assert {(o.candidate.layout.cp, o.candidate.layout.pp_schedule) for o in ringed} == {
        (2, "1f1b"),
        (2, "interleaved-1f1b"),
    }
    for outcome in ringed:
        layout = outcome.candidate.layout
        assert outcome.fits and layout.pp == 2 and layout.stage_microbatches == outcome.accumulation
        report = _analyze(budget, model, dataclasses.replace(setup, batch_size=outcome.micro_batch), layout)
        assert budget.needed_bytes(report) == outcome.needed_bytes, layout.describe()
        assert outcome.time.pipeline_bubble_s > 0 and outcome.time.communication_s > 0


def test_moe_models_are_planned_with_expert_parallelism():
    """A MoE model's plan adds expert parallelism under DDP and both FSDP2 layouts, with the routing asked for;
    each one's memory is analyze's for that layout at its micro-batch, and its step time prices the all-to-all."""
    model = tiny_model("qwen3_moe")
    setup = dataclasses.replace(SETUP, grad_checkpointing="full")
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(160 * MIB))
    budget = MemoryBudget(gpu.memory_bytes)
    result = plan(model, setup, 2, Cluster(gpu), budget, offload=False, routing_imbalance=1.5, exhaustive=True)
    expert_parallel = [o for o in result.outcomes if o.candidate.layout.ep > 1]
    assert {(o.candidate.layout.ep, o.candidate.layout.zero) for o in expert_parallel} == {(2, 0), (2, 2), (2, 3)}
    for outcome in expert_parallel:
        layout = outcome.candidate.layout
        assert outcome.fits and layout.routing_imbalance == 1.5
        report = _analyze(budget, model, dataclasses.replace(setup, batch_size=outcome.micro_batch), layout)
        assert budget.needed_bytes(report) == outcome.needed_bytes, layout.describe()
        assert outcome.time.communication_s > 0
    dense, skipped = candidates(tiny_model("llama"), SETUP, 8, Cluster(gpu))
    assert all(candidate.layout.ep == 1 for candidate in dense)
    assert not any("expert" in reason for reason in skipped)


def test_expert_parallel_layouts_run_the_per_rank_batch_whole():
    """Gradient accumulation with expert parallelism is refused (not checked against a runtime): with a global batch,
    an expert-parallel layout runs its per-rank batch in one micro-step or does not fit, read at that batch, while
    the others accumulate; degrees wider than a node are left out, with why."""
    model = tiny_model("qwen3_moe")
    setup = dataclasses.replace(SETUP, grad_checkpointing="full")
    gpu = dataclasses.replace(find_gpu("h100"), memory_bytes=_beyond_context(112 * MIB))
    budget = MemoryBudget(gpu.memory_bytes)
    result = plan(model, setup, 2, Cluster(gpu), budget, global_batch=512, offload=False, exhaustive=True)
    expert_parallel = [o for o in result.outcomes if o.candidate.layout.ep > 1]
    assert expert_parallel and all(not o.fits and o.needed_at == 256 and o.notes for o in expert_parallel)
    assert any(o.fits and o.accumulation > 1 for o in result.outcomes)
    wide = tiny_model("qwen3_moe", num_experts=16)
    chosen, skipped = candidates(wide, setup, 16, Cluster(gpu, gpus_per_node=4))
    assert {c.layout.ep for c in chosen} == {1, 4}
    assert "expert parallel 2: expert parallel 4 holds less at the same FLOPs (--ep to analyze one)" in skipped
    assert "expert parallel 8, 16: wider than a node of 4 GPUs" in skipped


def test_the_search_tries_the_smallest_batch_whatever_the_slack():
    """A flat floor (the peak in the optimizer step) with a reserve that grows with the batch: the slack the largest
    batch leaves rules out every floor, yet batches up to 5 fit; the search finds 5, not none."""

    class Flat:
        def needed_floor(self, size: int) -> int:
            return 100

        def evaluate(self, size: int) -> SimpleNamespace:
            return SimpleNamespace(report=SimpleNamespace(ranks=[], device_total_bytes=101 + size, peak_bytes=100))

    budget = MemoryBudget(capacity_bytes=106, margin=0)
    largest = _largest_fitting(Flat(), budget, 64, replay_ruled_out=False)
    assert (largest.size, largest.report.device_total_bytes, largest.needed_bytes) == (5, 106, 106)
    none = _largest_fitting(Flat(), MemoryBudget(capacity_bytes=101, margin=0), 64, replay_ruled_out=False)
    assert (none.size, none.needed_bytes, none.needed_at) == (0, 102, 1)  # the smallest's report


def test_a_floor_over_the_budget_is_not_replayed():
    """Where even the smallest batch's floor is over the budget, that floor is what the layout needs, and no report
    is made, unless the replay is asked for (the plan asks when nothing fits, to name the least hungry layout)."""

    class Replayed(Exception):
        pass

    class Hungry:
        def needed_floor(self, size: int) -> int:
            return 100 + size

        def evaluate(self, size: int):
            raise Replayed

    budget = MemoryBudget(capacity_bytes=100, margin=0)
    assert _largest_fitting(Hungry(), budget, 64, replay_ruled_out=False) == (0, None, 101, 1)
    with pytest.raises(Replayed):
        _largest_fitting(Hungry(), budget, 64, replay_ruled_out=True)
