"""``--config``: real configuration files from each framework's repository (tests/fixtures/run_configs,
SOURCES.md names each one's origin) read as the flags that framework's run means."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tiny_models import tiny_model

from analysis.cli import EXIT_USER_ERROR, main
from analysis.run_config import NO_MEMORY, UNKNOWN, read_config
from strategies.deepspeed import ZeroConfig

FIXTURES = Path(__file__).parent / "fixtures" / "run_configs"
ALL = sorted(p for p in FIXTURES.rglob("*") if p.suffix in (".json", ".yaml", ".yml", ".toml"))

# What each file means, read off the file and its framework's documented defaults (the comments say which).
EXPECTED = {
    "deepspeed/ds_config_zero3.json": {
        "engine": "deepspeed", "zero": 3, "offload": "optimizer,params", "optimizer": "adamw",
        "zero_config": ZeroConfig(
            reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto", overlap_comm=True,
        ),
    },  # fp16.enabled, the micro-batch and the accumulation are "auto": filled from the Trainer's arguments
    "deepspeed/axolotl_zero3_bf16_cpuoffload_all.json": {
        "engine": "deepspeed", "zero": 3, "offload": "optimizer,params", "mixed_precision": "bf16",
        "zero_config": ZeroConfig(
            reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto", stage3_max_live_parameters=0,
            stage3_max_reuse_distance=0, overlap_comm=True,
        ),  # DeepSpeedZeroConfig takes max_live_parameters as stage3_max_live_parameters
    },
    "deepspeed/accelerate_zero_stage2_offload_config.json": {
        "engine": "deepspeed", "zero": 2, "offload": "optimizer", "grad_accum": 1, "mixed_precision": "fp16",
        "optimizer": "adamw", "zero_config": ZeroConfig(reduce_bucket_size="auto", overlap_comm=True),
    },
    "accelerate/trl_fsdp2.yaml": {"gpus": 8, "mixed_precision": "bf16", "engine": "fsdp", "zero": 3},
    "accelerate/alignment_handbook_zero3.yaml": {
        "gpus": 8, "mixed_precision": "bf16", "engine": "deepspeed", "zero": 3,
    },
    "accelerate/multi_gpu.yaml": {"gpus": 2, "mixed_precision": "bf16", "zero": 0},
    "accelerate/deepspeed.yaml": {  # names zero_stage1_config.json, which enables fp16 and overlap_comm
        "gpus": 2, "engine": "deepspeed", "zero": 1, "grad_accum": 1, "mixed_precision": "fp16",
        "optimizer": "adamw", "zero_config": ZeroConfig(reduce_bucket_size="auto", overlap_comm=True),
    },
    "trainer/alignment_handbook_zephyr_sft_qlora.yaml": {  # TRL SFTConfig with TRL's ModelConfig
        "model": "mistralai/Mistral-7B-v0.1", "batch_size": 4, "seq_len": 2048, "grad_accum": 2,
        "lora_r": 16, "lora_alpha": 16, "lora_dropout": 0.05,
        "lora_targets": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "qlora": True, "dtype": "bf16",
        "grad_checkpointing": "full", "attn": "sdpa",  # use_reentrant: false
        "use_cache": "off",  # the HF Trainer sets config.use_cache from use_cache, False by default
    },
    "trainer/trl_cli_example_config.yaml": {  # TRL's defaults: checkpointing and bf16 on, max_length 1024
        "model": "Qwen/Qwen2.5-0.5B", "seq_len": 1024, "mixed_precision": "bf16", "grad_checkpointing": "full",
        "use_cache": "off",  # the HF Trainer sets config.use_cache from use_cache, False by default
    },
    "axolotl/llama3_qlora.yml": {
        "model": "NousResearch/Meta-Llama-3-8B", "batch_size": 2, "seq_len": 4096, "grad_accum": 4,
        "lora_r": 32, "lora_alpha": 16, "lora_dropout": 0.05, "lora_targets": "all-linear", "qlora": True,
        "dtype": "bf16", "grad_checkpointing": "full", "reentrant": True, "attn": "sdpa",
        "use_cache": "off",  # the HF Trainer sets config.use_cache from use_cache, False by default
    },  # axolotl's checkpointing is reentrant unless its kwargs say otherwise
    "axolotl/llama3_qlora_fsdp_70b.yaml": {
        "model": "casperhansen/llama-3-70b-fp16", "batch_size": 1, "seq_len": 512, "grad_accum": 4,
        "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_targets": "all-linear", "attn": "sdpa",
        "qlora": True, "dtype": "bf16", "engine": "fsdp", "zero": 3, "offload": "optimizer,params",
        "grad_checkpointing": "full", "reentrant": True, "optimizer": "adamw", "optimizer_impl": "fused",
        "use_cache": "off",  # the HF Trainer sets config.use_cache from use_cache, False by default
    },
    "torchtune/llama3_1_8B_lora_single_device.yaml": {
        "model": "meta-llama/Llama-3.1-8B", "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "batch_size": 2, "grad_accum": 8,
        "dtype": "bf16", "mixed_precision": "off", "grad_checkpointing": "full", "optimizer": "adamw",
        "optimizer_impl": "fused",
    },
    "torchtune/llama3_1_8B_full_single_device.yaml": {
        "model": "meta-llama/Llama-3.1-8B", "batch_size": 2, "grad_accum": 1, "dtype": "bf16",
        "mixed_precision": "off", "grad_checkpointing": "full", "optimizer": "adamw8bit",
    },
    "torchtitan/llama3_8b.toml": {  # selective_ac_option "op": torchtitan's per-op policy
        "model": "meta-llama/Llama-3.1-8B", "batch_size": 1, "seq_len": 8192, "zero": 3,
        "mixed_precision": "bf16", "engine": "fsdp", "optimizer": "adamw", "grad_checkpointing": "op",
    },
    "torchtitan/llama3_70b.toml": {
        "model": "meta-llama/Llama-3.1-70B", "batch_size": 8, "seq_len": 8192, "tp": 8, "zero": 3,
        "mixed_precision": "bf16", "engine": "fsdp", "grad_checkpointing": "full", "optimizer": "adamw",
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_real_file_reads_as_its_framework_runs_it(name):
    assert read_config(FIXTURES / name).values == EXPECTED[name]


@pytest.mark.parametrize("path", ALL, ids=lambda path: str(path.relative_to(FIXTURES)))
def test_every_key_is_read_or_left_out_with_a_reason(path):
    """No key is dropped silently: each top-level key set a flag, gave a note, or is listed with why."""
    read = read_config(path)
    data = yaml.safe_load(path.read_text()) if path.suffix != ".toml" else None
    if data is not None:
        assert set(data) <= read.used
    assert all(why for why in read.ignored.values())
    memory_keys = {"per_device_train_batch_size", "micro_batch_size", "zero_optimization", "gradient_checkpointing"}
    assert not any(read.ignored.get(key) in (NO_MEMORY, UNKNOWN) for key in memory_keys)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(tiny_model("llama", num_hidden_layers=2).config.to_json_string())
    return path


def _json(capsys, *argv: str) -> dict:
    code, out, err = _run(capsys, "analyze", *argv, "--seq-len", "32", "--json")
    assert code == 0, err
    return json.loads(out)


def test_a_config_file_is_the_flags_it_stands_for(tiny_config, capsys):
    """The Trainer's arguments with the DeepSpeed JSON they run with: its "auto" values filled from them."""
    trainer = FIXTURES / "trainer" / "alignment_handbook_zephyr_sft_full.yaml"
    files = ["--config", str(FIXTURES / "deepspeed" / "ds_config_zero3.json"), "--config", str(trainer)]
    read = _json(capsys, str(tiny_config), *files, "--gpus", "2", "--batch-size", "2")
    flags = _json(
        capsys, str(tiny_config), "--gpus", "2", "--zero", "3", "--engine", "deepspeed", "--offload",
        "optimizer,params", "--batch-size", "2", "--grad-accum", "1", "--dtype", "bf16", "--mixed-precision", "bf16",
        "--grad-checkpointing", "--optimizer", "adamw", "--use-cache", "off",
    )  # fmt: skip
    runtime = read["setup"].pop("data_parallel"), flags["setup"].pop("data_parallel")
    assert read["setup"] == flags["setup"]
    assert "reduce_bucket_size 4,096" in runtime[0]  # hidden 64: "auto" as the Trainer fills it
    assert "reduce_bucket_size 500,000,000" in runtime[1]  # DeepSpeed's default


