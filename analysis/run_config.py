"""A run's own configuration files, read as the command line's flags (``--config FILE``, repeatable; flags
given on the command line win).

One reader per format maps every key that changes memory onto a flag (its argparse ``dest``) and says why
it left each other key out: it does not change the step's memory, it does and is not modelled, or the
reader does not know it. ``"auto"`` values are left for another file or the flags to fill, as the Trainer
fills them from its arguments; DeepSpeed's hidden-size sizes are filled in strategies/deepspeed.py.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from strategies.deepspeed import AUTO, ZeroConfig
from tracer.errors import UserError
from tracer.training import DTYPES

NO_MEMORY = "does not change the step's memory"
UNKNOWN = "not a key this reader knows: if it changes memory, give the matching flag"


@dataclass
class ReadConfig:
    """What one file says, as flags: ``values`` by argparse dest; ``notes`` on how keys were read;
    ``ignored`` keys with the reason."""

    path: Path
    kind: str
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)

    def set(self, dest: str, value: Any, key: str) -> None:
        """``key`` of the file sets the flag ``dest``; ``"auto"`` and empty values leave it to the others."""
        self.use(key)
        if value is None or value == AUTO:
            if value == AUTO:
                self.notes.append(f"{key}: auto, filled from the other settings (another --config or the flags)")
            return
        self.values[dest] = value

    def use(self, *keys: str) -> None:
        self.used.update(key.split(".")[0] for key in keys)

    def ignore(self, key: str, why: str = NO_MEMORY) -> None:
        self.ignored[key] = why
        self.use(key)

    def ignore_rest(self, data: dict) -> None:
        """Top-level keys no rule read: those known not to change memory, the rest named as unknown."""
        for key in data:
            if key not in self.used:
                self.ignore(key, NO_MEMORY if _irrelevant(key) else UNKNOWN)

    def include(self, inner: ReadConfig, key: str) -> None:
        """Another file this one points to (a DeepSpeed JSON named by an accelerate or Trainer config); values
        this file set itself win."""
        self.values = inner.values | self.values
        self.notes += [f"{key}: read {inner.path}", *inner.notes]
        self.ignored |= {f"{inner.path.name}: {name}": why for name, why in inner.ignored.items()}

    def summary(self) -> list[str]:
        """Lines for the user: the flags this file stands for, how keys were read, what was left out."""
        flags = " ".join(as_flag(dest, value) for dest, value in self.values.items())
        lines = [f"{self.path} ({self.kind}): {flags or 'no setting that changes memory'}"]
        lines += [f"  {note}" for note in self.notes]
        lines += [f"  ignored {key}: {why}" for key, why in self.ignored.items() if why != NO_MEMORY]
        quiet = sorted(key for key, why in self.ignored.items() if why == NO_MEMORY)
        if quiet:
            lines.append(f"  ignored, as they do not change memory: {', '.join(quiet)}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "format": self.kind,
            "flags": {dest: str(value) for dest, value in self.values.items()},
            "notes": self.notes,
            "ignored": self.ignored,
        }


def as_flag(dest: str, value: Any) -> str:
    """How the command line says it."""
    if dest == "model":
        return str(value)
    if dest == "zero_config":
        return f"[zero_optimization: {value.describe(3)}]"
    flag = "--" + dest.replace("_", "-")
    return flag if value is True else f"{flag} {value}"


def read_configs(
    paths: list[str], accepted: dict[str, argparse.Action | None]
) -> tuple[list[ReadConfig], dict[str, Any]]:
    """The files, and the flags they set that the command takes (``accepted``: its actions by dest, None for a
    setting without a flag), each value checked as the flag's own parser checks it."""
    reads = [read_config(path) for path in paths]
    values = {}
    for dest, value in merged(reads).items():
        if dest not in accepted:
            for read in reads:
                if dest in read.values:
                    read.ignored[as_flag(dest, value)] = "this command does not take it"
            continue
        action = accepted[dest]
        values[dest] = value if action is None else _checked(action, value)
    return reads, values


