"""Property-based tests of the command line: generated configs and flags, from the valid and the invalid side.

Invalid input gives exit status 2 and one line, before any tracing; valid input gives a finite, positive
estimate. Neither side may give a traceback or a NaN.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from analysis.cli import EXIT_USER_ERROR, main
from tracer.config_check import SIZE_LIMITS

FUZZ = settings(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _write(tmp_path, data: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def _no_trace(monkeypatch) -> None:
    import analysis.estimate

    monkeypatch.setattr(analysis.estimate, "estimate", lambda *a, **k: pytest.fail("invalid input reached the trace"))


def _assert_one_line_error(capsys, argv: list[str]) -> None:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USER_ERROR, argv
    assert len(err) == 1 and err[0].startswith("error: "), (argv, err)


LLAMA_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
BAD_SIZES = st.one_of(
    st.integers(max_value=0),
    st.sampled_from([SIZE_LIMITS["num_hidden_layers"] * 10**6, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.booleans(),
    st.lists(st.integers(min_value=1, max_value=8), max_size=2),
    st.none(),
)


@FUZZ
@given(field=st.sampled_from(LLAMA_SHAPE), value=BAD_SIZES)
def test_invalid_config_fields(tmp_path, capsys, monkeypatch, field, value):
    if value is None and field == "num_key_value_heads":
        value = 0  # null is valid there: as many key/value heads as heads
    _no_trace(monkeypatch)
    data = json.loads(tiny_model("llama").config.to_json_string()) | {field: value}
    _assert_one_line_error(capsys, ["analyze", _write(tmp_path, data), "--quiet"])


COUNT_FLAGS = ("--batch-size", "--seq-len", "--grad-accum", "--gpus", "--tp", "--lora-r", "--by-module")
RATE_FLAGS = ("--tflops", "--memory-gbps", "--interconnect-gbps", "--internode-gbps", "--pcie-gbps")
NOT_A_COUNT = st.one_of(
    st.integers(max_value=0).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet="abcxyz%.,-+ ", min_size=1, max_size=6),
)
NOT_A_RATE = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "NaN", "1e400", "0", "-0.0"]),
    st.floats(max_value=0).map(repr),
    st.text(alphabet="abcxyz%,-+ ", min_size=1, max_size=6),
)


@FUZZ
@given(flag=st.sampled_from(COUNT_FLAGS), value=NOT_A_COUNT)
def test_invalid_counts(tmp_path, capsys, monkeypatch, flag, value):
    _no_trace(monkeypatch)
    config = _write(tmp_path, json.loads(tiny_model("llama").config.to_json_string()))
    _assert_one_line_error(capsys, ["analyze", config, "--quiet", f"{flag}={value}"])


@FUZZ
@given(flag=st.sampled_from(RATE_FLAGS), value=NOT_A_RATE)
def test_invalid_rates(tmp_path, capsys, monkeypatch, flag, value):
    import analysis.plan

    monkeypatch.setattr(analysis.plan, "plan", lambda *a, **k: pytest.fail("invalid input reached the planner"))
    config = _write(tmp_path, json.loads(tiny_model("llama").config.to_json_string()))
    _assert_one_line_error(capsys, ["plan", config, "--quiet", f"{flag}={value}"])


@st.composite
def valid_runs(draw) -> tuple[dict, list[str]]:
    """A small llama-like config and a combination of flags that applies to it."""
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2]))
    config = json.loads(tiny_model("llama").config.to_json_string()) | {
        "num_hidden_layers": draw(st.integers(1, 3)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": heads * draw(st.sampled_from([8, 16])),
        "head_dim": None,
        "intermediate_size": draw(st.sampled_from([16, 48, 96])),
        "vocab_size": draw(st.integers(2, 300)),
    }
    flags = ["--batch-size", str(draw(st.integers(1, 3))), "--seq-len", str(draw(st.integers(1, 40)))]
    if draw(st.booleans()):
        flags += ["--mode", "inference", "--max-new-tokens", str(draw(st.integers(1, 4)))]
        flags += draw(st.sampled_from([[], ["--dtype", "bf16"], ["--cache", "static"], ["--logits-to-keep", "1"]]))
        return config, flags
    flags += draw(st.sampled_from([[], ["--mixed-precision", "bf16"], ["--dtype", "bf16"]]))
    flags += draw(st.sampled_from([[], ["--grad-checkpointing", "full"], ["--grad-checkpointing", "selective"]]))
    flags += draw(st.sampled_from([[], ["--lora-r", "4"], ["--optimizer", "sgd"], ["--grad-accum", "2"]]))
    flags += draw(st.sampled_from([[], ["--target", "cpu"], ["--gpus", "2", "--zero", "3"]]))
    return config, flags


@pytest.mark.slow
@settings(FUZZ, max_examples=25)
@given(run=valid_runs())
def test_valid_runs_give_a_finite_positive_estimate(tmp_path, capsys, run):
    config, flags = run
    config = {key: value for key, value in config.items() if value is not None}
    assert main(["analyze", _write(tmp_path, config), "--json", *flags]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert isinstance(report["peak_bytes"], int) and report["peak_bytes"] > 0
    numbers = [*report["breakdown"].values()]
    if "--target" not in flags:  # the CUDA caching allocator's view
        numbers.append(report["device_total_bytes"])
    assert all(isinstance(n, int) and n >= 0 and math.isfinite(n) for n in numbers), report
