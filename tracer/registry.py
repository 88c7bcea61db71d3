"""Configs of popular models shipped inside the package, so that no download is ever needed.

Each file under ``configs/`` holds the architecture fields of the model's official ``config.json`` on the
Hugging Face Hub (https://huggingface.co/<model id>/blob/main/config.json). An alias shares its model's
architecture (an -Instruct, -it or -Base id of the same weights' shapes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class BundledModel:
    model_id: str
    aliases: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        return self.model_id.replace("/", "--") + ".json"

    def load(self) -> dict[str, Any]:
        text = resources.files("tracer").joinpath("configs").joinpath(self.filename).read_text()
        return json.loads(text)


BUNDLED_MODELS: tuple[BundledModel, ...] = (
    BundledModel("meta-llama/Llama-2-7b-hf", ("meta-llama/Llama-2-7b-chat-hf",)),
    BundledModel("meta-llama/Llama-2-13b-hf", ("meta-llama/Llama-2-13b-chat-hf",)),
    BundledModel("meta-llama/Llama-2-70b-hf", ("meta-llama/Llama-2-70b-chat-hf",)),
    BundledModel("meta-llama/Meta-Llama-3-8B", ("meta-llama/Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct")),
    BundledModel("meta-llama/Meta-Llama-3-70B", ("meta-llama/Llama-3-70B", "meta-llama/Meta-Llama-3-70B-Instruct")),
    BundledModel("meta-llama/Llama-3.1-8B", ("meta-llama/Meta-Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct")),
    BundledModel("meta-llama/Llama-3.1-70B", ("meta-llama/Meta-Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct")),
    BundledModel("meta-llama/Llama-3.1-405B", ("meta-llama/Meta-Llama-3.1-405B",)),
    BundledModel("meta-llama/Llama-3.2-1B", ("meta-llama/Llama-3.2-1B-Instruct",)),
    BundledModel("meta-llama/Llama-3.2-3B", ("meta-llama/Llama-3.2-3B-Instruct",)),
    BundledModel("mistralai/Mistral-7B-v0.1", ("mistralai/Mistral-7B-Instruct-v0.1",)),
    BundledModel("mistralai/Mixtral-8x7B-v0.1", ("mistralai/Mixtral-8x7B-Instruct-v0.1",)),
    BundledModel("Qwen/Qwen2.5-0.5B", ("Qwen/Qwen2.5-0.5B-Instruct",)),
    BundledModel("Qwen/Qwen2.5-7B", ("Qwen/Qwen2.5-7B-Instruct",)),
    BundledModel("Qwen/Qwen2.5-72B", ("Qwen/Qwen2.5-72B-Instruct",)),
    BundledModel("google/gemma-2-2b", ("google/gemma-2-2b-it",)),
    BundledModel("google/gemma-2-9b", ("google/gemma-2-9b-it",)),
    BundledModel("microsoft/Phi-3-mini-4k-instruct", ("microsoft/Phi-3-mini",)),
    BundledModel("facebook/opt-125m"),
    BundledModel("facebook/opt-350m"),
    BundledModel("facebook/opt-1.3b"),
    BundledModel("facebook/opt-2.7b"),
    BundledModel("facebook/opt-6.7b"),
    BundledModel("bigscience/bloom-560m"),
    BundledModel("bigscience/bloom-1b1"),
    BundledModel("bigscience/bloom-1b7"),
    BundledModel("bigscience/bloom-3b"),
    BundledModel("Salesforce/codegen-350M-mono"),
    BundledModel("Salesforce/codegen-2B-mono"),
    BundledModel("openai-community/gpt2", ("gpt2",)),
    BundledModel("openai-community/gpt2-medium", ("gpt2-medium",)),
    BundledModel("openai-community/gpt2-large", ("gpt2-large",)),
    BundledModel("openai-community/gpt2-xl", ("gpt2-xl",)),
    BundledModel("EleutherAI/gpt-neo-1.3B"),
    BundledModel("EleutherAI/pythia-160m"),
    BundledModel("EleutherAI/pythia-410m"),
    BundledModel("EleutherAI/pythia-1b"),
    BundledModel("EleutherAI/pythia-1.4b"),
    BundledModel("EleutherAI/pythia-2.8b"),
    BundledModel("EleutherAI/pythia-6.9b"),
    BundledModel("EleutherAI/pythia-12b"),
    BundledModel("tiiuae/falcon-7b"),
    BundledModel("bigcode/starcoder"),
    BundledModel("bigcode/octocoder"),
    # 2025-2026 releases; where each file was copied from is in configs/SOURCES.md.
    BundledModel("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B-Base",)),
    BundledModel("Qwen/Qwen3-1.7B", ("Qwen/Qwen3-1.7B-Base",)),
    BundledModel("Qwen/Qwen3-4B", ("Qwen/Qwen3-4B-Base",)),
    BundledModel("Qwen/Qwen3-8B", ("Qwen/Qwen3-8B-Base",)),
    BundledModel("Qwen/Qwen3-14B", ("Qwen/Qwen3-14B-Base",)),
    BundledModel("Qwen/Qwen3-32B"),
    BundledModel("Qwen/Qwen3-30B-A3B", ("Qwen/Qwen3-30B-A3B-Base",)),
    BundledModel("Qwen/Qwen3-235B-A22B"),
    BundledModel("meta-llama/Llama-3.3-70B-Instruct", ("meta-llama/Llama-3.3-70B",)),
    BundledModel("meta-llama/Llama-4-Scout-17B-16E-Instruct", ("meta-llama/Llama-4-Scout-17B-16E",)),
    BundledModel("meta-llama/Llama-4-Maverick-17B-128E-Instruct", ("meta-llama/Llama-4-Maverick-17B-128E",)),
    BundledModel("google/gemma-3-1b-it", ("google/gemma-3-1b-pt",)),
    BundledModel("microsoft/phi-4", ("microsoft/Phi-4",)),
    BundledModel("microsoft/Phi-4-mini-instruct", ("microsoft/Phi-4-mini",)),
    BundledModel("mistralai/Mistral-Nemo-Base-2407", ("mistralai/Mistral-Nemo-Instruct-2407",)),
    BundledModel("mistralai/Mistral-Small-3.1-24B-Instruct-2503", ("mistralai/Mistral-Small-3.1-24B-Base-2503",)),
    BundledModel("mistralai/Mixtral-8x22B-v0.1", ("mistralai/Mixtral-8x22B-Instruct-v0.1",)),
    BundledModel("deepseek-ai/DeepSeek-V3", ("deepseek-ai/DeepSeek-V3-Base", "deepseek-ai/DeepSeek-V3-0324")),
    BundledModel("deepseek-ai/DeepSeek-R1", ("deepseek-ai/DeepSeek-R1-0528",)),
    BundledModel("moonshotai/Kimi-K2-Instruct", ("moonshotai/Kimi-K2-Base",)),
    BundledModel("openai/gpt-oss-20b"),
    BundledModel("openai/gpt-oss-120b"),
    BundledModel("Qwen/Qwen3-Next-80B-A3B-Instruct", ("Qwen/Qwen3-Next-80B-A3B-Thinking",)),
    BundledModel("zai-org/GLM-4.5-Air"),
    BundledModel("zai-org/GLM-4.5"),
    BundledModel("deepseek-ai/DeepSeek-V2-Lite", ("deepseek-ai/DeepSeek-V2-Lite-Chat",)),
    BundledModel("google/gemma-3-4b-it", ("google/gemma-3-4b-pt",)),
    BundledModel("google/gemma-3-27b-it", ("google/gemma-3-27b-pt",)),
    BundledModel("HuggingFaceTB/SmolLM2-135M", ("HuggingFaceTB/SmolLM2-135M-Instruct",)),
    BundledModel("HuggingFaceTB/SmolLM2-360M", ("HuggingFaceTB/SmolLM2-360M-Instruct",)),
    BundledModel("HuggingFaceTB/SmolLM2-1.7B", ("HuggingFaceTB/SmolLM2-1.7B-Instruct",)),
    BundledModel("HuggingFaceTB/SmolLM3-3B", ("HuggingFaceTB/SmolLM3-3B-Base",)),
    BundledModel("allenai/OLMo-2-1124-13B"),
    BundledModel("allenai/OLMo-2-1124-13B-Instruct"),  # its own file: stored in bf16, the base in fp32
    BundledModel("allenai/OLMo-2-1124-7B"),
    BundledModel(
        "allenai/OLMo-2-1124-7B-Instruct", ("allenai/OLMo-2-1124-7B-SFT", "allenai/OLMo-2-1124-7B-DPO")
    ),  # bf16, the base fp32
    BundledModel("allenai/OLMo-2-0325-32B"),
    BundledModel(
        "allenai/OLMo-2-0325-32B-Instruct", ("allenai/OLMo-2-0325-32B-SFT", "allenai/OLMo-2-0325-32B-DPO")
    ),  # bf16, the base fp32
    BundledModel(
        "allenai/OLMoE-1B-7B-0924",
        ("allenai/OLMoE-1B-7B-0924-Instruct", "allenai/OLMoE-1B-7B-0125-SFT", "allenai/OLMoE-1B-7B-0125-DPO"),
    ),
    BundledModel("google/gemma-3-12b-it", ("google/gemma-3-12b-pt",)),
)

_BY_NAME = {name.lower(): model for model in BUNDLED_MODELS for name in (model.model_id, *model.aliases)}


def find_bundled(model_id: str) -> BundledModel | None:
    """The bundled model for an id or alias (case-insensitive), or None."""
    return _BY_NAME.get(model_id.lower())
