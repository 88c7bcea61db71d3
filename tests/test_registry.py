"""The bundled configs: every model the README promises, each building the published model size."""

from __future__ import annotations

import pytest
import torch

from analysis.estimate import analyze
from tracer.errors import UserError
from tracer.registry import BUNDLED_MODELS, find_bundled
from tracer.resolve import resolve_model
from tracer.step import build_model
from tracer.training import TrainingSetup

# Total parameters as published on the model cards (Hugging Face "Model size", or the paper's table where
# cited). A config with a wrong field builds a model whose size misses these by far more than 0.5%.
PUBLISHED_PARAMETERS = {
    "meta-llama/Llama-2-7b-hf": 6.74e9,
    "meta-llama/Llama-2-13b-hf": 13.0e9,
    "meta-llama/Llama-2-70b-hf": 69.0e9,
    "meta-llama/Meta-Llama-3-8B": 8.03e9,
    "meta-llama/Meta-Llama-3-70B": 70.6e9,
    "meta-llama/Llama-3.1-8B": 8.03e9,
    "meta-llama/Llama-3.1-70B": 70.6e9,
    "meta-llama/Llama-3.1-405B": 406e9,
    "meta-llama/Llama-3.2-1B": 1.24e9,
    "meta-llama/Llama-3.2-3B": 3.21e9,
    "mistralai/Mistral-7B-v0.1": 7.24e9,
    "mistralai/Mixtral-8x7B-v0.1": 46.7e9,
    "Qwen/Qwen2.5-0.5B": 0.494e9,
    "Qwen/Qwen2.5-7B": 7.62e9,
    "Qwen/Qwen2.5-72B": 72.7e9,
    "google/gemma-2-2b": 2.61e9,
    "google/gemma-2-9b": 9.24e9,
    "microsoft/Phi-3-mini-4k-instruct": 3.82e9,
    "facebook/opt-125m": 125e6,
    "facebook/opt-350m": 331e6,
    "facebook/opt-1.3b": 1.32e9,
    "facebook/opt-2.7b": 2.65e9,
    "facebook/opt-6.7b": 6.66e9,
    "bigscience/bloom-560m": 559e6,
    "bigscience/bloom-1b1": 1.07e9,
    "bigscience/bloom-1b7": 1.72e9,
    "bigscience/bloom-3b": 3.0e9,
    "openai-community/gpt2": 124e6,
    "openai-community/gpt2-medium": 355e6,
    "openai-community/gpt2-large": 774e6,
    "openai-community/gpt2-xl": 1.56e9,
    "EleutherAI/pythia-160m": 162_322_944,  # Pythia paper (arXiv 2304.01373), Table 1
    "EleutherAI/pythia-410m": 405_334_016,
    "EleutherAI/pythia-1b": 1_011_781_632,
    "EleutherAI/pythia-1.4b": 1_414_647_808,
    "EleutherAI/pythia-2.8b": 2_775_208_960,
    "EleutherAI/pythia-6.9b": 6_857_302_016,
    "EleutherAI/pythia-12b": 11_846_072_320,
    "tiiuae/falcon-7b": 6.92e9,
    "bigcode/starcoder": 15.5e9,
    "bigcode/octocoder": 15.5e9,
    # the checkpoint's own model.safetensors.index.json: total_size 54,864,793,600 bytes of float32 weights
    "allenai/OLMo-2-1124-13B": 13_716_198_400,
}

