"""Pipeline parallelism (strategies/pipeline.py): each stage's step, built from the one traced step, against
torch.distributed.pipelining itself run for that stage (tests/pipeline_runtime.py). Eight layers and a vocabulary
of 32 put the peak in backward, where the microbatches in flight, the gradients and the receive buffers live."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pipeline_runtime import pipeline_peak
from tiny_models import tiny_model
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _ComputationType

from analysis.estimate import analyze
from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from strategies.pipeline import interleaved_actions, interleaved_rounds
from tracer.errors import UserError
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

TOLERANCE = 0.01  # as tests/test_strategy_*.py
MODEL = tiny_model("llama", num_hidden_layers=8, vocab_size=32)
ADAPTERS = LoraSetup(r=4, alpha=8, targets=("q_proj", "v_proj"))
SLOW = pytest.mark.slow
INTERLEAVED = {"pp_schedule": "interleaved-1f1b"}


def _check(stages: int, schedule: str, microbatches: int, **options) -> None:
    _check_layout(Layout(gpus=stages, pp=stages, pp_schedule=schedule, microbatches=microbatches), **options)


def _check_layout(layout: Layout, **options) -> None:
    """Every pipeline rank of ``layout`` (data- and tensor-parallel rank 0) against the runtime."""
    setup = TrainingSetup(**({"target": Target.CPU, "batch_size": 2, "seq_len": 32} | options))
    prepared = prepare(layout, setup, MODEL.config)
    traced = build_graph(trace_step(MODEL, prepared.traced))
    for stage in range(layout.pp):
        estimate = find_peak(timeline(prepared.rank_step(traced, Rank(pp=stage)), rounded=False)).bytes
        runtime = pipeline_peak(MODEL, setup, layout, Rank(pp=stage))
        assert abs(estimate - runtime) / runtime <= TOLERANCE, (stage, estimate, runtime)


@pytest.mark.parametrize(
    ("stages", "schedule", "microbatches"),
    [
        (2, "1f1b", 4),
        (4, "gpipe", 4),
        pytest.param(2, "gpipe", 4, marks=SLOW),
        pytest.param(4, "1f1b", 4, marks=SLOW),
        pytest.param(4, "1f1b", 8, marks=SLOW),
        pytest.param(3, "1f1b", 3, marks=SLOW),  # uneven layers
        pytest.param(4, "gpipe", 2, marks=SLOW),  # fewer microbatches than stages
    ],
)
def test_every_stage_matches_torch_pipelining(stages, schedule, microbatches):
    _check(stages, schedule, microbatches)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"lora": ADAPTERS, "grad_checkpointing": "full"}, marks=SLOW),
        pytest.param({"dtype": "bf16"}, marks=SLOW),
        pytest.param({"grad_checkpointing": "full", "reentrant": True}, marks=SLOW),
        pytest.param({"optimizer": "sgd", "grad_checkpointing": "selective"}, marks=SLOW),
        pytest.param({"dtype": "bf16", "quantize": "nf4", "lora": ADAPTERS}, marks=SLOW),
    ],
    ids=str,
)
def test_stages_compose_with_the_variants(options):
    """LoRA on a frozen embedding (whose output checkpointing makes a leaf that requires grad), checkpointing,
    bf16 weights, QLoRA: each stage runs only its own layers' variant."""
    _check(4, "gpipe", 4, **options)
    _check(2, "1f1b", 4, **options)


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        # torchtitan's PP x FSDP2: the stage's units stay gathered and its gradients accumulate unsharded (in float32
        # under the mixed-precision policy) until perform_reduce_grad
        (Layout(gpus=4, pp=2, zero=3, microbatches=4), {"mixed_precision": "bf16"}),
        (Layout(gpus=8, pp=2, tp=2, zero=2, microbatches=4), {}),
        (Layout(gpus=3, pp=3, pp_split=(1, 3, 4), microbatches=3), {}),  # --pp-split: the last stage the largest
        pytest.param(Layout(gpus=4, pp=2, zero=2, microbatches=4), {"mixed_precision": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=8, pp=4, zero=3, pp_schedule="gpipe", microbatches=4), {}, marks=SLOW),
        pytest.param(Layout(gpus=6, pp=2, zero=2, pp_schedule="gpipe", microbatches=2), {}, marks=SLOW),
        pytest.param(
            Layout(gpus=4, pp=2, zero=3, microbatches=4),
            {"mixed_precision": "bf16", "grad_checkpointing": "full", "lora": ADAPTERS},
            marks=SLOW,
        ),
        pytest.param(Layout(gpus=4, pp=2, zero=0, microbatches=4), {"mixed_precision": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=4, pp=2, zero=1, microbatches=4), {"grad_checkpointing": "full"}, marks=SLOW),
        pytest.param(Layout(gpus=4, pp=2, tp=2, microbatches=4), {}, marks=SLOW),
        pytest.param(Layout(gpus=4, pp=2, tp=2, tp_output="gathered", microbatches=4), {}, marks=SLOW),
        pytest.param(Layout(gpus=8, pp=2, tp=2, zero=3, microbatches=4), {"mixed_precision": "bf16"}, marks=SLOW),
    ],
    ids=lambda value: value.describe() if isinstance(value, Layout) else str(value),
)
def test_stages_compose_with_data_and_tensor_parallelism(layout, options):
    """Each stage under DDP, ZeroRedundancyOptimizer or FSDP2 over the data-parallel group, and DTensor tensor
    parallelism, as torchtitan composes them, against the runtimes composed the same way."""
    _check_layout(layout, **options)


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        (Layout(gpus=4, pp=2, cp=2, microbatches=4), {}),
        pytest.param(Layout(gpus=4, pp=2, cp=2, zero=2, microbatches=4), {"mixed_precision": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=4, pp=2, cp=2, zero=3, microbatches=4, **INTERLEAVED), {}, marks=SLOW),
        pytest.param(Layout(gpus=8, pp=2, cp=4, zero=2, pp_schedule="gpipe", microbatches=2), {}, marks=SLOW),
    ],
    ids=lambda value: value.describe() if isinstance(value, Layout) else str(value),
)
def test_stages_compose_with_context_parallelism(layout, options):
    """torchtitan's pp x dp x cp mesh: each stage runs the rank's share of each sequence with torch's ring
    attention over the context-parallel group (tests/cp_runtime.py's), replicated or sharded over dp x cp."""
    _check_layout(layout, **options)


