"""The command line: output shape, and one clear message with exit status 2 for each bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import TINY_CONFIGS, tiny_model

from analysis import cli
from analysis.cli import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_USER_ERROR, main


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _config_file(tmp_path, family="llama", **overrides):
    path = tmp_path / "config.json"
    path.write_text(tiny_model(family, **overrides).config.to_json_string())
    return path


def test_analyze_json_has_the_stable_keys(tmp_path, capsys):
    code, out, _ = _run(capsys, "analyze", str(_config_file(tmp_path)), "--seq-len", "32", "--json")
    assert code == 0
    report = json.loads(out)
    assert isinstance(report["peak_bytes"], int) and report["peak_bytes"] > 0
    assert report["peak_phase"] in ("forward", "backward", "optimizer")
    assert report["peak_op"].startswith("aten.")
    assert "peak_module" in report
    assert sum(report["breakdown"].values()) == report["peak_bytes"]
    setup = report["setup"]
    for key in (
        "batch_size",
        "seq_len",
        "dtype",
        "mixed_precision",
        "optimizer",
        "attn",
        "target",
        "gpu",
        "allocation_rounding_bytes",
        "cublas_workspace_bytes",
        "step",
    ):
        assert key in setup


def test_ctrl_c_ends_with_one_line_and_the_shell_code(monkeypatch, capsys):
    def interrupted(args) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.RUNNERS, "gpus", interrupted)
    assert main(["gpus"]) == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("command", ["gpus", "models"], ids=["short output", "long output"])
def test_a_reader_that_leaves_early_gets_no_traceback(command):
    """``python -m tracer models | head -3``: the pipe closes before the output is written (or flushed at the end),
    and the program stops as a shell's SIGPIPE would, quietly."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tracer", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait() == EXIT_BROKEN_PIPE and "Traceback" not in stderr, stderr


def test_analyze_text_report(tmp_path, capsys):
    code, out, err = _run(
        capsys, "analyze", str(_config_file(tmp_path)), "--seq-len", "32", "--mixed-precision", "bf16"
    )
    assert code == 0
    assert "Estimated peak allocated memory" in out and "Breakdown at the peak" in out
    assert "forward" in err and "backward" in err  # the progress bar's stages
    assert err.rstrip().endswith("s.") and "Traced one training step" in err


@pytest.mark.parametrize(("gpu", "batch", "fits"), [("h100", 1, True), ("t4", 32, False)])
def test_analyze_says_whether_the_step_fits(capsys, gpu, batch, fits):
    """The verdict follows the planner's rule: reserved memory plus the CUDA context against the GPU less
    the margin."""
    argv = ["analyze", "gpt2", "--gpu", gpu, "--batch-size", str(batch), "--seq-len", "1024", "--quiet"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fit = data["fit"]
    assert fit["needed_bytes"] == data["device_total_bytes"]
    assert fit["fits"] is fits is (fit["needed_bytes"] <= fit["usable_bytes"])
    assert main(argv) == 0
    assert ("Fits the" if fits else "Does not fit the") in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--quiet", "--json"])
def test_progress_is_silent_with_quiet_or_json(tmp_path, capsys, flag):
    code, _, err = _run(capsys, "analyze", str(_config_file(tmp_path)), "--seq-len", "32", flag)
    assert code == 0 and err == ""


def test_a_config_directory_works(tmp_path, capsys):
    _config_file(tmp_path)
    code, out, _ = _run(capsys, "analyze", str(tmp_path), "--seq-len", "16", "--json", "--target", "cpu")
    assert code == 0 and json.loads(out)["setup"]["target"] == "cpu"


def _assert_user_error(code: int, err: str, *fragments: str) -> None:
    """Exit status 2, no traceback, and one error message as the last thing written (after progress, if any)."""
    assert code == EXIT_USER_ERROR
    assert "Traceback" not in err
    message = err[err.index("error: ") :]
    assert err.count("error: ") == 1
    for fragment in fragments:
        assert fragment in message, err


def test_unknown_model(capsys):
    code, _, err = _run(capsys, "analyze", "acme/no-such-model")
    _assert_user_error(code, err, "Unknown model 'acme/no-such-model'", "config.json", "python -m tracer models")


def test_unknown_model_names_the_closest_bundled_ids(capsys):
    code, _, err = _run(capsys, "analyze", "Qwen/Qwen3-8B-Instruct")
    _assert_user_error(code, err, "Closest bundled: Qwen/Qwen3-8B")


def test_multimodal_checkpoint_is_analyzed_as_its_language_model(tmp_path, capsys):
    """A config that nests its decoder under text_config (Gemma 3, Llama 4, Mistral Small 3.1) is the decoder."""
    from tracer.resolve import resolve_model

    assert "vision tower is not counted" in resolve_model("meta-llama/Llama-4-Scout-17B-16E-Instruct").source
    # AutoModelForCausalLM loads Gemma 3's multimodal checkpoints whole, Llama 4's as its language model
    assert (
        "loads this checkpoint whole (Gemma3ForConditionalGeneration)" in resolve_model("google/gemma-3-4b-it").source
    )
    assert "loads this checkpoint whole" not in resolve_model("meta-llama/Llama-4-Scout-17B-16E-Instruct").source
    text = json.loads(tiny_model("llama").config.to_json_string())
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llava",
                "architectures": ["LlavaForConditionalGeneration"],
                "text_config": text,
                "vision_config": {"model_type": "clip_vision_model"},
            }
        )
    )
    code, out, _ = _run(capsys, "analyze", str(path), "--seq-len", "16", "--json", "--quiet")
    report = json.loads(out)
    assert code == 0 and report["peak_bytes"] > 0
    assert "language model (text_config) of the LlavaForConditionalGeneration" in report["setup"]["model_source"]


