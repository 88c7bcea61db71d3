"""DeepSpeed ZeRO as a transform of the single-GPU trace. DeepSpeed cannot run here, so the model states it
keeps are checked against DeepSpeed's own estimators, for the same parameter counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from bitsandbytes import functional
from deepspeed.runtime.zero.partition_parameters import Init
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from tiny_models import tiny_model
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from analysis.peak import find_peak, timeline
from strategies.deepspeed import DeepSpeedPlan, ZeroConfig, deepspeed, partition_numel
from strategies.layout import Layout, Rank, prepare
from tracer.errors import UserError
from tracer.graph import StepGraph, build_graph
from tracer.roles import Role
from tracer.tracing import trace_step
from tracer.training import LoraSetup, Target, TrainingSetup

# The estimators assume 16-bit training with fp32 master weights (DeepSpeed's bf16 or fp16 mode).
SETUP = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, dtype="bf16")
# Parameters that split evenly, so that DeepSpeed's alignment padding is zero as the estimators assume.
EVEN = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256}


def _trace(family: str) -> tuple[StepGraph, int]:
    trace = trace_step(tiny_model(family, **EVEN), SETUP)
    return build_graph(trace), trace.parameter_count


def _model_states(step: StepGraph) -> int:
    """Bytes of what ZeRO keeps of the model: parameters as held between steps, the gradient partitions,
    fp32 master weights and optimizer states (not the 0-dim step counters)."""
    kept = (Role.PARAMETER, Role.OPTIMIZER_STATE)
    states = sum(row.nbytes for row in step.storages.values() if row.role in kept and row.producer is None)
    gradients = sum(
        row.nbytes for row in step.storages.values() if row.role is Role.GRADIENT and "partition" in row.name
    )
    counters = sum(row.nbytes for row in step.storages.values() if row.name.endswith(".step"))
    return states + gradients - counters


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_zero2_model_states_match_deepspeeds_estimator(family, world):
    step, params = _trace(family)
    _, expected = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=False)
    assert _model_states(deepspeed(step, DeepSpeedPlan(2, world))) == expected


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_zero3_model_states_match_deepspeeds_estimator(family, world):
    """The estimator partitions every parameter: persistence is turned off to compare."""
    step, params = _trace(family)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in _modules(family))
    _, expected, largest_layer_memory = estimate_zero3_model_states_mem_needs(
        params, largest, num_gpus_per_node=world, cpu_offload=False, cpu_offload_params=False
    )
    sharded = deepspeed(step, DeepSpeedPlan(3, world, config=ZeroConfig(stage3_param_persistence_threshold=0)))
    assert _model_states(sharded) == expected - largest_layer_memory
    gathered = max(row.nbytes for row in sharded.storages.values() if row.name.endswith("(gathered)"))
    assert 2 * gathered == largest_layer_memory  # 16-bit parameters and gradients of the largest layer


def _modules(family: str):
    from tracer.step import build_model

    with torch.device("meta"):
        return list(build_model(tiny_model(family, **EVEN).config, SETUP).modules())


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("hidden_size", [128, 4096, 8192])
def test_auto_sizes_resolve_as_the_trainer_fills_them(stage, hidden_size):
    """Against transformers' own ``HfTrainerDeepSpeedConfig.trainer_config_finalize``."""
    keys = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
    trainer = HfTrainerDeepSpeedConfig({"zero_optimization": {"stage": stage} | dict.fromkeys(keys, "auto")})
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size))
    trainer.trainer_config_finalize(SimpleNamespace(get_warmup_steps=lambda steps: 0), model, 10)
    ours = ZeroConfig(**dict.fromkeys(keys, "auto")).resolved(hidden_size)
    filled = trainer.config["zero_optimization"]
    assert ours.reduce_bucket_size == filled["reduce_bucket_size"]
    if stage == 3:  # the Trainer fills the stage-3 keys for stage 3 only; they do not act below it
        assert ours.stage3_prefetch_bucket_size == filled["stage3_prefetch_bucket_size"]
        assert ours.stage3_param_persistence_threshold == filled["stage3_param_persistence_threshold"]


