"""The analytic formulas compared against (analysis/formulas.py) equal their sources where those are
installed, and the ground-truth harness runs end to end (on CPU, where it checks itself, not memory)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from accelerate.commands.estimate import estimate_training_usage
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from analysis.formulas import (
    accelerate_training,
    deepspeed_model_states,
    korthikanti_activations,
    llmem,
    model_shape,
)
from strategies.layout import Layout
from tests.tiny_models import tiny_model
from tracer.training import TrainingSetup

SETUP = TrainingSetup(batch_size=2, seq_len=64)


@pytest.mark.parametrize("gpus, zero", [(1, 0), (4, 1), (4, 2), (8, 3)])
def test_deepspeed_model_states_equal_deepspeeds_estimators(gpus, zero):
    shape = model_shape(tiny_model("llama"), SETUP)
    layout = Layout(gpus=gpus, zero=zero)
    if zero == 3:
        _, expected, _ = estimate_zero3_model_states_mem_needs(
            shape.parameters, shape.largest_layer_parameters, num_gpus_per_node=gpus, cpu_offload=False
        )
    else:
        _, expected = estimate_zero2_model_states_mem_needs(shape.parameters, num_gpus_per_node=gpus, cpu_offload=False)
    assert deepspeed_model_states(shape, layout).total == expected


@pytest.mark.parametrize("options, precision", [({}, "float32"), ({"mixed_precision": "bf16"}, "bfloat16")])
def test_accelerate_estimate_equals_accelerates_peak(options, precision):
    setup = TrainingSetup(**options)
    shape = model_shape(tiny_model("llama"), setup)
    stages = estimate_training_usage(4 * shape.parameters, precision)
    assert accelerate_training(shape, setup).total == max(stages.values())


def test_korthikanti_activations_per_layer():
    shape = model_shape(tiny_model("llama"), SETUP)
    s, b, h, a = 64, 2, shape.hidden, shape.heads
    assert korthikanti_activations(shape, SETUP, Layout()).total == shape.layers * s * b * h * (34 + 5 * a * s / h)
    full = TrainingSetup(batch_size=2, seq_len=64, grad_checkpointing="full")
    assert korthikanti_activations(shape, full, Layout()).total == shape.layers * 2 * s * b * h


def test_llmem_covers_data_parallel_only():
    shape = model_shape(tiny_model("llama"), SETUP)
    assert llmem(shape, SETUP, Layout(gpus=2, tp=2)).total is None
    assert llmem(shape, SETUP, Layout(gpus=4, zero=3)).total > 0


@pytest.mark.parametrize(
    "layout",
    [
        {},
        pytest.param({"gpus": 2, "zero": 3}, marks=pytest.mark.slow),
        pytest.param(
            {"gpus": 2, "pp": 2, "pp_schedule": "interleaved-1f1b", "microbatches": 2}, marks=pytest.mark.slow
        ),
    ],
    ids=["one-gpu", "fsdp", "pipeline"],
)
def test_ground_truth_harness_runs_a_case(tmp_path, layout):
    config = tmp_path / "config.json"
    tiny_model("llama").config.to_json_file(config)
    case = {"model": str(config), "batch_size": 1, "seq_len": 16, "setup": {}, "layout": layout, "name": "tiny"}
    (tmp_path / "case.json").write_text(json.dumps(case))
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "benchmarks.ground_truth.run_case", str(tmp_path / "case.json"), str(out)]
    subprocess.run([*command, "--target", "cpu"], check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert result["case"] == case | {"allocator_capacity": 0} and result["environment"]["device"] == "cpu"
    if not layout:
        assert result["max_memory_allocated"] > 0