def test_compact_multimodal_config_reads_defaults_as_transformers_does():
    """Gemma 3's Hub files leave out what equals the config classes' defaults (gemma-3-4b-it: its heads and
    vocabulary); the language model analyzed is the one transformers builds from the whole file."""
    from importlib.resources import files

    from transformers import AutoConfig

    from tracer.resolve import resolve_model

    whole = json.loads(files("tracer").joinpath("configs/google--gemma-3-4b-it.json").read_text())
    theirs = AutoConfig.for_model(**whole).text_config
    model = resolve_model("google/gemma-3-4b-it")
    for field in ("num_attention_heads", "vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads"):
        assert getattr(model.config, field) == getattr(theirs, field), field
    assert "num_attention_heads, vocab_size from Gemma3TextConfig's defaults" in model.source


def test_nested_config_keeps_its_own_field_names(tmp_path, capsys):
    """A nested text_config that names a size field its own way (GPT-2's n_embd) keeps it: only fields it leaves
    out come from its class's defaults."""
    from tracer.resolve import resolve_model

    text = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": text})
    )
    model = resolve_model(str(path))
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (64, 2, 50257)
    assert "vocab_size from GPT2Config's defaults" in model.source


def test_malformed_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64,')
    code, _, err = _run(capsys, "analyze", str(path))
    _assert_user_error(code, err, "is not valid JSON")


def test_incomplete_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 4}))
    code, _, err = _run(capsys, "analyze", str(path))
    _assert_user_error(code, err, "incomplete", "n_layer", "vocab_size")


def test_config_without_model_type(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64}))
    code, _, err = _run(capsys, "analyze", str(path))
    _assert_user_error(code, err, '"model_type"')


def test_missing_config_file(capsys):
    code, _, err = _run(capsys, "analyze", "no/such/config.json")
    _assert_user_error(code, err, "does not exist")


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--batch-size", "0", "--batch-size must be at least 1"),
        ("--seq-len", "0", "--seq-len must be at least 1"),
        ("--gpu", "tpu-v9", "Unknown GPU 'tpu-v9'"),
    ],
)
def test_bad_numbers_and_names(tmp_path, capsys, flag, value, message):
    code, _, err = _run(capsys, "analyze", str(_config_file(tmp_path)), flag, value)
    _assert_user_error(code, err, message)


@pytest.mark.parametrize(
    ("dtype", "autocast", "fragment"),
    [("bf16", "fp16", "not a recipe anyone runs"), ("fp16", "fp16", "the GradScaler refuses to unscale fp16")],
)
def test_mixed_precision_over_weights_it_cannot_train(tmp_path, capsys, dtype, autocast, fragment):
    """fp32 weights, or autocast over the weights' own bf16 (a bf16 checkpoint under the Trainer's bf16=True)."""
    code, _, err = _run(capsys, "analyze", str(_config_file(tmp_path)), "--dtype", dtype, "--mixed-precision", autocast)
    _assert_user_error(code, err, fragment)