def test_overlap_comm_doubles_the_bucket_below_stage_3():
    """``setup_buckets`` allocates a second bucket of ``reduce_bucket_size`` with ``overlap_comm``."""
    step, _ = _trace("llama")
    buckets = [
        sum(
            row.nbytes
            for row in deepspeed(step, DeepSpeedPlan(2, 4, config=config)).storages.values()
            if "bucket" in row.name
        )
        for config in (ZeroConfig(reduce_bucket_size=1000), ZeroConfig(reduce_bucket_size=1000, overlap_comm=True))
    ]
    assert buckets == [2000, 4000]  # bf16


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_accumulation_keeps_no_full_gradients_from_stage_2(stage):
    """No runtime check is possible here (DeepSpeed does not run on this CPU); what its source says instead.
    From stage 2 each micro-step's gradients go through the bucket into the partition and are freed
    (``reduce_independent_p_g_buckets_and_remove_grads``), so accumulating micro-steps adds no memory: the
    peak of three micro-steps is the peak of one. Stage 1 keeps the full gradients until the boundary, which
    the peak of the later micro-steps holds."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=32)
    peaks = {}
    for zero, accum in ((stage, 1), (stage, 3), (1, 1), (1, 3)):
        setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, grad_accum=accum)
        prepared = prepare(Layout(gpus=4, zero=zero, engine="deepspeed"), setup, model.config)
        step = prepared.rank_step(build_graph(trace_step(model, prepared.traced)), Rank())
        peaks[zero, accum] = find_peak(timeline(step, rounded=False)).bytes
    assert peaks[stage, 3] == peaks[stage, 1]
    assert peaks[1, 3] > peaks[1, 1]


ADAPTERS = LoraSetup(r=4, targets=("q_proj", "v_proj"))


def _qlora(stage: int, world: int, quantize: str = "nf4") -> tuple[StepGraph, StepGraph]:
    """The single-GPU step of a QLoRA (or 8-bit) setup, and rank 0's under DeepSpeed ZeRO ``stage``; every
    parameter partitioned at stage 3 (persistence off), as the checks below count them."""
    model = tiny_model("llama", **EVEN)
    setup = TrainingSetup(target=Target.CPU, batch_size=2, seq_len=32, dtype="bf16", quantize=quantize, lora=ADAPTERS)
    config = ZeroConfig(stage3_param_persistence_threshold=0)
    prepared = prepare(Layout(gpus=world, zero=stage, engine="deepspeed", zero_config=config), setup, model.config)
    step = build_graph(trace_step(model, prepared.traced))
    return step, prepared.rank_step(step, Rank())


def _ds_partition_numel(ds_numel: int, world: int) -> int:
    """DeepSpeed's own arithmetic: the parameter padded to a multiple of the world (``Init._aligned_size``),
    split evenly (``_partition_param``)."""
    rank = SimpleNamespace(_partition_world_size=lambda param: world)
    rank._padding_size = lambda param: Init._padding_size(rank, param)
    return Init._aligned_size(rank, SimpleNamespace(ds_numel=ds_numel)) // world


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_partitions_and_gathers_4bit_weights_stored_in_bf16(world):
    """PEFT's ZeRO-3 QLoRA recipe stores the packed weights in the compute dtype (``bnb_4bit_quant_storage=
    torch.bfloat16``), so ZeRO-3 partitions and gathers them like any bf16 parameter: each rank keeps its part
    of bitsandbytes' bf16 storage and the forward gathers the whole. The engine casts the adapters to bf16,
    and the fp32 master partition covers them only."""
    single, sharded = _qlora(3, world)
    packed = [row for row in single.storages.values() if row.role is Role.PARAMETER and row.dtype == "uint8"]
    assert packed
    for row in packed:
        storage, _ = functional.quantize_4bit(
            torch.zeros(2 * row.nbytes, dtype=torch.bfloat16), quant_type="nf4", quant_storage=torch.bfloat16
        )
        assert storage.nbytes == row.nbytes  # the same bytes as the uint8 packing traced
        ds_numel = storage.numel()
        assert sharded.storages[row.id].nbytes == _ds_partition_numel(ds_numel, world) * 2
        module = row.param.rpartition(".")[0]
        gathered = [r for r in sharded.storages.values() if r.name == f"{module} (gathered)"]
        assert gathered and all(r.nbytes == ds_numel * 2 for r in gathered)
    adapters = [row for row in single.storages.values() if row.role is Role.PARAMETER and "lora_" in (row.param or "")]
    assert adapters and all(row.dtype == "bfloat16" for row in adapters)
    master = next(row for row in sharded.storages.values() if row.name == "fp32 master partition")
    assert master.nbytes == 4 * sum(_ds_partition_numel(row.numel, world) for row in adapters)


@pytest.mark.parametrize(("stage", "quantize"), [(1, "int8"), (2, "nf4")])
def test_zero_1_and_2_leave_quantized_weights_whole(stage, quantize):
    """Below stage 3 ZeRO partitions what the optimizer holds, the adapters: the frozen quantized weights stay
    whole on every rank."""
    single, sharded = _qlora(stage, 4, quantize)
    frozen = [row for row in single.storages.values() if row.role is Role.PARAMETER and row.dtype in ("uint8", "int8")]
    assert frozen and all(sharded.storages[row.id].nbytes == row.nbytes for row in frozen)
    adapters = sum(row.numel for row in single.storages.values() if row.role is Role.GRADIENT)
    master = next(row for row in sharded.storages.values() if row.name == "fp32 master partition")
    assert master.nbytes == 4 * partition_numel(adapters, 4)


def test_8bit_weights_under_zero3_are_refused():
    setup = TrainingSetup(target=Target.CPU, dtype="bf16", quantize="int8", lora=ADAPTERS)
    with pytest.raises(UserError, match="--load-in-8bit with DeepSpeed ZeRO-3"):
        prepare(Layout(gpus=2, zero=3, engine="deepspeed"), setup, tiny_model("llama").config)