def test_flags_win_over_the_file(tiny_config, capsys):
    torchtune = FIXTURES / "torchtune" / "llama3_1_8B_lora_single_device.yaml"
    report = _json(capsys, str(tiny_config), "--config", str(torchtune), "--batch-size", "1", "--lora-r", "4")
    assert report["setup"]["batch_size"] == 1 and report["setup"]["lora"]["r"] == 4
    assert report["setup"]["grad_accum"] == 8 and report["setup"]["dtype"] == "bf16"  # from the file
    [read] = report["config_files"]
    assert read["format"] == "torchtune" and read["flags"]["grad_accum"] == "8" and "loss" in read["ignored"]


def test_the_file_names_the_model(capsys):
    code, _, err = _run(capsys, "analyze", "--config", str(FIXTURES / "accelerate" / "multi_gpu.yaml"))
    assert code == EXIT_USER_ERROR and "name the model" in err and "Traceback" not in err


def test_the_summary_says_what_was_left_out(tiny_config, capsys):
    torchtitan = FIXTURES / "torchtitan" / "llama3_8b.toml"
    code, _, err = _run(
        capsys, "analyze", str(tiny_config), "--config", str(torchtitan), "--gpus", "2", "--seq-len", "32"
    )
    assert code == 0, err
    assert "--batch-size 1 --seq-len 8192 --zero 3" in err and "--grad-checkpointing op" in err
    assert "ignored compile" not in err and "ignored quantize" not in err  # both off in that file