def _checked(action: argparse.Action, value: Any) -> Any:
    flag = action.option_strings[0] if action.option_strings else action.metavar or action.dest
    if action.type is not None and not isinstance(value, bool):
        try:
            value = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError) as error:
            raise UserError(f"--config sets {flag} {value}: {error}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UserError(f"--config sets {flag} {value}, which is not one of {choices}.")
    return value


def read_config(path: str | Path) -> ReadConfig:
    """Read one file, whichever of the formats it is."""
    file = Path(path)
    data = _load(file)
    kind, reader = _format_of(file, data)
    read = ReadConfig(file, kind)
    reader(data, read)
    read.ignore_rest(data)
    return read


def merged(reads: list[ReadConfig]) -> dict[str, Any]:
    """Every file's values. Two files that set one flag differently are refused, as the Trainer refuses a
    DeepSpeed config that contradicts its arguments."""
    values: dict[str, Any] = {}
    source: dict[str, Path] = {}
    for read in reads:
        for dest, value in read.values.items():
            if dest in values and values[dest] != value:
                raise UserError(
                    f"{source[dest]} and {read.path} disagree: {as_flag(dest, values[dest])} against "
                    f"{as_flag(dest, value)}. Make them agree, or give the flag on the command line."
                )
            values[dest], source[dest] = value, read.path
    return values


def _load(file: Path) -> Any:
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"--config {file}: no such file.") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--config {file}: cannot read it ({error}).") from None
    try:
        if file.suffix == ".toml":
            return tomllib.loads(text)
        if file.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        kind = {".toml": "TOML", ".json": "JSON"}.get(file.suffix, "YAML")
        raise UserError(f"--config {file} is not valid {kind}: {str(error).splitlines()[0]}") from None


def _format_of(file: Path, data: Any) -> tuple[str, Callable[[dict, ReadConfig], None]]:
    if not isinstance(data, dict):
        raise UserError(f"--config {file}: expected a mapping of keys to values at the top level.")
    if file.suffix == ".toml":
        return "torchtitan", _torchtitan
    if "zero_optimization" in data or "train_micro_batch_size_per_gpu" in data:
        return "DeepSpeed", _deepspeed
    if "distributed_type" in data or "compute_environment" in data:
        return "accelerate", _accelerate
    if isinstance(data.get("model"), dict) and "_component_" in data["model"]:
        return "torchtune", _torchtune
    if "base_model" in data:
        return "axolotl", _axolotl
    if {"per_device_train_batch_size", "model_name_or_path", "gradient_accumulation_steps"} & data.keys():
        return "Trainer arguments", _trainer
    raise UserError(
        f"--config {file}: not a format this tool reads (a DeepSpeed JSON, an accelerate config, Trainer / "
        "SFTConfig arguments, an axolotl, torchtune or torchtitan config); no key names its format."
    )


IRRELEVANT_WORDS = (
    "lr", "learning_rate", "warmup", "scheduler", "log", "wandb", "report", "hub", "push", "save", "output",
    "dir", "path", "dataset", "data", "seed", "eval", "epoch", "steps", "print", "tokenizer", "token",
    "template", "profil", "metric", "checkpoint", "resume", "debug", "tpu", "machine", "rdzv", "network",
    "environment", "main_training_function", "affinity", "weight_decay", "clip", "max_norm", "val_", "split",
    "shuffle", "num_proc", "revision", "trust_remote_code", "job", "special", "comm", "fault", "validation",
    "device", "downcast", "gpu_ids", "same_network", "use_cpu", "overwrite", "run_name", "hf_", "chat",
    "model_type", "strict", "gradient_clipping", "wall_clock", "deterministic", "tf32",
)  # fmt: skip


def _irrelevant(key: str) -> bool:
    return any(word in key.lower() for word in IRRELEVANT_WORDS)


# Shared vocabulary: the Trainer's optimizer names (TrainingArguments.optim, also axolotl's), dtypes.

OPTIMIZERS: dict[str, tuple[str, str | None]] = {  # optim -> (--optimizer, --optimizer-impl)
    "adamw_torch": ("adamw", None),
    "adamw_torch_fused": ("adamw", "fused"),
    "adamw_bnb_8bit": ("adamw8bit", None),
    "adamw_8bit": ("adamw8bit", None),
    "paged_adamw_8bit": ("adamw8bit", None),
    "adafactor": ("adafactor", None),
    "sgd": ("sgd", None),
}
# torch's dtype names (config.json, Trainer arguments, TOML) and the command line's, to the command line's.
TORCH_DTYPES = {str(dtype).removeprefix("torch."): name for name, dtype in DTYPES.items()} | {
    name: name for name in DTYPES
}


def _optimizer(name: Any, key: str, read: ReadConfig) -> None:
    if name in (None, AUTO):
        return
    if name not in OPTIMIZERS:
        read.ignore(key, f"{name!r} is not modelled: estimated with AdamW; pick the nearest with --optimizer")
        return
    optimizer, impl = OPTIMIZERS[name]
    read.set("optimizer", optimizer, key)
    if impl:
        read.set("optimizer_impl", impl, key)
    if name.startswith("paged_"):
        read.notes.append(f"{key}: {name} pages its states to the host under memory pressure; counted on the GPU")


