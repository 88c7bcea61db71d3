"""Turn what the user typed into a ``transformers`` config, without ever needing the network.

Order: a local directory or ``config.json`` path; the local Hugging Face cache; the configs bundled with
this package; the Hub, only when it answers quickly.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tracer.errors import UserError
from tracer.registry import find_bundled

# Every decoder needs these to have a size; transformers silently fills defaults for missing ones, which
# would estimate some other model. Keys are config attributes after ``attribute_map`` aliasing.
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

HUB_HOST = "huggingface.co"
HUB_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class ResolvedModel:
    model_id: str
    config: PretrainedConfig
    source: str  # where the config came from, for the report


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
        return ResolvedModel(model_id, config_from_dict(_read_json(path), str(path)), f"file {path}")

    cached = _from_hf_cache(model_id)
    if cached is not None:
        return ResolvedModel(model_id, config_from_dict(_read_json(cached), str(cached)), f"HF cache {cached}")
    bundled = find_bundled(model_id)
    if bundled is not None:
        return ResolvedModel(bundled.model_id, config_from_dict(bundled.load(), bundled.model_id), "bundled config")
    downloaded = _from_hub(model_id)
    if downloaded is not None:
        return ResolvedModel(model_id, config_from_dict(_read_json(downloaded), model_id), "Hugging Face Hub")
    raise UserError(
        f"Unknown model {model_id!r}: it is not a local path, not in the Hugging Face cache, not bundled, "
        "and the Hub could not be reached.\n"
        "Pass a config instead: `python -m tracer analyze path/to/config.json` (or a directory holding "
        "config.json). `python -m tracer models` lists the bundled models."
    )


def config_from_dict(data: Any, where: str) -> PretrainedConfig:
    """Build a config, refusing ones that are not decoder LMs or that lack the fields that set the size."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a config must be a JSON object, got {type(data).__name__}.")
    model_type = data.get("model_type")
    if not model_type:
        raise UserError(f'{where}: the config has no "model_type" (e.g. "llama"); add it.')
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"{where}: model_type {model_type!r} has no causal-LM class in transformers; "
            "this tool estimates decoder language models."
        )
    stored_name = AutoConfig.for_model(model_type).attribute_map  # e.g. num_hidden_layers -> n_layer
    missing = [f for f in REQUIRED_FIELDS if f not in data and stored_name.get(f) not in data]
    if missing:
        names = ", ".join(stored_name.get(f, f) for f in missing)
        raise UserError(f"{where}: the config is incomplete; it lacks {names}.")
    try:
        return AutoConfig.for_model(**data)
    except (TypeError, ValueError) as error:
        raise UserError(f"{where}: transformers rejects this config: {error}") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not valid JSON ({error.msg} at line {error.lineno}).") from None
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
