"""Check the fields of a config that shape the model before anything is built from it.

transformers accepts a ``num_attention_heads`` of 0 or a ``vocab_size`` of -5 and fails much later, deep inside
a layer or the trace; a config with 100,000 layers would trace for hours. Each field that sets a size must be a
positive integer no larger than any released model needs, and the heads must split as attention splits them.
Every failure is one :class:`UserError` that names the field and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracer.errors import UserError

# Upper bounds, each well beyond the largest released model (in brackets), so that a typo or a generated config
# is refused before a trace that would never finish; tracing time grows with the layers and the experts.
SIZE_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1_024,  # Llama-3.1-405B: 126
    "hidden_size": 131_072,  # Llama-3.1-405B: 16,384
    "num_attention_heads": 1_024,  # Llama-3.1-405B: 128
    "num_key_value_heads": 1_024,
    "head_dim": 4_096,  # Gemma 2: 256
    "intermediate_size": 1_048_576,  # Llama-3.1-405B: 53,248
    "vocab_size": 4_194_304,  # Gemma 2: 256,000
    "max_position_embeddings": 16_777_216,  # Llama 4 Scout: 10,485,760
    "num_local_experts": 4_096,  # DeepSeek-V3: 256 routed experts
    "num_experts": 4_096,
    "n_routed_experts": 4_096,
    "num_experts_per_tok": 4_096,
    "moe_intermediate_size": 1_048_576,
    "n_inner": 1_048_576,
    "kv_lora_rank": 65_536,
    "q_lora_rank": 65_536,
    "qk_rope_head_dim": 4_096,
    "qk_nope_head_dim": 4_096,
    "v_head_dim": 4_096,
}
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# The fields a MoE config counts its routed experts in (Mixtral and gpt-oss, Qwen-MoE, DeepSeek).
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_config(data: Mapping[str, Any], attribute_map: Mapping[str, str], where: str) -> None:
    """Refuse a config whose sizes no model can have. ``attribute_map`` is the config class's aliasing
    (e.g. GPT-2's ``n_embd`` for ``hidden_size``): messages name the field as the file spells it."""
    missing = [f for f in REQUIRED_FIELDS if f not in data and attribute_map.get(f) not in data]
    if missing:
        names = ", ".join(attribute_map.get(f, f) for f in missing)
        raise UserError(f"{where}: the config is incomplete; it lacks {names}.")
    sizes = {}
    for field, limit in SIZE_LIMITS.items():
        name = _spelled(field, attribute_map, data)
        if name not in data or (data[name] is None and field not in REQUIRED_FIELDS):
            continue
        sizes[field] = _size(data[name], name, limit, where)
    heads, kv_heads = sizes["num_attention_heads"], sizes.get("num_key_value_heads")
    if kv_heads is not None and heads % kv_heads:
        raise UserError(
            f"{where}: {_spelled('num_key_value_heads', attribute_map, data)} ({kv_heads}) must divide "
            f"{_spelled('num_attention_heads', attribute_map, data)} ({heads}): each key/value head serves an "
            "equal group of query heads."
        )
    if "head_dim" not in sizes and sizes["hidden_size"] % heads:
        raise UserError(
            f"{where}: {_spelled('hidden_size', attribute_map, data)} ({sizes['hidden_size']}) must be a multiple "
            f"of {_spelled('num_attention_heads', attribute_map, data)} ({heads}), or the config must give head_dim."
        )
    experts = next((sizes[f] for f in EXPERT_COUNTS if f in sizes), None)
    if experts is not None and sizes.get("num_experts_per_tok", 1) > experts:
        raise UserError(f"{where}: num_experts_per_tok ({sizes['num_experts_per_tok']}) exceeds the {experts} experts.")


def _size(value: Any, name: str, limit: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where}: {name} must be a whole number, got {value!r}.")
    if value < 1:
        raise UserError(f"{where}: {name} must be at least 1, got {value}.")
    if value > limit:
        raise UserError(
            f"{where}: {name} {value:,} is beyond {limit:,}, far more than any released model has; "
            "such a model is refused rather than traced for hours."
        )
    return value


def _spelled(field: str, attribute_map: Mapping[str, str], data: Mapping[str, Any]) -> str:
    alias = attribute_map.get(field)
    return alias if alias in data else field