def _attention(value: Any, key: str, read: ReadConfig) -> None:
    read.use(key)
    if value in ("flash_attention_2", "flash_attention_3", "sdpa", True):
        read.set("attn", "sdpa", key)
        if value != "sdpa":
            read.notes.append(f"{key}: {value}, estimated with SDPA's flash kernel, which saves the same tensors")
    elif value == "eager":
        read.set("attn", "eager", key)
    elif value not in (None, False):
        read.ignore(key, f"{value!r} is not modelled: estimated with SDPA")


def _lora(data: dict, read: ReadConfig, r: str, alpha: str, dropout: str, targets: str) -> None:
    read.set("lora_r", int(data.get(r) or 8), r)
    read.set("lora_alpha", data.get(alpha), alpha)
    read.set("lora_dropout", None if data.get(dropout) is None else float(data[dropout]), dropout)
    named = data.get(targets)
    read.set("lora_targets", named if isinstance(named, str) or not named else ",".join(map(str, named)), targets)


def _number(value: Any, key: str) -> int | str:
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise UserError(f'{key} must be a number of elements or "auto" (got {value!r}).')
    return int(value)


# DeepSpeed (deepspeed/runtime/config.py, deepspeed/runtime/zero/config.py).

ZERO_SIZES = (
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)
ZERO_NOT_MODELLED = {
    "allgather_bucket_size": "the all-gather of updated partitions is modelled without its bucket",
    "sub_group_size": "the optimizer's sub-groups are not modelled (one group; the default 1e9 covers most models)",
    "zero_quantized_weights": "ZeRO++ quantized communication is not modelled",
    "zero_quantized_gradients": "ZeRO++ quantized communication is not modelled",
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning is not modelled",
}


