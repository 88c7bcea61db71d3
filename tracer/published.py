"""Checkpoints quantized as published: the weights a config's ``quantization_config`` stores, as transformers keeps
them on the GPU (transformers 5.24).

* ``fp8`` (DeepSeek-V3/R1, Kimi K2, Qwen3-FP8): transformers' own ``FineGrainedFP8HfQuantizer`` replaces the
  modules of a meta copy of the model (``replace_with_fp8_linear``: every plain ``nn.Linear`` but the lm_head and
  ``modules_to_not_convert``, and the fused experts), so the float8_e4m3fn weights and float32 ``*_scale_inv``
  blocks counted are its own.
* ``mxfp4`` (gpt-oss): each ``GptOssMLP``'s experts become ``Mxfp4GptOssExperts`` (integrations/mxfp4.py): two FP4
  values per byte, float32 biases, and the checkpoint's uint8 E8M0 scale per 32 values, which the Triton kernels
  keep beside the blocks (``swizzle_mxfp4``; Hopper's layout pads nothing at gpt-oss's sizes). That needs the
  ``kernels`` package on a Hopper or newer GPU; without it transformers dequantizes to bf16 (``--dequantize``).

* ``gptq`` and ``awq``: low-bit weights packed into int32 words with fp16 scales, in gptqmodel's layers, for
  inference and under LoRA adapters alike (transformers never dequantizes them at load): tracer/packed.py replaces
  the layers, whose forward allocates what their kernels do.

FP8 and MXFP4 are counted for inference only (fine-tuning loads them dequantized). Their step is traced with 16-bit
weights and the published bytes stand in for them: the kernels that read the quantized weights allocate what the
16-bit path does or less. FP8's Triton matmul quantizes its input inside the kernel and allocates only its output,
as ``F.linear`` does; MXFP4's ``matmul_ogs`` fuses the routing gather, the SwiGLU and the scatter that the bf16
experts run as separate ops, so the experts' activations are an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tracer.errors import UserError
from tracer.roles import Role

if TYPE_CHECKING:  # annotations only: the command line's help need not import transformers
    from transformers import PretrainedConfig

    from tracer.recorder import StepRecorder
    from tracer.training import TrainingSetup

RESTATED = ("fp8", "mxfp4")  # traced in 16 bits, the published bytes standing in for the weights
PACKED = ("gptq", "awq")  # their layers replaced by tracer/packed.py's
MODELLED = (*RESTATED, *PACKED)
MXFP4_VALUES_PER_SCALE = 32  # one E8M0 scale per 32 FP4 values (16 bytes of blocks)


@dataclass(frozen=True)
class PublishedTensor:
    shape: tuple[int, ...]
    dtype: torch.dtype


def quant_method(config: PretrainedConfig | None) -> str | None:
    """The checkpoint's ``quant_method``, None for an unquantized one."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    if isinstance(quantization, dict):
        return str(quantization.get("quant_method", "unknown"))
    return str(getattr(quantization, "quant_method", type(quantization).__name__))


def counted_as_published(config: PretrainedConfig | None, setup: TrainingSetup) -> bool:
    """Whether the weights are counted in the checkpoint's own format, unless ``--dequantize``: FP8 and MXFP4 for
    inference (fine-tuning loads them dequantized), GPTQ and AWQ always (transformers never dequantizes them)."""
    method = quant_method(config)
    return not setup.dequantize and (method in PACKED or (method in RESTATED and setup.mode == "inference"))


def check_published(config: PretrainedConfig, setup: TrainingSetup) -> None:
    """Refuse what transformers does not run on a GPTQ or AWQ checkpoint, and layouts not modelled."""
    method = quant_method(config)
    if method not in PACKED or not counted_as_published(config, setup):
        return
    from tracer.packed import packed_format  # tracer/packed.py builds on this module

    packed_format(config)
    if setup.quantize:
        raise UserError(
            f"This checkpoint is already quantized ({method}): drop --quantize, --qlora and --load-in-8bit "
            "(--lora-r trains adapters on its own weights)."
        )
    if setup.mode == "train" and setup.lora is None:
        raise UserError(
            f"A {method.upper()} checkpoint's weights are frozen integers: fine-tune LoRA adapters on them (--lora-r), "
            "as transformers' Trainer requires, or pass a config.json without quantization_config to estimate the "
            "16-bit model."
        )


