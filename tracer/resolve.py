"""Turn what the user typed into a ``transformers`` config, without ever needing the network.

Order: a local directory or ``config.json`` path; the local Hugging Face cache; the configs bundled with
this package; the Hub, only when it answers quickly.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tracer.config_check import REQUIRED_FIELDS, check_config
from tracer.custom import CustomModel
from tracer.errors import UserError
from tracer.registry import BUNDLED_MODELS, find_bundled
from tracer.step import Batch, build_model, load_model, make_batch
from tracer.training import TrainingSetup

HUB_HOST = "huggingface.co"
HUB_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ResolvedModel:
    """A transformers model by its config, trained with its own loss (``model(input_ids, labels=labels).loss``)."""

    model_id: str
    config: PretrainedConfig
    source: str  # where the config came from, for the report
    # A multimodal checkpoint's whole config, of which ``config`` is the language model: serve counts its vision tower
    multimodal: PretrainedConfig | None = None
    # Why a multimodal checkpoint's whole config could not be built ("": it was, or the checkpoint has no vision tower)
    multimodal_missing: str = ""
    loss_fn: ClassVar[None] = None

    def build(self, setup: TrainingSetup) -> nn.Module:
        return build_model(self.config, setup)

    def load(self, setup: TrainingSetup, device: torch.device) -> nn.Module:
        """The model on ``device`` as ``from_pretrained`` loads it (tracer/step.py ``load_model``)."""
        return load_model(self.config, setup, device)

    def batch(self, setup: TrainingSetup, device: torch.device | str) -> Batch:
        return make_batch(self.config, setup, device)


# What the estimate traces: a transformers config, or a factory and a loss function (tracer/custom.py).
Model = ResolvedModel | CustomModel


def as_model(model: str | Model) -> Model:
    """A model given by id or path, resolved; one given as an object, as it is."""
    return resolve_model(model) if isinstance(model, str) else model


def resolve_model(model_id: str) -> ResolvedModel:
    """Find the config for ``model_id`` (a path, a cached or bundled model id, or a Hub id)."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise UserError(f"{model_id} is a directory without a config.json in it.")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise UserError(f"Config file {model_id} does not exist.")
        return _resolved(model_id, _read_json(path), str(path), f"file {path}")

    cached = _from_hf_cache(model_id)
    if cached is not None:
        return _resolved(model_id, _read_json(cached), str(cached), f"HF cache {cached}")
    bundled = find_bundled(model_id)
    if bundled is not None:
        return _resolved(bundled.model_id, bundled.load(), bundled.model_id, "bundled config")
    downloaded = _from_hub(model_id)
    if downloaded is not None:
        return _resolved(model_id, _read_json(downloaded), model_id, "Hugging Face Hub")
    close = closest_bundled(model_id)
    raise UserError(
        f"Unknown model {model_id!r}: not a local path, not in the Hugging Face cache, not bundled, and the Hub "
        "could not be reached. "
        + (f"Closest bundled: {', '.join(close)}. " if close else "")
        + "Or pass its config.json (or a directory holding it); `python -m tracer models` lists the bundled models."
    )


def _resolved(model_id: str, data: Any, where: str, source: str) -> ResolvedModel:
    text, how = language_model(data, where)
    config = config_from_dict(text, where)
    multimodal, missing = _multimodal(data, text)
    return ResolvedModel(model_id, config, source + (f"; {how}" if how else ""), multimodal, missing)


def _multimodal(data: Any, text: Any) -> tuple[PretrainedConfig | None, str]:
    """The whole config of a checkpoint that nests its language model beside a vision tower, or why transformers
    could not build it; (None, "") for a checkpoint without one."""
    if text is data or "vision_config" not in data:
        return None, ""
    try:
        return AutoConfig.for_model(**data), ""
    except (TypeError, ValueError, KeyError) as error:
        first = str(error).split(". ")[0]  # transformers' next sentences list every model type it knows
        return None, f"transformers cannot build this checkpoint's whole config: {first}"


