"""``tracer compare``: each category of the trace against eager execution on CPU, the formulas split as
their sources split them, and the explanation lines built from the trace's numbers."""

from __future__ import annotations

import json

import pytest
from accelerate.commands.estimate import estimate_training_usage

from analysis.categories import Category, category_profile
from analysis.cli import main
from analysis.comparison import compare
from analysis.estimate import estimate
from analysis.formulas import accelerate_training, formula_estimates, model_shape
from analysis.measure import measure_step
from strategies.layout import Layout
from tests.tiny_models import tiny_model
from tracer.training import LoraSetup, Target, TrainingSetup
from tracer.units import format_bytes

TOLERANCE = 0.001  # of the peak, as tests/test_accuracy_cpu.py
CPU_SETUPS = {
    "fp32": dict(),
    "mixed-bf16": dict(mixed_precision="bf16"),
    "bf16-lora": dict(dtype="bf16", lora=LoraSetup()),
    "checkpointing": dict(mixed_precision="bf16", grad_checkpointing="full"),
}


def _profiles(family: str, options: dict):
    model = tiny_model(family)
    setup = TrainingSetup(batch_size=2, seq_len=32, target=Target.CPU, **options)
    estimated, measured = estimate(model, setup), measure_step(model, setup)
    return (
        category_profile(estimated.step, estimated.line, estimated.report.peak_op_index),
        category_profile(measured.step, measured.line, measured.report.peak_op_index),
        measured.report.peak_bytes,
    )


@pytest.mark.parametrize("options", list(CPU_SETUPS.values()), ids=list(CPU_SETUPS))
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_every_category_matches_eager_execution(family, options):
    """The trace's split (what the table's "ours" columns print) against the same split of a real step
    whose storages were tracked as they lived and died."""
    ours, eager, peak = _profiles(family, options)
    for category in Category:
        assert abs(ours.at_peak[category] - eager.at_peak[category]) <= TOLERANCE * peak, category
        assert abs(ours.largest[category] - eager.largest[category]) <= TOLERANCE * peak, category
    assert eager.largest[Category.LOGITS_AND_LOSS] > 0


def test_the_split_at_the_peak_sums_to_the_peak_with_allocator_slack():
    result = estimate(tiny_model("llama"), TrainingSetup(batch_size=3, seq_len=17))
    profile = category_profile(result.step, result.line, result.report.peak_op_index)
    assert sum(profile.at_peak.values()) == result.report.peak_bytes
    assert all(profile.largest[c] >= profile.at_peak[c] for c in Category)


def test_logits_and_loss_hold_the_fp32_log_softmax():
    """At its largest the category holds at least log_softmax's fp32 output, b x s x vocab x 4 bytes (here
    the vocabulary is large enough for the loss to lead the peak)."""
    vocab, batch, seq = 32_000, 2, 64
    model = tiny_model("llama", vocab_size=vocab)
    result = estimate(model, TrainingSetup(batch_size=batch, seq_len=seq, mixed_precision="bf16"))
    profile = category_profile(result.step, result.line, result.report.peak_op_index)
    assert profile.largest[Category.LOGITS_AND_LOSS] >= batch * seq * vocab * 4
    assert profile.largest[Category.ACTIVATIONS] < batch * seq * vocab * 4


def test_strategy_buffers_are_not_logits():
    """Storages a strategy adds carry no module of their own; they are placed by the op that made them."""
    model = tiny_model("llama")
    setup = TrainingSetup(batch_size=2, seq_len=32)
    plain = estimate(model, setup)
    sharded = estimate(model, setup, Layout(gpus=2, zero=3))
    logits = [
        category_profile(r.step, r.line, r.report.peak_op_index).largest[Category.LOGITS_AND_LOSS]
        for r in (plain, sharded)
    ]
    assert logits[0] == logits[1]


def test_formula_terms_add_up_to_their_figures():
    model = tiny_model("llama")
    setup = TrainingSetup(batch_size=2, seq_len=64, mixed_precision="bf16")
    shape = model_shape(model, setup)
    for layout in (Layout(), Layout(gpus=4, zero=2), Layout(gpus=8, zero=3)):
        for formula in formula_estimates(shape, setup, layout):
            if formula.name != "accelerate":
                assert formula.total == sum(term.bytes for term in formula.terms.values()), formula.name


@pytest.mark.parametrize("options, precision", [({}, "float32"), ({"mixed_precision": "bf16"}, "bfloat16")])
def test_accelerate_terms_are_its_stages(options, precision):
    setup = TrainingSetup(**options)
    shape = model_shape(tiny_model("llama"), setup)
    stages = estimate_training_usage(4 * shape.parameters, precision)
    terms = accelerate_training(shape, setup).terms
    assert terms[Category.PARAMETERS].bytes == stages["model"]
    assert terms[Category.GRADIENTS].bytes == stages["gradients"]
    assert terms[Category.OPTIMIZER_STATES].bytes == stages["optimizer"]


def test_explanations_name_what_a_formula_leaves_out_with_its_share():
    """Sized so that both differences pass the 5%-of-the-peak bar: the logits of a 32k vocabulary, and the
    gradients of its embeddings (a hidden size of 96), with training's two cuBLAS workspaces in the peak."""
    model = tiny_model("llama", vocab_size=32_000, hidden_size=96)
    setup = TrainingSetup(batch_size=2, seq_len=64, mixed_precision="bf16")
    result = estimate(model, setup)
    shape = model_shape(model, setup)
    comparison = compare(result.report, result.step, result.line, shape, formula_estimates(shape, setup, Layout()))
    at_peak = comparison.profile.at_peak[Category.LOGITS_AND_LOSS]
    share = round(100 * at_peak / result.report.peak_bytes)
    line = next(text for text in comparison.explanations if "logits and loss not counted" in text)
    assert "Korthikanti" in line.split(":")[0]
    assert f"{format_bytes(at_peak)} at the peak ({share}% of it)" in line
    assert "_log_softmax (float32)" in line
    gradients = next(t for t in comparison.explanations if t.startswith("- 16 B/param") and "gradients" in t)
    assert "4.0 bytes per trainable parameter, float32" in gradients


def test_compare_json_has_categories_formulas_and_explanations(tmp_path, capsys):
    path = tmp_path / "config.json"
    tiny_model("llama").config.to_json_file(path)
    assert main(["compare", str(path), "--seq-len", "32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sum(entry["at_peak_bytes"] for entry in data["categories"].values()) == data["ours"]["peak_bytes"]
    assert {f["name"] for f in data["formulas"]} == {"16 B/param", "DeepSpeed", "accelerate", "LLMem", "Korthikanti"}
    assert data["explanations"]