@pytest.mark.parametrize(
    ("layout", "options"),
    [
        (Layout(gpus=2, pp=2, microbatches=4, **INTERLEAVED), {}),
        # four stages per rank: the runtime keeps three unsharded and reshards the fourth (_add_unshard_reshard);
        # batch 1 of 8 tokens puts the peak where the stages' prefetched all-gathers are held
        (
            Layout(gpus=4, pp=2, zero=3, microbatches=4, pp_stages_per_rank=4, **INTERLEAVED),
            {"batch_size": 1, "seq_len": 8},
        ),
        pytest.param(Layout(gpus=4, pp=4, microbatches=8, **INTERLEAVED), {}, marks=SLOW),
        pytest.param(Layout(gpus=4, pp=4, microbatches=4, **INTERLEAVED), {}, marks=SLOW),
        pytest.param(Layout(gpus=2, pp=2, microbatches=3, pp_stages_per_rank=3, **INTERLEAVED), {}, marks=SLOW),
        pytest.param(
            Layout(gpus=2, pp=2, microbatches=4, **INTERLEAVED),
            {"lora": ADAPTERS, "grad_checkpointing": "full"},
            marks=SLOW,
        ),
        pytest.param(Layout(gpus=2, pp=2, microbatches=4, **INTERLEAVED), {"dtype": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=4, pp=2, microbatches=4, **INTERLEAVED), {"mixed_precision": "bf16"}, marks=SLOW),
        pytest.param(Layout(gpus=4, pp=2, zero=1, microbatches=4, **INTERLEAVED), {}, marks=SLOW),
        pytest.param(
            Layout(gpus=4, pp=2, zero=3, microbatches=4, **INTERLEAVED), {"mixed_precision": "bf16"}, marks=SLOW
        ),
        pytest.param(Layout(gpus=4, pp=2, zero=2, microbatches=4, **INTERLEAVED), {}, marks=SLOW),
        pytest.param(Layout(gpus=4, pp=2, tp=2, microbatches=4, **INTERLEAVED), {}, marks=SLOW),
        pytest.param(
            Layout(gpus=8, pp=2, tp=2, zero=3, microbatches=4, **INTERLEAVED), {"mixed_precision": "bf16"}, marks=SLOW
        ),
        pytest.param(Layout(gpus=8, pp=4, zero=3, microbatches=8, **INTERLEAVED), {}, marks=SLOW),
        pytest.param(
            Layout(gpus=4, pp=2, zero=2, microbatches=4, pp_stages_per_rank=4, **INTERLEAVED),
            {"batch_size": 1, "seq_len": 8, "mixed_precision": "bf16"},
            marks=SLOW,
        ),
        pytest.param(
            Layout(gpus=4, pp=2, zero=3, microbatches=2, **INTERLEAVED), {"batch_size": 1, "seq_len": 8}, marks=SLOW
        ),
    ],
    ids=lambda value: value.describe() if isinstance(value, Layout) else str(value),
)
def test_interleaved_ranks_match_torch_pipelining(layout, options):
    """ScheduleInterleaved1F1B: each rank's stages r, r + P, ... with their own receive buffers, in the order the
    runtime runs them; composed with DDP, ZeroRedundancyOptimizer, FSDP2 (each stage its own root, unsharded
    and resharded by the runtime's own actions) and tensor parallelism."""
    _check_layout(layout, **options)