def published_parameters(config: PretrainedConfig, dtype: torch.dtype) -> dict[str, PublishedTensor]:
    """Every quantized module's parameters as transformers holds them, by name: those of the 16-bit model they
    replace (same names, other dtypes and shapes), and the scales beside them."""
    from transformers import AutoModelForCausalLM

    method = quant_method(config)
    if method not in RESTATED:
        raise ValueError(f"{method} checkpoints are not modelled")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    modules = _fp8_modules(model, config) if method == "fp8" else _mxfp4_modules(model, config)
    return {
        f"{module_name}.{name}": PublishedTensor(tuple(tensor.shape), tensor.dtype)
        for module_name, module in modules.items()
        for name, tensor in (*module.named_parameters(recurse=False), *_mxfp4_scales(module))
    }


def _fp8_modules(model: nn.Module, config: PretrainedConfig) -> dict[str, nn.Module]:
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
    quantizer.quantization_config.dequantize = False  # on a CPU, it would dequantize
    before = dict(model.named_modules())
    quantizer.preprocess_model(model, dtype=next(model.parameters()).dtype)
    return {name: module for name, module in model.named_modules() if before.get(name) is not module}


def _mxfp4_modules(model: nn.Module, config: PretrainedConfig) -> dict[str, nn.Module]:
    """``replace_with_mxfp4_linear``'s choice, without the kernels it fetches from the Hub."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.quantizers.quantizers_utils import should_convert_module

    quantization = config.quantization_config
    skipped = quantization.get("modules_to_not_convert") if isinstance(quantization, dict) else None
    with torch.device("meta"):
        return {
            f"{name}.experts": Mxfp4GptOssExperts(config)
            for name, module in model.named_modules()
            if isinstance(module, GptOssMLP) and should_convert_module(f"{name}.experts", skipped)
        }


def _mxfp4_scales(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's ``*_scales`` of MXFP4 experts (kept in the kernels' precision config, not as parameters):
    one uint8 per 32 values, the blocks holding two values per byte."""
    if type(module).__name__ != "Mxfp4GptOssExperts":
        return []
    return [
        (
            f"{name}_scales",
            torch.empty(
                *blocks.shape[:-1], blocks.shape[-1] * 2 // MXFP4_VALUES_PER_SCALE, device="meta", dtype=torch.uint8
            ),
        )
        for name, blocks in (("gate_up_proj", module.gate_up_proj), ("down_proj", module.down_proj))
    ]


def track_published(
    recorder: StepRecorder, model: nn.Module, published: dict[str, PublishedTensor]
) -> list[torch.Tensor]:
    """Count the model's quantized parameters as published, and the scales beside them as parameters too. The
    new tensors are returned: the caller keeps them alive while the step is recorded."""
    parameters = dict(model.named_parameters())
    scales = []
    for name, tensor in published.items():
        if name in parameters:
            recorder.restate(parameters[name], tensor.shape, tensor.dtype)
        else:
            scales.append(torch.empty(tensor.shape, dtype=tensor.dtype))
            recorder.track_existing(scales[-1], Role.PARAMETER, name)
    return scales


def describe(config: PretrainedConfig) -> str:
    """The assumption the report states for a checkpoint of a modelled format."""
    if quant_method(config) in PACKED:
        from tracer.packed import packed_format  # tracer/packed.py builds on this module

        return (
            f"published in {packed_format(config).describe()}: gptqmodel's layers as transformers loads them "
            "(qweight, qzeros, scales and for GPTQ g_idx), not the repacking of its inference kernels; layers that "
            "are not nn.Linear (MoE models' fused experts) and the lm_head in --dtype; inference as the fused "
            "kernels allocate (the output only), training as the auto_trainable kernels (GPTQ keeps each "
            "layer's fp16 weight dequantized from forward to backward, AWQ dequantizes it beyond 1,024 rows)"
        )
    if quant_method(config) == "mxfp4":
        return (
            "published in MXFP4: the experts hold two FP4 values per byte, a uint8 scale per 32 and float32 biases "
            "(transformers' Mxfp4GptOssExperts with the kernels package on a Hopper or newer GPU; without it "
            "transformers dequantizes to bf16: --dequantize); the experts' activations are the bf16 path's, more "
            "than Triton's fused matmul_ogs allocates"
        )
    quantization = config.quantization_config
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    return (
        f"published in FP8 (float8_e4m3fn, float32 scales per {'x'.join(map(str, block)) if block else 'tensor'} "
        "block): transformers' FineGrainedFP8 modules, the lm_head, embeddings, norms and routers in --dtype; "
        "activations as its Triton matmul allocates them (the output only)"
    )


def refuse_with_tensor_parallelism(config: PretrainedConfig | None) -> None:
    if quant_method(config) in MODELLED:
        raise UserError(
            f"A checkpoint published in {quant_method(config)} is not modelled with tensor parallelism yet: use "
            "--tp 1, or --dequantize to count its weights in --dtype."
        )