# 2025-2026 models, as their cards or reports round them: (published total, rounding step). The model's own
# parameters: DeepSeek's 14B multi-token-prediction module is not part of the causal LM (its card: "671B of
# the Main Model weights"), tied embeddings count once. The figures: Qwen3 cards' "Number of Parameters";
# gpt-oss model card (arXiv 2508.10925, Table 1); Gemma 3 report (arXiv 2503.19786, Table 1); Mistral's
# Mixtral 8x22B and Nemo announcements; Kimi K2's card ("Total Parameters 1T"); Phi-4-mini's card ("3.8B");
# the SmolLM2/3 cards; DeepSeek-V2-Lite's ("Total Params 15.7B"); Qwen3-Next's ("80B in total"). Where the
# configs come from: tracer/configs/SOURCES.md.
PUBLISHED_ROUNDED = {
    "Qwen/Qwen3-0.6B": (0.6e9, 0.1e9),
    "Qwen/Qwen3-1.7B": (1.7e9, 0.1e9),
    "Qwen/Qwen3-8B": (8.2e9, 0.1e9),
    "Qwen/Qwen3-14B": (14.8e9, 0.1e9),
    "Qwen/Qwen3-32B": (32.8e9, 0.1e9),
    "Qwen/Qwen3-30B-A3B": (30.5e9, 0.1e9),
    "Qwen/Qwen3-235B-A22B": (235e9, 1e9),
    "deepseek-ai/DeepSeek-V3": (671e9, 1e9),
    "deepseek-ai/DeepSeek-R1": (671e9, 1e9),
    "mistralai/Mixtral-8x22B-v0.1": (141e9, 1e9),
    "moonshotai/Kimi-K2-Instruct": (1.0e12, 0.1e12),
    "openai/gpt-oss-20b": (20.91e9, 0.01e9),
    "openai/gpt-oss-120b": (116.83e9, 0.01e9),
    "google/gemma-3-1b-it": (1000e6, 1e6),  # 302M embedding + 698M non-embedding
    "microsoft/Phi-4-mini-instruct": (3.8e9, 0.1e9),
    "mistralai/Mistral-Nemo-Base-2407": (12e9, 1e9),
    "HuggingFaceTB/SmolLM2-135M": (135e6, 1e6),
    "HuggingFaceTB/SmolLM2-360M": (360e6, 10e6),
    "HuggingFaceTB/SmolLM2-1.7B": (1.7e9, 0.1e9),
    "HuggingFaceTB/SmolLM3-3B": (3e9, 1e9),
    "deepseek-ai/DeepSeek-V2-Lite": (15.7e9, 0.1e9),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": (80e9, 1e9),
    # OLMo 2 7B and 32B as named; OLMoE's 6.9B total (AI2's announcement: "1.3 billion active parameters and 6.9
    # billion total"); Gemma 3 12B's language model (the card's 12B counts the SigLIP tower too)
    "allenai/OLMo-2-1124-7B": (7e9, 1e9),
    "allenai/OLMo-2-0325-32B": (32e9, 1e9),
    "allenai/OLMoE-1B-7B-0924": (6.9e9, 0.1e9),
    "google/gemma-3-12b-it": (12e9, 1e9),
}
# The same architecture as a model checked above (Llama 3.3's card: the Llama 3.1 70B architecture; OLMo 2's
# instruction-tuned checkpoint: post-trained from the base).
SAME_ARCHITECTURE = {
    "meta-llama/Llama-3.3-70B-Instruct": "meta-llama/Llama-3.1-70B",
    "allenai/OLMo-2-1124-13B-Instruct": "allenai/OLMo-2-1124-13B",
    "allenai/OLMo-2-1124-7B-Instruct": "allenai/OLMo-2-1124-7B",
    "allenai/OLMo-2-0325-32B-Instruct": "allenai/OLMo-2-0325-32B",
}

REQUIRED = [
    *PUBLISHED_PARAMETERS,
    "Salesforce/codegen-350M-mono",
    "Salesforce/codegen-2B-mono",
    "EleutherAI/gpt-neo-1.3B",
    "gpt2",
]


@pytest.mark.parametrize("model_id", REQUIRED)
def test_required_models_are_bundled(model_id):
    assert find_bundled(model_id) is not None


def test_lookup_ignores_case():
    assert find_bundled("META-LLAMA/llama-2-7B-HF").model_id == "meta-llama/Llama-2-7b-hf"


