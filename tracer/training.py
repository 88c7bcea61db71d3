"""What one training step looks like: every assumption the estimate depends on, in one dataclass."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

import torch

from tracer.errors import UserError
from tracer.gpus import PCIE_4_X16_GBPS


class Target(str, Enum):
    """The device whose behaviour the trace reproduces."""

    CUDA = "cuda"
    CPU = "cpu"


DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "adamw8bit")
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")  # torch.optim's implementations of AdamW, Adam and SGD
TORCH_OPTIMIZERS = ("adamw", "adam", "sgd")  # the optimizers torch.optim implements in those ways
ATTENTIONS = ("sdpa", "eager")
# every decoder layer; every decoder layer under torchtitan's per-op policy; the attention of every decoder layer
CHECKPOINTING = ("full", "op", "selective")
QUANTIZATIONS = ("nf4", "fp4", "int8")  # bitsandbytes storage of frozen weights (QLoRA, 4-bit, LLM.int8())
MODES = ("train", "inference")
TRAINING_ONLY = (
    "mixed_precision",
    "accelerate_prepared",
    "use_cache",
    "optimizer",
    "grad_checkpointing",
    "reentrant",
    "lora",
    "grad_accum",
    "optimizer_impl",
    "pcie_gbps",
)
INFERENCE_ONLY = ("max_new_tokens", "cache", "cache_backend", "logits_to_keep", "dequantize", "sampling", "device_map")
# generate()'s cache_implementation values (transformers 5.24, generation/configuration_utils.py), "dynamic" its default
CACHES = ("dynamic", "static", "offloaded", "offloaded_static", "quantized")
# QuantizedCache's backends: FP8 is transformers' own (Fp8QuantizedLayer); quanto and HQQ are libraries of their own
CACHE_BACKENDS = ("fp8", "quanto", "hqq")
# from_pretrained(device_map=...) strategies that split a model over GPUs (integrations/accelerate.py _get_device_map)
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True)
class LoraSetup:
    """LoRA adapters through ``peft`` (``LoraConfig``); ``targets`` None lets peft pick per architecture."""

    r: int = 8
    alpha: int = 16
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0
    # peft's ``autocast_adapter_dtype``: adapters of a bf16/fp16 model are kept in fp32. Off where a runtime
    # casts every parameter to one compute dtype (FSDP2's MixedPrecisionPolicy).
    float32_adapters: bool = True

    def __post_init__(self) -> None:
        if self.r < 1:
            raise UserError(f"--lora-r must be at least 1 (got {self.r}).")
        if not 0 <= self.dropout < 1:
            raise UserError(f"--lora-dropout must be in [0, 1) (got {self.dropout}).")


@dataclass(frozen=True)
class Sampling:
    """``generate(do_sample=True)`` with these warpers' settings; the defaults are those GenerationConfig applies
    (``_get_default_generation_params``), under which only top-k (50) filters."""

    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise UserError(
                f"--temperature must be positive (got {self.temperature}); for greedy decoding drop --do-sample."
            )
        if self.top_k < 0:
            raise UserError(f"--top-k must be 0 (no top-k filter) or more (got {self.top_k}).")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (got {self.top_p}).")


@dataclass(frozen=True)
class DeviceMap:
    """``from_pretrained(device_map=strategy)`` over ``gpus`` GPUs: accelerate places whole modules on the GPUs and
    its hooks run them one GPU after the other (tracer/device_map.py)."""

    strategy: str = "auto"
    gpus: int = 2

    def __post_init__(self) -> None:
        if self.strategy not in DEVICE_MAPS:
            raise UserError(f"--device-map must be one of {', '.join(DEVICE_MAPS)} (got {self.strategy!r}).")
        if self.gpus < 2:
            raise UserError(
                f"--device-map {self.strategy} splits the model over several GPUs: give --gpus 2 or more (on one GPU "
                "it places everything there, which the single-GPU estimate is)."
            )


@dataclass(frozen=True)
class TrainingSetup:
    """One steady-state fine-tuning step: ``loss = model(ids, labels=labels).loss; loss.backward();
    optimizer.step(); optimizer.zero_grad(set_to_none=True)``.

    ``dtype`` is the dtype of the stored parameters. ``mixed_precision`` runs the forward under autocast
    in that dtype: over fp32 parameters, gradients and optimizer states, or over bf16 ones, as the Trainer
    runs a bf16 checkpoint (which ``from_pretrained`` loads in bf16) with ``bf16=True``.
    """

    batch_size: int = 1
    seq_len: int = 1024
    dtype: str = "fp32"
    mixed_precision: str | None = None
    optimizer: str = "adamw"
    attn: str = "sdpa"
    target: Target = Target.CUDA
    gpu: str = "h100"
    grad_checkpointing: str | None = None
    reentrant: bool = False  # torch.utils.checkpoint(use_reentrant=True)
    lora: LoraSetup | None = None
    quantize: str | None = None
    grad_accum: int = 1
    keep_outputs: bool = False  # the loop holds the model's outputs until the next forward (tracer/step.py)
    # the model went through accelerator.prepare (the Trainer and accelerate loops): under mixed precision its
    # forward is wrapped in convert_outputs_to_fp32, and the bf16/fp16 outputs come back as fp32 copies
    accelerate_prepared: bool = False
    # transformers' key/value cache in the training forward (config.use_cache): None keeps the config's. The HF
    # Trainer sets it from TrainingArguments.use_cache, False by default; a cache keeps every layer's keys and
    # values referenced until the outputs are dropped
    use_cache: bool | None = None
    optimizer_impl: str | None = None  # None: torch's default for the device
    pcie_gbps: float = PCIE_4_X16_GBPS  # host link bandwidth each way, for offloading's transfer times
    mode: str = "train"
    max_new_tokens: int = 1  # inference: the decode step runs with the cache holding prompt + these - 1
    cache: str = "dynamic"  # inference: generate()'s cache_implementation
    cache_backend: str | None = None  # inference, with cache="quantized": cache_config={"backend": ...}
    sampling: Sampling | None = None  # inference: generate(do_sample=True, ...); None is greedy decoding
    device_map: DeviceMap | None = None  # inference: from_pretrained(device_map=...) over several GPUs
    logits_to_keep: int = 1  # inference prefill: logits of the last N positions (0: all); generate() passes 1
    # inference: a checkpoint published quantized (FP8, MXFP4) loaded dequantized to --dtype; training always is
    dequantize: bool = False
    # the rank traced holds 1/N of each MoE layer's experts: set by the layout's --ep (tracer/expert_parallel.py)
    expert_parallel: int = 1
    # training with --ep: the busiest rank's experts receive this many times their share of the routed tokens
    routing_imbalance: float = 1.0
    # the rank traced runs its share of the sequence with ring attention over this many: set by the layout's --cp
    # (tracer/context_parallel.py)
    context_parallel: int = 1
    expandable_segments: bool = False  # CUDA caching allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    # the step runs under a TorchDispatchMode (a memory recorder such as MemTracker, FlopCounterMode), under which
    # autograd sums a tensor's gradients out of place (tracer/gradient_sums.py): for comparing with such runs
    dispatch_mode: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be at least 1 (got {self.batch_size}).")
        if self.seq_len < 1:
            raise UserError(f"--seq-len must be at least 1 (got {self.seq_len}).")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r}).")
        if self.mixed_precision is not None:
            if self.mixed_precision not in ("bf16", "fp16"):
                raise UserError(f"--mixed-precision must be bf16 or fp16 (got {self.mixed_precision!r}).")
            if self.dtype == "fp16" and self.mixed_precision == "fp16":
                raise UserError(
                    "fp16 weights under fp16 autocast do not train: the GradScaler refuses to unscale fp16 "
                    "gradients. Use --dtype fp32 --mixed-precision fp16, or --dtype fp16 alone."
                )
            if self.dtype not in ("fp32", self.mixed_precision):
                raise UserError(
                    f"--mixed-precision {self.mixed_precision} over --dtype {self.dtype} weights is not a recipe "
                    "anyone runs: use --dtype fp32 (fp32 master weights) or --dtype "
                    f"{self.mixed_precision} (autocast over the checkpoint's own dtype)."
                )
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optimizer must be one of {', '.join(OPTIMIZERS)} (got {self.optimizer!r}).")
        if self.attn not in ATTENTIONS:
            raise UserError(f"--attn must be one of {', '.join(ATTENTIONS)} (got {self.attn!r}).")
        if self.grad_checkpointing not in (None, *CHECKPOINTING):
            raise UserError(
                f"--grad-checkpointing must be one of {', '.join(CHECKPOINTING)} (got {self.grad_checkpointing!r})."
            )
        if self.reentrant and self.grad_checkpointing is None:
            raise UserError("--reentrant chooses how checkpointing recomputes: add --grad-checkpointing.")
        if self.grad_accum < 1:
            raise UserError(f"--grad-accum must be at least 1 (got {self.grad_accum}).")
        if self.mode not in MODES:
            raise UserError(f"--mode must be train or inference (got {self.mode!r}).")
        if self.mode == "inference":
            self._check_inference()
        if self.quantize is not None:
            if self.quantize not in QUANTIZATIONS:
                raise UserError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (got {self.quantize!r}).")
            if self.lora is None and self.mode == "train":
                raise UserError("Quantized base weights are frozen: train LoRA adapters on them (--lora-r).")
            if self.dtype == "fp32" or self.mixed_precision:
                flags = "--quantize computes" if self.mode == "inference" else "--qlora and --load-in-8bit compute"
                raise UserError(f"{flags} in --dtype bf16 or fp16 (the compute dtype); pass --dtype bf16.")
        if self.expandable_segments and self.target is Target.CPU:
            raise UserError("--expandable-segments configures the CUDA caching allocator: drop it with --target cpu.")
        if self.pcie_gbps <= 0:
            raise UserError(f"--pcie-gbps must be positive (got {self.pcie_gbps}).")
        if self.optimizer_impl is not None:
            if self.optimizer_impl not in OPTIMIZER_IMPLS:
                raise UserError(f"--optimizer-impl must be one of {', '.join(OPTIMIZER_IMPLS)}.")
            if self.optimizer not in TORCH_OPTIMIZERS:
                raise UserError(f"--optimizer-impl applies to torch's adamw, adam and sgd, not {self.optimizer}.")

    def _check_inference(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens}).")
        if self.cache not in CACHES:
            raise UserError(f"--cache must be one of {', '.join(CACHES)} (got {self.cache!r}).")
        if (self.cache == "quantized") != (self.cache_backend is not None):
            raise UserError(
                "--cache quantized needs its backend, as transformers' QuantizedCache does: --cache-backend fp8 "
                "(cache_config={'backend': 'fp8'}; without one transformers picks quanto); --cache-backend applies to "
                "--cache quantized only."
            )
        if self.cache_backend not in (None, "fp8"):
            raise UserError(
                f"--cache-backend {self.cache_backend} quantizes with the {self.cache_backend} library (optimum-quanto "
                "or hqq), whose layouts are not modelled: use --cache-backend fp8, transformers' own Fp8QuantizedLayer."
            )
        if self.logits_to_keep < 0:
            raise UserError(f"--logits-to-keep must be 0 (all) or more (got {self.logits_to_keep}).")
        training_only = {
            "--mixed-precision": self.mixed_precision,
            "--grad-checkpointing": self.grad_checkpointing,
            "--lora-r": self.lora,
            "--grad-accum": self.grad_accum > 1,
            "--keep-outputs": self.keep_outputs,
            "--use-cache": self.use_cache is not None,
            "--optimizer-impl": self.optimizer_impl,
        }
        used = [flag for flag, value in training_only.items() if value]
        if used:
            hint = " (for bf16 inference, --dtype bf16)" if self.mixed_precision else ""
            raise UserError(f"{', '.join(used)}: training only; drop it with --mode inference{hint}.")

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return DTYPES[self.mixed_precision] if self.mixed_precision else None

    @property
    def fp32_outputs(self) -> bool:
        """accelerate wraps the forward in ``convert_outputs_to_fp32`` only under mixed precision."""
        return self.accelerate_prepared and self.mixed_precision is not None

    def to_json(self) -> dict[str, Any]:
        """The fields that matter in this mode."""
        data = asdict(self)
        data["target"] = self.target.value
        for name in INFERENCE_ONLY if self.mode == "train" else TRAINING_ONLY:
            del data[name]
        del data["expert_parallel"], data["routing_imbalance"]  # the layout's (--ep), reported with it
        del data["context_parallel"]  # the layout's (--cp), reported with it
        if not self.dispatch_mode:  # a comparison's setting, worth saying only when it is on
            del data["dispatch_mode"]
        return data