def language_model(data: Any, where: str) -> tuple[Any, str | None]:
    """The config of the decoder to estimate, and how it was found when it is not the file's top level.

    A multimodal checkpoint (Gemma 3, Llama 4, Mistral Small 3.1, Qwen3-VL) nests its language model under
    ``text_config``; it is estimated alone, without the vision tower (the report says where AutoModelForCausalLM
    loads the checkpoint whole, as Gemma 3's). Gemma 3's files list only the fields that
    differ from its text config class's defaults, which transformers fills in: the size fields left out are read
    from those defaults too, and the report says which. A config whose ``model_type`` transformers
    does not know but whose ``architectures`` names one of its causal-LM classes (Kimi K2: a DeepSeek-V3 model
    shipped with its own code) is read as that class's config.
    """
    if not isinstance(data, dict):
        return data, None
    nested = data.get("text_config")
    if isinstance(nested, dict) and not any(field in data for field in ("hidden_size", "num_hidden_layers")):
        model_type = nested.get("model_type") or _sub_config_type(data.get("model_type"))
        if model_type is None:
            raise UserError(f'{where}: text_config has no "model_type" (e.g. "llama"); add it.')
        architecture = (data.get("architectures") or [data.get("model_type")])[0]
        how = f"the language model (text_config) of the {architecture} checkpoint; its vision tower is not counted"
        text = {**nested, "model_type": model_type}
        if model_type in CONFIG_MAPPING and data.get("model_type") in CONFIG_MAPPING:  # a checkpoint transformers knows
            class_defaults = CONFIG_MAPPING[model_type]()
            stored = class_defaults.attribute_map  # e.g. hidden_size -> n_embd
            defaulted = [
                field
                for field in REQUIRED_FIELDS
                if field not in text and stored.get(field) not in text and hasattr(class_defaults, field)
            ]
            text |= {stored.get(field, field): getattr(class_defaults, field) for field in defaulted}
            if defaulted:
                source = f"{type(class_defaults).__name__}'s defaults"
                how += f" ({', '.join(defaulted)} from {source}, as transformers reads it)"
        whole = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(data.get("model_type"))
        if whole is not None and whole != MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type):
            how += (
                f"; AutoModelForCausalLM loads this checkpoint whole ({whole}): such a run also holds the "
                "vision tower's and projector's weights, which a text-only step leaves without gradients"
            )
        return text, how
    model_type = data.get("model_type")
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        for architecture in data.get("architectures") or ():
            known = _CAUSAL_LM_TYPES.get(architecture)
            if known is not None:
                return {**data, "model_type": known}, f"model_type {model_type!r} read as {architecture}'s ({known})"
    return data, None


def _sub_config_type(model_type: Any) -> str | None:
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    text = getattr(CONFIG_MAPPING[model_type], "sub_configs", {}).get("text_config")
    return getattr(text, "model_type", None) or None


# A causal-LM class's model type: the first that names it, its own (transformers 5.24 maps sarvam_mla to
# DeepseekV3ForCausalLM too, after deepseek_v3), so the mapping is read backwards and the first write wins.
_CAUSAL_LM_TYPES = {
    class_name: model_type for model_type, class_name in reversed(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
}


def closest_bundled(model_id: str, count: int = 3) -> list[str]:
    """Bundled ids and aliases that look like ``model_id``: first those naming the same model once a variant
    suffix (-Instruct, -it, -chat, -Base, -hf) is dropped, then the closest spellings."""
    names = {name.lower(): name for model in BUNDLED_MODELS for name in (model.model_id, *model.aliases)}
    query = model_id.lower()
    same = [full for name, full in names.items() if _stem(name) == _stem(query)]
    short = {name.split("/")[-1]: full for name, full in names.items()}
    spelled = difflib.get_close_matches(query, names, n=count, cutoff=0.6)
    spelled += difflib.get_close_matches(query.split("/")[-1], short, n=count, cutoff=0.6)
    return list(dict.fromkeys([*same, *(names.get(name) or short[name] for name in spelled)]))[:count]


def _stem(name: str) -> str:
    return re.sub(r"-(instruct|it|chat|base|hf|pt)(-\d+)?$", "", name.split("/")[-1])


def config_from_dict(data: Any, where: str) -> PretrainedConfig:
    """Build a config, refusing ones that are not decoder LMs or that lack the fields that set the size."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a config must be a JSON object, got {type(data).__name__}.")
    model_type = data.get("model_type")
    if not model_type:
        raise UserError(f'{where}: the config has no "model_type" (e.g. "llama"); add it.')
    if not isinstance(model_type, str):
        raise UserError(f'{where}: "model_type" must be a string such as "llama", got {model_type!r}.')
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"{where}: model_type {model_type!r} has no causal-LM class in transformers; "
            "this tool estimates decoder language models."
        )
    check_config(data, CONFIG_MAPPING[model_type].attribute_map, where)  # e.g. num_hidden_layers -> n_layer
    try:
        return AutoConfig.for_model(**data)
    except (TypeError, ValueError) as error:  # strict dataclass validation raises TypeError subclasses
        reason = str(error).strip().splitlines()[-1].strip()
        raise UserError(f"{where}: transformers rejects this config: {reason}") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}).") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{path} is not UTF-8 text (byte {error.start}); save the config as UTF-8 JSON.") from None
    except OSError as error:
        raise UserError(f"Cannot read {path}: {error.strerror}.") from None


def _from_hf_cache(model_id: str) -> Path | None:
    if "/" not in model_id:
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # an id the hub library rejects is simply not cached
        return None
    return Path(found) if isinstance(found, str) else None


def _from_hub(model_id: str) -> Path | None:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or "/" not in model_id or not _hub_reachable():
        return None
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(model_id, "config.json", etag_timeout=HUB_TIMEOUT_S))
    except Exception:  # no such repo, gated repo, dropped connection: all mean "not available"
        return None


def _hub_reachable() -> bool:
    """One short connection attempt, so that an offline machine answers at once instead of retrying."""
    try:
        socket.create_connection((HUB_HOST, 443), timeout=HUB_TIMEOUT_S).close()
    except OSError:
        return False
    return True