@pytest.mark.parametrize(("ranks", "per_rank"), [(2, 2), (3, 2), (4, 3), (8, 4)])
def test_interleaved_order_is_torchs(ranks, per_rank):
    """The order each rank runs its forwards and backwards is the one ScheduleInterleaved1F1B computes (its idle
    slots left out), for every count of microbatches it accepts."""
    for microbatches in range(1, 3 * ranks + 1):
        rounds = interleaved_rounds(ranks, microbatches)
        if microbatches % rounds:
            continue
        schedule = SimpleNamespace(
            n_local_stages=per_rank,
            microbatches_per_round=microbatches // rounds,
            pp_group_size=ranks,
            _n_microbatches=microbatches,
        )
        for rank in range(ranks):
            torchs = ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank)
            expected = [
                (
                    "F" if action.computation_type == _ComputationType.FORWARD else "B",
                    action.stage_index,
                    action.microbatch_index,
                )
                for action in torchs
                if action is not None
            ]
            assert interleaved_actions(ranks, rank, microbatches, per_rank) == expected


def test_report_lists_every_stage():
    setup = TrainingSetup(batch_size=2, seq_len=32, mixed_precision="bf16")
    report = analyze(MODEL, setup, Layout(gpus=4, pp=4, microbatches=8))
    assert [rank.rank.pp for rank in report.ranks] == [0, 1, 2, 3]
    assert report.peak_bytes == max(rank.peak_bytes for rank in report.ranks)
    assert "pipeline parallel 4 (1f1b, 8 microbatches)" in report.assumptions["layout"]


@pytest.mark.parametrize(
    ("layout", "options", "message"),
    [
        ({"gpus": 16, "pp": 16}, {}, "more stages than the model's 8 decoder layers"),
        ({"gpus": 8, "pp": 4, "zero": 3, "engine": "deepspeed"}, {}, "DeepSpeed runs its own pipeline engine"),
        ({"gpus": 8, "pp": 2, "tp": 2, "sequence_parallel": True}, {}, "--sequence-parallel with --pp"),
        ({"gpus": 8, "pp": 4, "zero": 3, "offload": "optimizer,params"}, {}, "--offload with --pp"),
        ({"gpus": 2, "pp": 2}, {"grad_accum": 2}, "give --microbatches 4 instead"),
        ({"gpus": 2, "microbatches": 4}, {}, "add --pp 2 or more"),
        ({"gpus": 4, "pp": 4, "pp_split": (4, 4)}, {}, "4 counts, e.g. --pp-split 8,8,8,8"),
        ({"gpus": 4, "pp": 4, "pp_split": (2, 2, 2, 3)}, {}, "gives 9 decoder layers, and the model has 8"),
        ({"gpus": 2, "pp": 2, "pp_schedule": "zero-bubble"}, {}, "zero-bubble schedules are not modelled yet"),
        ({"gpus": 2, "pp": 2, "pp_stages_per_rank": 2}, {}, "--stages-per-rank applies to --pp-schedule"),
        ({"gpus": 2, "pp": 2, "pp_stages_per_rank": 1, **INTERLEAVED}, {}, "--stages-per-rank 2 or more"),
        ({"gpus": 4, "pp": 4, "microbatches": 9, **INTERLEAVED}, {}, "must be a multiple of its 2 rounds"),
        ({"gpus": 2, "pp": 2, "pp_split": (4, 4), **INTERLEAVED}, {}, "each of the 4 pipeline stages"),
        ({"gpus": 4, "pp": 4, "pp_stages_per_rank": 3, **INTERLEAVED}, {}, "--pp 4 x 3 stages per rank: more stages"),
        ({"gpus": 4, "pp": 4, "microbatches": 2}, {}, "1f1b needs at least as many microbatches as stages"),
    ],
)
def test_pipeline_refusals_name_the_fix(layout, options, message):
    with pytest.raises(UserError, match=message):
        prepare(Layout(**layout), TrainingSetup(**options), MODEL.config)


def test_tied_embeddings_are_refused_by_name():
    tied = tiny_model("llama", num_hidden_layers=8, vocab_size=32, tie_word_embeddings=True)
    with pytest.raises(UserError, match="tie_word_embeddings"):
        prepare(Layout(gpus=2, pp=2), TrainingSetup(), tied.config)