def test_sequence_beyond_the_model_maximum_warns(tmp_path, capsys):
    code, out, err = _run(capsys, "analyze", str(_config_file(tmp_path)), "--seq-len", "300", "--json")
    assert code == 0 and json.loads(out)["peak_bytes"] > 0
    assert "warning: --seq-len 300 reaches position 300" in err and "max_position_embeddings (256)" in err


def test_generated_tokens_count_toward_the_model_maximum(tmp_path, capsys):
    argv = ["analyze", str(_config_file(tmp_path)), "--mode", "inference", "--seq-len", "250", "--json"]
    code, _, err = _run(capsys, *argv, "--max-new-tokens", "10")
    assert code == 0 and "--seq-len 250 + --max-new-tokens 10 reaches position 259" in err


def test_measure_refuses_positions_the_model_cannot_embed(tmp_path, capsys):
    """A real run past a learned position table ends in an IndexError; measure says so before running."""
    code, _, err = _run(capsys, "measure", str(_config_file(tmp_path, "gpt2")), "--seq-len", "300", "--target", "cpu")
    _assert_user_error(code, err, "max_position_embeddings (256)", "measure at most that many tokens")


@torch.library.custom_op("memtest::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_an_op_without_a_fake_kernel_is_named(tmp_path, capsys, monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: original(self, _opaque(x)))
    code, _, err = _run(capsys, "analyze", str(_config_file(tmp_path)), "--seq-len", "16")
    _assert_user_error(code, err, "memtest::opaque", "no FakeTensor")


def test_measure_on_cuda_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = _run(capsys, "measure", str(_config_file(tmp_path)), "--seq-len", "16")
    _assert_user_error(code, err, "--target cuda needs a CUDA GPU", "--target cpu")


def test_measure_on_cpu(tmp_path, capsys):
    code, out, _ = _run(capsys, "measure", str(_config_file(tmp_path)), "--seq-len", "16", "--target", "cpu", "--json")
    report = json.loads(out)
    assert code == 0 and report["kind"] == "measurement" and report["peak_bytes"] == report["tracked_peak_bytes"]


def test_models_lists_the_registry(capsys):
    code, out, _ = _run(capsys, "models", "--json")
    models = [row["model"] for row in json.loads(out)]
    assert code == 0 and len(models) >= 25 and "meta-llama/Llama-2-7b-hf" in models


def test_every_tiny_family_is_a_registry_family():
    from tracer.registry import BUNDLED_MODELS
    from tracer.resolve import resolve_model

    assert {resolve_model(model.model_id).config.model_type for model in BUNDLED_MODELS} == set(TINY_CONFIGS)


def test_measure_refuses_what_this_machine_cannot_hold(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("analysis.measure._available_bytes", lambda target: 1024**2)
    code, _, err = _run(capsys, "measure", str(_config_file(tmp_path)), "--seq-len", "16", "--target", "cpu")
    _assert_user_error(code, err, "Measuring needs about", "only 1.000 MiB is free", "python -m tracer analyze")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "0"], "--gpus must be at least 1"),
        (["--gpus", "6", "--tp", "4"], "--tp 4 must divide --gpus 6"),
        (["--gpus", "2", "--tp", "2", "--zero", "2"], "--zero 2 shards over the data-parallel group"),
        (["--gpus", "8", "--tp", "8"], "--tp 8 must divide the 4 attention heads"),
        (["--gpus", "4", "--engine", "deepspeed"], "DeepSpeed without ZeRO is not modelled"),
        (["--gpus", "4", "--sequence-parallel"], "apply to tensor parallelism"),
        (["--gpus", "2", "--tp", "2", "--seq-len", "31", "--sequence-parallel"], "must be a multiple of --tp 2"),
    ],
)
def test_impossible_layouts(tmp_path, capsys, flags, message):
    code, _, err = _run(capsys, "analyze", str(_config_file(tmp_path)), "--seq-len", "32", *flags)
    _assert_user_error(code, err, message)


def test_latent_attention_heads_must_split_evenly(tmp_path, capsys):
    """DeepSeek-V2's plan splits the query heads (q_proj) and the latent's keys and values (kv_b_proj), not k_proj."""
    config = str(_config_file(tmp_path, "deepseek_v2"))  # 4 heads
    code, _, err = _run(capsys, "analyze", config, "--seq-len", "32", "--gpus", "8", "--tp", "8")
    _assert_user_error(code, err, "--tp 8 must divide the 4 attention heads")