def _deepspeed(data: dict, read: ReadConfig) -> None:
    read.set("batch_size", data.get("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu")
    read.set("grad_accum", data.get("gradient_accumulation_steps"), "gradient_accumulation_steps")
    for key in ("bf16", "bfloat16", "fp16"):
        section = data.get(key) or {}
        enabled = section.get("enabled")
        if enabled is True or enabled == AUTO:
            read.set("mixed_precision", AUTO if enabled == AUTO else "fp16" if key == "fp16" else "bf16", key)
        read.use(key)
    zero = data.get("zero_optimization") or {}
    read.set("engine", "deepspeed", "zero_optimization")
    read.set("zero", int(zero.get("stage", 0)), "zero_optimization.stage")
    optimizer_device = (zero.get("offload_optimizer") or {}).get("device", "none")
    param_device = (zero.get("offload_param") or {}).get("device", "none")
    if param_device in ("cpu", "nvme"):
        read.set("offload", "optimizer,params", "zero_optimization.offload_param")
    elif optimizer_device in ("cpu", "nvme"):
        read.set("offload", "optimizer", "zero_optimization.offload_optimizer")
    if "nvme" in (optimizer_device, param_device):
        read.notes.append("offload to nvme: the GPU holds what it holds with cpu; the host's share is on NVMe")
    sizes = {
        key: _number(zero[name], f"zero_optimization.{name}")
        for key in ZERO_SIZES
        for name in (key, key.removeprefix("stage3_"))  # DeepSpeedZeroConfig takes both spellings
        if name in zero
    }
    overlap = zero.get("overlap_comm")
    config = ZeroConfig(**sizes, overlap_comm=overlap if isinstance(overlap, bool) else None)
    if config != ZeroConfig():
        read.values["zero_config"] = config
    handled = {"stage", "offload_optimizer", "offload_param", "overlap_comm", *ZERO_SIZES}
    handled |= {key.removeprefix("stage3_") for key in ZERO_SIZES}
    for key in zero:
        if key not in handled:
            read.ignore(f"zero_optimization.{key}", ZERO_NOT_MODELLED.get(key, NO_MEMORY))
    optimizer = (data.get("optimizer") or {}).get("type")
    if optimizer:
        kind = str(optimizer).lower()
        if kind in ("adamw", "adam", "sgd"):
            read.set("optimizer", kind, "optimizer")
        else:
            read.ignore("optimizer", f"{optimizer} is not modelled: estimated with AdamW")
    if data.get("activation_checkpointing"):
        read.ignore(
            "activation_checkpointing",
            "acts only on models that call deepspeed.checkpointing; Hugging Face models checkpoint through "
            "gradient_checkpointing (--grad-checkpointing)",
        )
    if "train_batch_size" in data:
        read.ignore("train_batch_size", "follows from the micro-batch, the accumulation and the GPUs")
    if data.get("zero_force_ds_cpu_optimizer") is False:
        read.ignore("zero_force_ds_cpu_optimizer", "another CPU optimizer changes host memory only")


# accelerate (accelerate/commands/config/config_args.py, accelerate/utils/dataclasses.py).

FSDP1_SHARDING = {"FULL_SHARD": 3, "1": 3, "SHARD_GRAD_OP": 2, "2": 2, "NO_SHARD": 0, "3": 0}


def _accelerate(data: dict, read: ReadConfig) -> None:
    distributed = str(data.get("distributed_type", "NO")).upper()
    read.use("distributed_type", "num_processes")
    if distributed != "NO":
        read.set("gpus", int(data.get("num_processes") or 1), "num_processes")
    precision = data.get("mixed_precision")
    if precision in ("bf16", "fp16"):
        read.set("mixed_precision", precision, "mixed_precision")
    elif precision == "fp8":
        read.ignore("mixed_precision", "fp8 training is not modelled: estimated with bf16 autocast")
        read.set("mixed_precision", "bf16", "mixed_precision")
    elif precision == "no":
        read.set("mixed_precision", "off", "mixed_precision")
    if distributed == "MULTI_GPU":
        read.set("zero", 0, "distributed_type")
    elif distributed == "FSDP":
        _fsdp_options(data.get("fsdp_config") or {}, read, "fsdp_config", default_version=1)
    elif distributed == "DEEPSPEED":
        _accelerate_deepspeed(data.get("deepspeed_config") or {}, read)
    elif distributed != "NO":
        read.ignore("distributed_type", f"{distributed} is not modelled")


def _fsdp_options(fsdp: dict, read: ReadConfig, key: str, default_version: int) -> None:
    """accelerate's, the Trainer's and axolotl's ``fsdp_config``: FSDP2 with version 2; FSDP1 shards the same
    units (one per decoder layer) into a FlatParameter, and is estimated with FSDP2's runtime. accelerate and
    axolotl default to version 1, the Trainer of transformers 5 to 2 (training_args.py)."""
    options = {name.removeprefix("fsdp_"): value for name, value in fsdp.items()}
    read.use(key)
    read.set("engine", "fsdp", key)
    if int(options.get("version", default_version)) == 1:
        read.notes.append(f"{key}: FSDP1 (FlatParameter), estimated with FSDP2's runtime, which shards the same units")
    reshard = options.get("reshard_after_forward", options.get("sharding_strategy", True))
    zero = 3 if reshard is True else 2 if reshard is False else FSDP1_SHARDING.get(str(reshard).upper())
    if zero is None:
        raise UserError(f"{key}: sharding {reshard} (hybrid) is not modelled; use FULL_SHARD or SHARD_GRAD_OP.")
    read.set("zero", zero, key)
    if options.get("offload_params") or options.get("cpu_offload"):
        read.set("offload", "optimizer,params", key)
    if options.get("activation_checkpointing"):
        read.set("grad_checkpointing", "full", key)
    wrap = options.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if wrap != "TRANSFORMER_BASED_WRAP":
        read.ignore(f"{key}.fsdp_auto_wrap_policy", f"{wrap}: estimated with one unit per decoder layer")
    handled = {
        "version", "reshard_after_forward", "sharding_strategy", "offload_params", "cpu_offload",
        "activation_checkpointing", "auto_wrap_policy",
    }  # fmt: skip
    for name in fsdp:
        if name.removeprefix("fsdp_") not in handled:
            read.ignore(f"{key}.{name}")


def _accelerate_deepspeed(deepspeed: dict, read: ReadConfig) -> None:
    read.use("deepspeed_config")
    if deepspeed.get("deepspeed_config_file"):
        read.include(read_config(read.path.parent / deepspeed["deepspeed_config_file"]), "deepspeed_config_file")
    else:
        read.set("engine", "deepspeed", "deepspeed_config")
        read.set("zero", int(deepspeed.get("zero_stage", 2)), "deepspeed_config.zero_stage")
        if deepspeed.get("offload_param_device") in ("cpu", "nvme"):
            read.set("offload", "optimizer,params", "deepspeed_config.offload_param_device")
        elif deepspeed.get("offload_optimizer_device") in ("cpu", "nvme"):
            read.set("offload", "optimizer", "deepspeed_config.offload_optimizer_device")
        read.set("grad_accum", deepspeed.get("gradient_accumulation_steps"), "deepspeed_config")
    handled = {
        "deepspeed_config_file", "zero_stage", "offload_param_device", "offload_optimizer_device",
        "gradient_accumulation_steps",
    }  # fmt: skip
    for key in deepspeed:
        if key not in handled:
            read.ignore(f"deepspeed_config.{key}")


# Trainer arguments: transformers' TrainingArguments with TRL's SFTConfig and ModelConfig, as the
# alignment-handbook and TRL's CLI write them in one file; axolotl uses the same names for most.

NOT_MODELLED = {
    "use_liger_kernel": "Liger's kernels (its fused linear cross-entropy never makes the logits) are not modelled",
    "torch_compile": "torch.compile's fused kernels are not modelled: estimated as eager",
    "padding_free": "padding-free batches are not modelled: the batch is batch-size x seq-len",
    "neftune_noise_alpha": "NEFTune's noise on the embeddings is not counted",
    "activation_offloading": "activation offloading is not modelled",
}


# Keys of TRL's SFTConfig and script arguments, absent from TrainingArguments: a file with one is read with
# TRL's defaults.
SFT_KEYS = {"max_length", "max_seq_length", "packing", "dataset_text_field", "completion_only_loss",
            "assistant_only_loss", "packing_strategy", "padding_free", "dataset_num_proc", "dataset_name"}  # fmt: skip


def _trainer(data: dict, read: ReadConfig) -> None:
    """TrainingArguments, or TRL's SFTConfig (``trl/trainer/base_config.py``, ``sft_config.py``), whose
    defaults differ: ``gradient_checkpointing`` and ``bf16`` default to true, ``max_length`` to 1024, and a
    model given by name loads in float32 unless ``model_init_kwargs`` names a dtype (``create_model_from_path``)."""
    trl = bool(SFT_KEYS & data.keys())
    if trl:
        read.kind = "TRL SFTConfig"
        data = {"gradient_checkpointing": True, "bf16": True, "max_length": 1024} | data
        read.ignore("loss", "TRL computes its loss in chunks of the logits (or tiles of the lm_head), which is "
                    "not modelled: the estimate holds the full logits (an upper bound)")  # fmt: skip
    read.set("model", data.get("model_name_or_path"), "model_name_or_path")
    read.set("batch_size", data.get("per_device_train_batch_size"), "per_device_train_batch_size")
    if data.get("use_peft") or data.get("load_in_4bit") or data.get("load_in_8bit"):
        _lora(data, read, "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
    read.use("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
    read.set("seq_len", data.get("max_seq_length", data.get("max_length")), "max_length")
    read.use("max_seq_length", "max_length")
    _shared_step(data, read, reentrant_default=False, fsdp_version=2)


def _shared_step(data: dict, read: ReadConfig, reentrant_default: bool, fsdp_version: int) -> None:
    """The keys the Trainer, TRL and axolotl share. ``reentrant_default``: ``use_reentrant`` when the
    checkpointing kwargs do not say (False for transformers 5's ``gradient_checkpointing_enable``)."""
    read.set("grad_accum", data.get("gradient_accumulation_steps"), "gradient_accumulation_steps")
    # The HF Trainer sets model.config.use_cache = args.use_cache, False unless the file says (trainer.py:645-646).
    read.set("use_cache", "on" if data.get("use_cache") else "off", "use_cache")
    quantized = data.get("load_in_4bit") or data.get("load_in_8bit")
    if data.get("load_in_4bit"):
        read.set("qlora", True, "load_in_4bit")
    elif data.get("load_in_8bit"):
        read.set("load_in_8bit", True, "load_in_8bit")
    read.use("load_in_4bit", "load_in_8bit")
    _precision(data, read, quantized)
    checkpointing = next((k for k in ("gradient_checkpointing", "activation_checkpointing") if data.get(k)), None)
    if checkpointing:
        read.set("grad_checkpointing", "full", checkpointing)
        kwargs = data.get(f"{checkpointing}_kwargs") or {}
        if kwargs.get("use_reentrant", reentrant_default):
            read.set("reentrant", True, f"{checkpointing}_kwargs")
    read.use("gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing")
    read.use("activation_checkpointing_kwargs")
    _optimizer(data.get("optim", data.get("optimizer")), "optim" if "optim" in data else "optimizer", read)
    _attention(data.get("attn_implementation"), "attn_implementation", read)
    if data.get("deepspeed"):
        read.include(read_config(read.path.parent / str(data["deepspeed"])), "deepspeed")
    if data.get("fsdp"):
        options = data["fsdp"] if isinstance(data["fsdp"], list) else str(data["fsdp"]).split()
        config = dict(data.get("fsdp_config") or {})
        config.setdefault("sharding_strategy", "SHARD_GRAD_OP" if "shard_grad_op" in options else "FULL_SHARD")
        if "offload" in options:
            config["offload_params"] = True
        if data.get("fsdp_version") is not None:
            config.setdefault("version", data["fsdp_version"])
        _fsdp_options(config, read, "fsdp_config", fsdp_version)
        read.use("fsdp", "fsdp_version")
        read.notes.append("fsdp: the number of GPUs comes from the launcher; give --gpus")
    for key, why in NOT_MODELLED.items():
        if data.get(key):
            read.ignore(key, why)
    if data.get("packing") or data.get("sample_packing"):
        read.notes.append("packing: every sequence is full length, as counted")
    read.use("packing", "sample_packing", *NOT_MODELLED)


def _precision(data: dict, read: ReadConfig, quantized: bool) -> None:
    """``torch_dtype`` / ``dtype`` (the loaded model's dtype) with ``bf16`` / ``fp16`` (the Trainer's autocast).
    Quantized base weights load in the compute dtype."""
    key = next((k for k in ("torch_dtype", "dtype") if k in data), None)
    dtype = TORCH_DTYPES.get(str(data.get(key))) if key else None
    init_kwargs = data.get("model_init_kwargs") or {}
    init = init_kwargs.get("dtype") or init_kwargs.get("torch_dtype")
    if dtype is None and init:
        key, dtype = "model_init_kwargs.dtype", TORCH_DTYPES.get(str(init))
    low = next((name for name in ("bf16", "fp16") if data.get(name) in (True, AUTO)), None)
    read.use("torch_dtype", "dtype", "bf16", "fp16", "model_init_kwargs")
    if quantized and low and dtype not in ("bf16", "fp16"):
        key, dtype = low, low
    if dtype in ("bf16", "fp16"):
        read.set("dtype", dtype, key)
        if low == dtype == "bf16" and not quantized:
            read.set("mixed_precision", low, low)  # autocast over the bf16 weights
        elif low:
            read.notes.append(f"{key} {dtype} with {low}: the step runs in {dtype}, estimated without autocast")
    elif low:
        read.set("mixed_precision", low, low)
    elif data.get("bf16") is False and data.get("fp16") in (False, None):
        read.set("mixed_precision", "off", "bf16")


# axolotl (src/axolotl/utils/schemas/config.py, utils/config/__init__.py): the Trainer's keys with its own
# names for a few, the model loaded in bf16 when bf16 is on, reentrant checkpointing by default.


def _axolotl(data: dict, read: ReadConfig) -> None:
    read.set("model", data.get("base_model"), "base_model")
    read.set("batch_size", data.get("micro_batch_size"), "micro_batch_size")
    read.set("seq_len", data.get("sequence_len"), "sequence_len")
    adapter = data.get("adapter")
    if adapter in ("lora", "qlora"):
        targets = "all-linear" if data.get("lora_target_linear") else data.get("lora_target_modules")
        named = data | {"lora_target_modules": targets}
        _lora(named, read, "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
    elif adapter:
        read.ignore("adapter", f"{adapter} adapters are not modelled")
    read.use("adapter", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear")
    if data.get("flash_attention"):
        _attention("flash_attention_2", "flash_attention", read)
    read.use("flash_attention", "sdp_attention", "xformers_attention")
    low = next((name for name in ("bf16", "fp16") if data.get(name) in (True, AUTO)), None)
    if low and not data.get("torch_dtype"):
        data = data | {"torch_dtype": low}  # cfg.torch_dtype follows bf16 / fp16 (utils/config/__init__.py)
    if data.get("bf16") == AUTO:
        read.notes.append("bf16: auto, bf16 on a GPU that has it (estimated so)")
    _shared_step(data, read, reentrant_default=True, fsdp_version=1)


# torchtune (recipes/configs/*.yaml; recipes/lora_finetune_single_device.py, full_finetune_distributed.py).

TORCHTUNE_MODELS = {  # builder (without lora_ / qlora_) -> bundled Hugging Face config
    "llama3_1_8b": "meta-llama/Llama-3.1-8B",
    "llama3_1_70b": "meta-llama/Llama-3.1-70B",
    "llama3_1_405b": "meta-llama/Llama-3.1-405B",
    "llama3_8b": "meta-llama/Meta-Llama-3-8B",
    "llama3_70b": "meta-llama/Meta-Llama-3-70B",
    "llama3_2_1b": "meta-llama/Llama-3.2-1B",
    "llama3_2_3b": "meta-llama/Llama-3.2-3B",
    "llama3_3_70b": "meta-llama/Llama-3.3-70B-Instruct",
    "llama2_7b": "meta-llama/Llama-2-7b-hf",
    "llama2_13b": "meta-llama/Llama-2-13b-hf",
    "llama2_70b": "meta-llama/Llama-2-70b-hf",
    "mistral_7b": "mistralai/Mistral-7B-v0.1",
    "qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B",
    "qwen2_5_7b_base": "Qwen/Qwen2.5-7B",
    "qwen3_8b_base": "Qwen/Qwen3-8B",
    "gemma2_2b": "google/gemma-2-2b",
    "gemma2_9b": "google/gemma-2-9b",
    "phi3_mini": "microsoft/Phi-3-mini-4k-instruct",
}
TORCHTUNE_PROJECTIONS = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
TORCHTUNE_MLP = ("gate_proj", "up_proj", "down_proj")  # torchtune's w1, w3, w2


def _torchtune(data: dict, read: ReadConfig) -> None:
    model = dict(data["model"])
    builder = model.pop("_component_").rsplit(".", 1)[-1]
    base = builder.removeprefix("q").removeprefix("lora_")
    read.set("model", TORCHTUNE_MODELS.get(base), "model")
    if base not in TORCHTUNE_MODELS:
        read.ignore("model", f"{builder} has no bundled Hugging Face equivalent: give MODEL")
    read.notes.append("torchtune runs its own model code; estimated with transformers' model of the same config")
    if builder.startswith(("lora_", "qlora_")):
        targets = [TORCHTUNE_PROJECTIONS[name] for name in model.get("lora_attn_modules", [])]
        targets += list(TORCHTUNE_MLP) if model.get("apply_lora_to_mlp") else []
        read.set("lora_r", model.get("lora_rank"), "model.lora_rank")
        read.set("lora_alpha", model.get("lora_alpha"), "model.lora_alpha")
        read.set("lora_dropout", model.get("lora_dropout"), "model.lora_dropout")
        read.set("lora_targets", ",".join(targets) or None, "model.lora_attn_modules")
        if model.get("apply_lora_to_output"):
            read.ignore("model.apply_lora_to_output", "a LoRA adapter on the output projection is not modelled")
    if builder.startswith("qlora_"):
        read.set("qlora", True, "model._component_")
        read.notes.append(
            "QLoRA: torchao's NF4Tensor, estimated with bitsandbytes' NF4 layout (4 bits per weight, blocks of 64, "
            "quantized scales)"
        )
    read.set("batch_size", data.get("batch_size"), "batch_size")
    read.set("grad_accum", data.get("gradient_accumulation_steps"), "gradient_accumulation_steps")
    read.set("seq_len", (data.get("tokenizer") or {}).get("max_seq_len"), "tokenizer.max_seq_len")
    if (data.get("tokenizer") or {}).get("max_seq_len") is None:
        read.notes.append("tokenizer.max_seq_len: none, the sequence length comes from the data; give --seq-len")
    dtype = TORCH_DTYPES.get(str(data.get("dtype", "bf16")))
    read.set("dtype", dtype, "dtype")
    read.set("mixed_precision", "off", "dtype")
    if data.get("enable_activation_checkpointing"):
        read.set("grad_checkpointing", "full", "enable_activation_checkpointing")
    read.use("enable_activation_checkpointing", "tokenizer")
    optimizer = dict(data.get("optimizer") or {})
    name = str(optimizer.pop("_component_", "torch.optim.AdamW"))
    kinds = {"torch.optim.AdamW": "adamw", "torch.optim.Adam": "adam", "torch.optim.SGD": "sgd",
             "bitsandbytes.optim.PagedAdamW8bit": "adamw8bit", "bitsandbytes.optim.AdamW8bit": "adamw8bit"}  # fmt: skip
    if name in kinds:
        read.set("optimizer", kinds[name], "optimizer")
        if optimizer.get("fused"):
            read.set("optimizer_impl", "fused", "optimizer.fused")
    else:
        read.ignore("optimizer", f"{name} is not modelled: estimated with AdamW")
    loss = str((data.get("loss") or {}).get("_component_", ""))
    if "Chunked" in loss or "LinearCrossEntropy" in loss:
        read.ignore("loss", f"{loss.rsplit('.', 1)[-1]} computes the loss in chunks, which is not modelled: the "
                    "estimate holds the full logits and transformers' loss (an upper bound)")  # fmt: skip
    for key, why in {
        "optimizer_in_bwd": "stepping the optimizer inside backward (gradients freed as they come) is not modelled",
        "enable_activation_offloading": "activation offloading is not modelled",
        "compile": "torch.compile's fused kernels are not modelled: estimated as eager",
        "fsdp_cpu_offload": "FSDP2's CPUOffloadPolicy: give --zero 3 --offload optimizer,params with --gpus",
    }.items():
        if data.get(key):
            read.ignore(key, why)
    read.use("optimizer_in_bwd", "enable_activation_offloading", "compile", "fsdp_cpu_offload")


# torchtitan (torchtitan/config/job_config.py; TOML train configs).

TORCHTITAN_MODELS = {
    ("llama3", "8B"): "meta-llama/Llama-3.1-8B",
    ("llama3", "70B"): "meta-llama/Llama-3.1-70B",
    ("llama3", "405B"): "meta-llama/Llama-3.1-405B",
}


def _torchtitan(data: dict, read: ReadConfig) -> None:
    model = data.get("model") or {}
    key = (model.get("name"), str(model.get("flavor")))
    read.set("model", TORCHTITAN_MODELS.get(key), "model")
    if key not in TORCHTITAN_MODELS:
        read.ignore("model", f"{key[0]} {key[1]} has no bundled Hugging Face equivalent: give MODEL")
    read.notes.append("torchtitan runs its own model code; estimated with transformers' model of the same config")
    training = data.get("training") or {}
    read.set("batch_size", training.get("local_batch_size", training.get("batch_size")), "training.local_batch_size")
    read.set("seq_len", training.get("seq_len"), "training.seq_len")
    precision = TORCH_DTYPES.get(str(training.get("mixed_precision_param", "bfloat16")))
    parallelism = data.get("parallelism") or {}
    shard = int(parallelism.get("data_parallel_shard_degree", -1))
    replicate = int(parallelism.get("data_parallel_replicate_degree", 1))
    tp = int(parallelism.get("tensor_parallel_degree", 1))
    for name in ("pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree"):
        if int(parallelism.get(name, 1)) > 1:
            raise UserError(f"{read.path}: parallelism.{name} {parallelism[name]} is not modelled yet.")
    if replicate > 1 and shard != 1:
        raise UserError(f"{read.path}: HSDP (replicate {replicate} x shard {shard}) is not modelled yet.")
    read.set("tp", tp if tp > 1 else None, "parallelism.tensor_parallel_degree")
    if shard == -1:
        read.notes.append("data_parallel_shard_degree -1: FSDP2 over every GPU the launcher starts; give --gpus")
    else:
        read.set("gpus", shard * tp * replicate, "parallelism")
    if shard != 1:
        read.set("zero", 3, "parallelism.data_parallel_shard_degree")
        read.set("mixed_precision", precision if precision in ("bf16", "fp16") else "off", "training")
    elif precision in ("bf16", "fp16"):
        read.notes.append("training.mixed_precision_param applies to FSDP only: one replica trains in fp32")
    read.set("engine", "fsdp", "parallelism")
    checkpoint = data.get("activation_checkpoint") or {}
    mode = checkpoint.get("mode", "selective")
    if mode == "full":
        read.set("grad_checkpointing", "full", "activation_checkpoint.mode")
    elif mode == "selective" and checkpoint.get("selective_ac_option", "op") == "op":
        read.set("grad_checkpointing", "op", "activation_checkpoint.selective_ac_option")
    elif mode == "selective":
        read.ignore(
            "activation_checkpoint",
            f"selective_ac_option {checkpoint['selective_ac_option']!r} (every N layers) is not modelled: estimated "
            "without checkpointing (an upper bound); --grad-checkpointing full gives a lower bound",
        )
    optimizer = data.get("optimizer") or {}
    if str(optimizer.get("name", "AdamW")).lower() in ("adamw", "adam"):
        read.set("optimizer", str(optimizer.get("name", "AdamW")).lower(), "optimizer.name")
    read.use("training", "parallelism", "activation_checkpoint", "optimizer", "model")
    if (data.get("compile") or {}).get("enable"):
        read.ignore("compile", "torch.compile's fused kernels are not modelled: estimated as eager")
    if any(((data.get("quantize") or {}).get("linear") or {}).get(kind, {}).get("enable") for kind in ("float8", "mx")):
        read.ignore("quantize", "float8 / MX training is not modelled")
    read.use("compile", "quantize")
