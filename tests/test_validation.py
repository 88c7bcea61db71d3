"""Bad input, found before any tracing: one line that names the field or flag and the fix, exit status 2.

The cases are those a new user tried (issue 22): config fields of the wrong type or size, flags that are not
finite or do not apply, and library errors that escape while a model is traced.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_model

from analysis.cli import EXIT_USER_ERROR, main


def _config(tmp_path, family: str = "gpt2", **fields) -> str:
    data = json.loads(tiny_model(family).config.to_json_string())
    data.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def _one_line_error(capsys, argv: list[str], *fragments: str) -> None:
    assert main(argv) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], err


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_embd": "big"}, "n_embd must be a whole number, got 'big'"),
        ({"n_embd": 64.5}, "n_embd must be a whole number"),
        ({"n_layer": True}, "n_layer must be a whole number"),
        ({"n_head": 0}, "n_head must be at least 1"),
        ({"vocab_size": 0}, "vocab_size must be at least 1"),
        ({"n_layer": -1}, "n_layer must be at least 1"),
        ({"n_layer": 100_000}, "n_layer 100,000 is beyond 1,024"),
        ({"vocab_size": None}, "vocab_size must be a whole number"),
        ({"n_embd": 66}, "n_embd (66) must be a multiple of n_head (4)"),
        ({"model_type": ["gpt2"]}, '"model_type" must be a string'),
    ],
)
def test_config_fields(tmp_path, capsys, fields, message):
    _one_line_error(capsys, ["analyze", _config(tmp_path, **fields)], message)


def test_key_value_heads_must_divide_the_heads(tmp_path, capsys):
    path = _config(tmp_path, "llama", num_key_value_heads=3)
    _one_line_error(capsys, ["analyze", path], "num_key_value_heads (3) must divide num_attention_heads (4)")


def test_experts_per_token_within_the_experts(tmp_path, capsys):
    path = _config(tmp_path, "mixtral", num_experts_per_tok=9)
    _one_line_error(capsys, ["analyze", path], "num_experts_per_tok (9) exceeds the")


def test_config_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(tiny_model("gpt2").config.to_json_string().replace('"gpt2"', '"gpt2\u00e9"').encode("latin-1"))
    _one_line_error(capsys, ["analyze", str(path)], "is not UTF-8 text")


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    [
        ("plan", ["--gpu-memory", "1e400GiB"], "--gpu-memory takes a size"),
        ("plan", ["--gpu-memory", "nanGiB"], "--gpu-memory takes a size"),
        ("plan", ["--gpu-memory", "0.5B"], "--gpu-memory 0.5B is less than 1 MiB"),
        ("plan", ["--tflops", "nan"], "--tflops must be a finite positive number"),
        ("plan", ["--pcie-gbps", "nan"], "--pcie-gbps must be a finite positive number"),
        ("plan", ["--memory-gbps", "inf"], "--memory-gbps must be a finite positive number"),
        ("plan", ["--margin", "1"], "--margin must be in [0, 1)"),
        ("analyze", ["--lora-r", "0"], "--lora-r must be at least 1, got 0"),
        ("analyze", ["--lora-r", "4", "--lora-dropout", "1.5"], "--lora-dropout must be in [0, 1)"),
        ("analyze", ["--seq-len", "1e3"], "--seq-len takes a whole number, got '1e3'"),
        ("analyze", ["--seq-len", "99999999999"], "--seq-len must be at most 16,777,216"),
        ("analyze", ["--batch-size", "-3"], "--batch-size must be at least 1"),
        ("analyze", ["--dtype", "fp8"], "--dtype: invalid choice"),
        ("analyze", ["--lora-targets", "c_attn"], "--lora-targets sets up LoRA adapters: add --lora-r"),
        ("analyze", ["--lora-alpha", "32"], "--lora-alpha sets up LoRA adapters"),
        ("analyze", ["--mode", "inference", "--optimizer", "sgd"], "--optimizer does not apply to inference"),
        ("analyze", ["--max-new-tokens", "8"], "--max-new-tokens applies to generation: add --mode inference"),
        ("analyze", ["--cache", "static"], "--cache applies to generation"),
        ("analyze", ["--pcie-gbps", "10"], "--pcie-gbps times transfers to host memory: add --offload"),
        ("analyze", ["--target", "cpu", "--gpu", "a100"], "--gpu picks the GPU that --target cuda reproduces"),
        ("analyze", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_flags(tmp_path, capsys, command, flags, message):
    _one_line_error(capsys, [command, _config(tmp_path), "--seq-len", "16", *flags], message)


@pytest.mark.parametrize("where", ["a-file/t.png", "a-folder.png"])
def test_unwritable_output_is_refused_before_the_trace(tmp_path, capsys, monkeypatch, where):
    import analysis.estimate

    monkeypatch.setattr(analysis.estimate, "estimate", lambda *a, **k: pytest.fail("traced before checking -o"))
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder.png").mkdir()
    _one_line_error(capsys, ["timeline", _config(tmp_path), "-o", str(tmp_path / where)], "-o ")


def test_library_errors_while_tracing_name_the_model_and_op(tmp_path, capsys, monkeypatch):
    """Whatever escapes from transformers or torch during the trace becomes one line naming the op and module."""
    from transformers.models.llama import modeling_llama

    def broken(self, x):
        return x @ torch.ones(3, 5, dtype=x.dtype)  # a shape error raised by aten.matmul's kernel

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", broken)
    _one_line_error(
        capsys,
        ["analyze", _config(tmp_path, "llama"), "--seq-len", "16", "--quiet"],
        "Tracing",
        "failed at op aten.",
        "in model.layers.0.mlp",
        "RuntimeError",
        "TRACER_DEBUG=1",
    )


def test_errors_while_building_the_model_name_the_model(tmp_path, capsys, monkeypatch):
    import tracer.resolve

    def broken(config, setup):
        raise KeyError("rope_type")

    monkeypatch.setattr(tracer.resolve, "build_model", broken)
    _one_line_error(capsys, ["analyze", _config(tmp_path, "llama"), "--seq-len", "16", "--quiet"], "failed: KeyError")