def test_pipeline_json_lists_every_stage(tmp_path, capsys):
    config = str(_config_file(tmp_path, num_hidden_layers=4))
    flags = ["--gpus", "2", "--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "3", "--json"]
    code, out, _ = _run(capsys, "analyze", config, "--seq-len", "32", *flags)
    assert code == 0
    report = json.loads(out)
    assert report["layout"] | {"pp": 2, "pp_schedule": "gpipe", "microbatches": 3} == report["layout"]
    assert [rank["rank"]["pp_stage"] for rank in report["ranks"]] == [0, 1]
    assert report["peak_bytes"] == max(rank["peak_bytes"] for rank in report["ranks"])


def test_parallel_json_lists_each_distinct_rank(tmp_path, capsys):
    config = str(_config_file(tmp_path, "gpt2", vocab_size=250))  # 250 rows do not split evenly over 8
    code, out, _ = _run(capsys, "analyze", config, "--seq-len", "17", "--gpus", "8", "--zero", "3", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["layout"] | {"gpus": 8, "tp": 1, "dp": 8, "zero": 3, "engine": "fsdp"} == report["layout"]
    ranks = report["ranks"]
    assert [rank["rank"]["global"] for rank in ranks] == [0, 7]  # uneven shards: the last rank pads differently
    assert report["peak_bytes"] == max(rank["peak_bytes"] for rank in ranks)
    for rank in ranks:
        assert sum(rank["breakdown"].values()) == rank["peak_bytes"]
        assert rank["breakdown"]["communication"] > 0


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("gpt2", "transformers defines none for GPT2"),
        ("llama4_text", "--tp in training: Llama4Text's MoE layer adds the routed experts' output"),
    ],
)
def test_tensor_parallelism_needs_a_modelled_plan(tmp_path, capsys, family, message):
    config = str(_config_file(tmp_path, family))
    code, _, err = _run(capsys, "analyze", config, "--seq-len", "32", "--gpus", "2", "--tp", "2")
    _assert_user_error(code, err, message)


def test_tensor_parallel_report(tmp_path, capsys):
    config = str(_config_file(tmp_path, "llama", num_key_value_heads=4))
    code, out, _ = _run(capsys, "analyze", config, "--seq-len", "32", "--gpus", "4", "--tp", "2", "--zero", "3")
    assert code == 0
    assert "4 GPUs: tensor parallel 2 x FSDP2 over 2" in out and "tensor_parallel" in out


@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_deepspeed_report(tmp_path, capsys, stage):
    config = str(_config_file(tmp_path))
    flags = ["--gpus", "4", "--engine", "deepspeed", "--zero", stage, "--mixed-precision", "bf16", "--json"]
    code, out, _ = _run(capsys, "analyze", config, "--seq-len", "32", *flags)
    assert code == 0
    report = json.loads(out)
    assert f"DeepSpeed ZeRO-{stage}" in report["setup"]["data_parallel"]
    assert "fp32 master weights" in report["setup"]["mixed_precision_recipe"]


@pytest.mark.parametrize(
    ("flags", "dtype", "mixed_precision"),
    [
        ([], "fp32", "bf16"),  # the HF Trainer's bf16=True recipe
        (["--gpu", "t4"], "fp32", "fp16"),  # no bf16 on sm75
        (["--dtype", "bf16"], "bf16", None),
        (["--mixed-precision", "off"], "fp32", None),
        (["--qlora"], "bf16", None),
        (["--mode", "inference"], "bf16", None),
    ],
)
def test_default_precision_is_what_people_run(tmp_path, capsys, flags, dtype, mixed_precision):
    code, out, _ = _run(capsys, "analyze", str(_config_file(tmp_path)), "--seq-len", "16", "--json", *flags)
    setup = json.loads(out)["setup"]
    assert code == 0 and (setup["dtype"], setup.get("mixed_precision")) == (dtype, mixed_precision)


def test_bare_grad_checkpointing_means_full(tmp_path, capsys):
    argv = ["analyze", str(_config_file(tmp_path)), "--seq-len", "16", "--json", "--grad-checkpointing"]
    code, out, _ = _run(capsys, *argv)
    assert code == 0 and json.loads(out)["setup"]["grad_checkpointing"] == "full"