@pytest.mark.parametrize(
    ("text", "suffix", "fragment"),
    [
        ("{not json", ".json", "is not valid JSON"),
        ("a: [1, 2", ".yaml", "is not valid YAML"),
        ("[training\nseq_len = 1", ".toml", "is not valid TOML"),
        ("- a\n- b\n", ".yaml", "expected a mapping"),
        ("colour: blue\n", ".yaml", "not a format this tool reads"),
        ('{"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}', ".json", "reduce_bucket_size"),
        ("base_model: x\nmicro_batch_size: 0\n", ".yaml", "--batch-size"),
    ],
)
def test_a_bad_file_is_one_clear_error(tiny_config, tmp_path, capsys, text, suffix, fragment):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    code, _, err = _run(capsys, "analyze", str(tiny_config), "--config", str(path))
    assert code == EXIT_USER_ERROR and "Traceback" not in err and fragment in err, err


def test_files_that_disagree_are_refused(tiny_config, tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text('{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}')
    second.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}')
    code, _, err = _run(capsys, "analyze", str(tiny_config), "--config", str(first), "--config", str(second))
    assert code == EXIT_USER_ERROR and "disagree" in err and "--batch-size 2" in err


def test_a_recipe_is_for_training(tiny_config, capsys):
    code, _, err = _run(capsys, "analyze", str(tiny_config), "--recipe", "trainer", "--mode", "inference")
    assert code == EXIT_USER_ERROR and "--recipe describes a framework's training step" in err


def test_a_recipe_prints_its_sources_and_flags_win(tiny_config, capsys):
    code, out, err = _run(
        capsys, "analyze", str(tiny_config), "--recipe", "torchtune", "--optimizer", "sgd", "--seq-len", "32", "--json"
    )
    assert code == 0, err
    assert "--recipe torchtune" in err and "lora_finetune_single_device.py" in err and "not modelled" in err
    setup = json.loads(out)["setup"]
    assert setup["dtype"] == "bf16" and setup["grad_checkpointing"] == "full" and setup["optimizer"] == "sgd"


def test_adapter_dtype_is_peft_autocast_adapter_dtype(tiny_config, capsys):
    """peft >= 0.11 keeps the adapters of a bf16 model in fp32; autocast_adapter_dtype=False keeps them bf16."""
    flags = ("--dtype", "bf16", "--lora-r", "8", "--seq-len", "32", "--target", "cpu")
    fp32 = _json(capsys, str(tiny_config), *flags)
    model = _json(capsys, str(tiny_config), *flags, "--adapter-dtype", "model")
    assert fp32["setup"]["lora"]["float32_adapters"] and not model["setup"]["lora"]["float32_adapters"]
    assert model["peak_bytes"] < fp32["peak_bytes"]
    code, _, err = _run(capsys, "analyze", str(tiny_config), "--adapter-dtype", "model")
    assert code == EXIT_USER_ERROR and "--adapter-dtype sets up LoRA adapters" in err
