"""The estimate against eager execution on CPU: same kernels on both sides, so they must agree.

``analyze`` traces the step on fake tensors; ``measure`` runs it with real tensors and counts every live
storage. Any difference beyond 0.1% is a semantic the trace misses.
"""

from __future__ import annotations

import pytest
from tiny_models import FAMILIES, LONGROPE, LONGROPE_DECODE_APART, tiny_model

from analysis.estimate import analyze
from analysis.measure import measure
from tracer.training import Target, TrainingSetup

TOLERANCE = 0.001

SETUPS = {
    "fp32-adamw": dict(),
    "bf16-adamw": dict(dtype="bf16"),
    "mixed-bf16-adamw": dict(mixed_precision="bf16"),
    "mixed-fp16-adamw": dict(mixed_precision="fp16"),
    "fp32-sgd": dict(optimizer="sgd"),
    "mixed-bf16-sgd": dict(mixed_precision="bf16", optimizer="sgd"),
}
SHAPES = {"b2-s32": (2, 32), "b3-s17": (3, 17)}


def check(family: str, shape: tuple[int, int], options: dict) -> None:
    model = tiny_model(family)
    setup = TrainingSetup(batch_size=shape[0], seq_len=shape[1], target=Target.CPU, **options)
    estimate = analyze(model, setup)
    measured = measure(model, setup)
    error = abs(estimate.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    assert error <= TOLERANCE, (
        f"{family} {shape} {options}: estimated {estimate.peak_bytes} at {estimate.peak_op} in "
        f"{estimate.peak_module!r}, measured {measured.peak_bytes} at {measured.peak_op} in {measured.peak_module!r}"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_in_the_default_recipe(family):
    """Mixed bf16, the command line's default; test_sweep (slow tier) adds fp32, bf16, fp16 and SGD."""
    check(family, SHAPES["b3-s17"], SETUPS["mixed-bf16-adamw"])


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_sweep(family, shape, setup):
    check(family, SHAPES[shape], SETUPS[setup])


MOE_AND_2025_FAMILIES = [
    "mixtral",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "gpt_oss",
    "gemma3_text",
    "llama4_text",
    "smollm3",
    "deepseek_v2",
    "glm4_moe",
    "qwen3_next",
    "olmo2",
    "olmoe",
]
ALTERNATING = {"layer_types": ["sliding_attention", "full_attention"] * 2}
FOUR_LAYERS = {"gpt_oss": ALTERNATING, "gemma3_text": ALTERNATING, "smollm3": {"no_rope_layers": [1, 1, 1, 0]}}


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"mixed_precision": "bf16", "grad_checkpointing": "full"}])
@pytest.mark.parametrize("family", MOE_AND_2025_FAMILIES)
def test_peak_inside_the_layers(family, options):
    """A vocabulary of 16 moves the peak off the loss into the decoder layers (experts, latent attention,
    sliding windows, NoPE layers), where these families differ."""
    model = tiny_model(family, vocab_size=16, num_hidden_layers=4, **FOUR_LAYERS.get(family, {}))
    setup = TrainingSetup(batch_size=2, seq_len=64, target=Target.CPU, **options)
    estimate, measured = analyze(model, setup), measure(model, setup)
    assert estimate.peak_module.startswith("model.layers") or estimate.peak_module == "model.norm"
    assert abs(estimate.peak_bytes - measured.peak_bytes) <= TOLERANCE * measured.peak_bytes, (
        f"{family} {options}: estimated {estimate.peak_bytes} at {estimate.peak_op} in {estimate.peak_module!r}, "
        f"measured {measured.peak_bytes} at {measured.peak_op} in {measured.peak_module!r}"
    )


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom"])
def test_eager_attention(family):
    check(family, SHAPES["b2-s32"], dict(attn="eager", mixed_precision="bf16"))


# RoPE variants whose frequencies depend on the positions: the real run branches on ``torch.max(position_ids) + 1``
# (tracer/known_values.py), and the trace must take the same branch. Longrope (Phi-3, Phi-4-mini) uses its short
# factors up to original_max_position_embeddings (32 here) and its long ones beyond; dynamic NTK regrows its
# frequencies past max_position_embeddings (32 here). The positions below, at the prompt and after generating,
# lie on either side and across.
DYNAMIC_NTK = dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=32)
ROPE = {"longrope": ("phi3", LONGROPE), "dynamic": ("llama", DYNAMIC_NTK)}
# generate() also makes a few scalars the trace does not repeat (tests/test_inference.py's tolerance)
GENERATE_TOLERANCE = 0.01


@pytest.mark.parametrize("seq_len", [24, 48])
@pytest.mark.parametrize("rope", list(ROPE))
def test_rope_that_branches_on_positions_in_training(rope, seq_len):
    family, overrides = ROPE[rope]
    model = tiny_model(family, **overrides)
    setup = TrainingSetup(batch_size=2, seq_len=seq_len, target=Target.CPU)
    estimate, measured = analyze(model, setup), measure(model, setup)
    assert abs(estimate.peak_bytes - measured.peak_bytes) <= TOLERANCE * measured.peak_bytes


# (prompt, new tokens): below the threshold throughout, above it from the prompt on, and crossing it while decoding.
# Phi-3's generate() drops the cache at the token that crosses original_max_position_embeddings and runs the whole
# sequence again into a new one, the old cache alive meanwhile (a prefill the trace follows): at the first decode
# step (32, 5), in the middle (24, 24), at the last (24, 10), and with a static cache, which the refill replaces by
# a dynamic one.
@pytest.mark.parametrize(
    ("rope", "prompt", "new_tokens", "cache"),
    [
        ("longrope", 24, 8, "dynamic"),
        ("longrope", 40, 8, "dynamic"),
        ("longrope", 32, 5, "dynamic"),
        pytest.param("longrope", 24, 24, "dynamic", marks=LONGROPE_DECODE_APART),
        ("longrope", 24, 10, "dynamic"),
        ("longrope", 24, 24, "static"),
        ("dynamic", 16, 8, "dynamic"),
        ("dynamic", 28, 8, "dynamic"),
        ("dynamic", 40, 8, "dynamic"),
    ],
)
def test_rope_that_branches_on_positions_in_generate(rope, prompt, new_tokens, cache):
    family, overrides = ROPE[rope]
    model = tiny_model(family, **overrides)
    setup = TrainingSetup(
        batch_size=2, seq_len=prompt, max_new_tokens=new_tokens, target=Target.CPU, mode="inference", cache=cache
    )
    estimated, measured = analyze(model, setup).phase_peaks, measure(model, setup).phase_peaks
    measured["prefill"] = max(measured.pop("forward", 0), measured["prefill"])  # generate()'s set-up, then prefill
    for phase, peak in measured.items():
        assert abs(estimated[phase] - peak) <= GENERATE_TOLERANCE * peak, phase