@pytest.mark.parametrize("model_id", list(PUBLISHED_PARAMETERS))
def test_bundled_config_builds_the_published_size(model_id):
    config = resolve_model(model_id).config
    with torch.device("meta"):
        model = build_model(config, TrainingSetup())
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - PUBLISHED_PARAMETERS[model_id]) / PUBLISHED_PARAMETERS[model_id] < 0.005, count


def _parameters(model_id: str) -> int:
    with torch.device("meta"):
        model = build_model(resolve_model(model_id).config, TrainingSetup())
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_id", list(PUBLISHED_ROUNDED))
def test_new_configs_build_the_published_size_as_rounded(model_id):
    published, step = PUBLISHED_ROUNDED[model_id]
    count = _parameters(model_id)
    assert abs(count - published) <= step / 2, count


@pytest.mark.parametrize(("model_id", "same_as"), list(SAME_ARCHITECTURE.items()))
def test_same_architecture(model_id, same_as):
    assert _parameters(model_id) == _parameters(same_as)


def test_every_bundled_config_builds():
    for bundled in BUNDLED_MODELS:
        with torch.device("meta"):
            build_model(resolve_model(bundled.model_id).config, TrainingSetup())


# Issue 17's list of the models people fine-tune and serve in 2026, as users type them (base, -Instruct, -it), and
# the ids a new user tried first.
LISTED_2026 = [
    *(f"Qwen/Qwen3-{size}" for size in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")),
    "Qwen/Qwen3-8B-Base",
    "Qwen/Qwen3-30B-A3B",
    "Qwen/Qwen3-235B-A22B",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "meta-llama/Llama-3.3-70B-Instruct",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "meta-llama/Llama-4-Maverick-17B-128E-Instruct",
    *(f"google/gemma-3-{size}-it" for size in ("1b", "4b", "12b", "27b")),
    "microsoft/phi-4",
    "microsoft/Phi-4-mini-instruct",
    "mistralai/Mistral-Nemo-Instruct-2407",
    "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
    "mistralai/Mixtral-8x22B-Instruct-v0.1",
    "deepseek-ai/DeepSeek-V3",
    "deepseek-ai/DeepSeek-R1",
    "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "openai/gpt-oss-20b",
    "openai/gpt-oss-120b",
    "allenai/OLMo-2-1124-7B-Instruct",
    "allenai/OLMo-2-1124-13B-Instruct",
    "allenai/OLMo-2-0325-32B-Instruct",
    "allenai/OLMoE-1B-7B-0924-Instruct",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "HuggingFaceTB/SmolLM3-3B",
    "zai-org/GLM-4.5",
    "zai-org/GLM-4.5-Air",
    "moonshotai/Kimi-K2-Instruct",
    "Qwen/Qwen2.5-7B-Instruct",
    "google/gemma-2-9b-it",
    "mistralai/Mixtral-8x7B-Instruct-v0.1",
]
# Not bundled: no copy of their config.json was found whole enough to bundle (tracer/configs/SOURCES.md).
NOT_BUNDLED = {
    "allenai/OLMo-2-0425-1B": "allenai/OLMo-2-",
    "allenai/OLMoE-1B-7B-0125": "allenai/OLMoE-1B-7B-0125-SFT",
}


@pytest.mark.slow
@pytest.mark.parametrize("model_id", LISTED_2026)
def test_every_listed_model_analyzes_offline(model_id, monkeypatch):
    """Each one traces a fine-tuning step and an inference step from its bundled config with the Hub unreachable."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("tracer.resolve._hub_reachable", lambda: False)
    for mode in ("train", "inference"):
        report = analyze(model_id, TrainingSetup(mode=mode, batch_size=1, seq_len=128, dtype="bf16"))
        assert report.peak_bytes > 0 and report.parameter_count > 0


@pytest.mark.parametrize(("model_id", "closest"), list(NOT_BUNDLED.items()))
def test_a_listed_model_not_bundled_names_the_closest(model_id, closest, monkeypatch):
    monkeypatch.setattr("tracer.resolve._hub_reachable", lambda: False)
    with pytest.raises(UserError, match=f"Closest bundled: {closest}"):
        resolve_model(model_id)
