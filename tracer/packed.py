"""GPTQ and AWQ checkpoints as transformers 5.24 holds them on a GPU: low-bit weights packed into int32 words with
fp16 scales per group, in the quantized linear layers of gptqmodel, the package both of transformers' quantizers
delegate to (``quantizer_gptq.py`` through optimum's ``GPTQQuantizer``, ``quantizer_awq.py`` through
``integrations/awq.py``). Followed from gptqmodel 7.7 and optimum 2.3, neither of which installs beside torch 2.13:
their code cannot run here, so the layout is read from their source, cited where it is used.

Which layers are replaced:

* GPTQ (optimum ``GPTQQuantizer.convert_model``): the layers under the decoder blocks (the first of optimum's
  ``BLOCK_PATTERNS`` the model has, e.g. ``model.layers``) whose type is exactly ``nn.Linear`` (not a subclass such
  as Llama 4's router) or GPT-2's ``Conv1D`` (``get_layers``), narrowed by ``modules_in_block_to_quantize``; the
  embeddings and the lm_head stay in ``--dtype``.
* AWQ (``replace_with_awq_linear``): every ``nn.Linear``, subclasses included, but those transformers' own
  ``AwqQuantizer.get_modules_to_not_convert`` skips (``modules_to_not_convert``, the lm_head, tied weights); for the
  model types of ``AWQ_SCALES_MAPPINGS`` the MLP's activation is wrapped in ``ScaledActivation``, which divides it
  by a scale vector the checkpoint stores.

What each holds (``GPTQQuantLinear._register_gptq_buffers``; ``AWQuantLinear.__init__``), all buffers: GPTQ's
``qweight`` int32 ``(ceil(in x bits / 32), out)``, ``qzeros`` int32 ``(ceil(in / group), ceil(out x bits / 32))``,
``scales`` fp16 ``(ceil(in / group), out)``, ``g_idx`` int32 ``(in,)``; AWQ's (GEMM format) ``qweight`` int32
``(in, ceil(out x bits / 32))``, ``qzeros`` int32 and ``scales`` fp16 with ``in // group`` rows; a bias in fp16.
This is the layout loaded from the checkpoint. At load, ``hf_gptqmodel_post_init`` lets the kernel gptqmodel
picks repack it: the inference kernels it prefers on Hopper (Swordfish, Machete, Marlin; tile-aligned layers
only, so nothing is padded) keep the packed values and scales and drop a symmetric checkpoint's zeros (Marlin also
``g_idx`` without act-order: about 1/group of the weight bytes less); Machete and Swordfish store an asymmetric
checkpoint's zero points, AWQ's, in fp16 (about 4/group more); Marlin adds 512 bytes of workspace per layer.
These differences are not modelled.

What a matmul allocates:

* Inference (``model.eval()``): the fused kernels read the packed weight and allocate the output (their scratch,
  such as Marlin's fp32 reduction buffer, is not counted).
* Training (LoRA adapters on the frozen base, the only fine-tuning transformers allows on these checkpoints): the
  inference kernels refuse ``model.train()`` (``BaseQuantLinear.train``: ``SUPPORTS_TRAINING = False``), so the
  checkpoint is loaded with ``backend="auto_trainable"``, which picks on CUDA ``TritonV2Linear`` for GPTQ and
  ``AwqGEMMLinear`` for AWQ. GPTQ's training forward is ``TorchLinear._forward_eager``: the weight dequantized to
  fp16 (``dequantize_weight``, compiled into one kernel), cast to the input's dtype, and ``torch.matmul``, whose
  autograd keeps that weight for the input's gradient until the layer's backward. AWQ's ``AwqGemmFn`` keeps only the
  packed tensors: beyond 1,024 rows it dequantizes the weight for the matmul and frees it, and its backward
  dequantizes it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from tracer.errors import UserError
from tracer.published import PublishedTensor

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PACK_BITS = 32  # gptqmodel packs into int32 words (pack_dtype)
SCALE_DTYPE = torch.float16  # scales, the dequantized weight and the bias, whatever the model's dtype
GPTQ_BITS = (2, 3, 4, 8)  # GPTQConfig.post_init
GPTQ_FORMATS = ("gptq", "gptq_v2")  # the same tensors; v2 stores the zeros without the -1 offset
AWQ_BITS = (4,)  # every AWQ GEMM kernel's SUPPORTS_BITS
AWQ_FORMAT = "gemm"  # AwqFormat.GEMM, the default; GEMV and GEMV_FAST lay the words out otherwise
AWQ_DEQUANTIZE_ROWS = 1024  # AwqGemmFn: more rows than this dequantize the weight and run torch.matmul
COUNT_IN_DTYPE = (
    "count its weights in --dtype with --dequantize (inference) or a config.json without quantization_config."
)
# optimum/gptq/constants.py: where the decoder blocks are, first match wins
BLOCK_PATTERNS = (
    "transformer.h",
    "model.decoder.layers",
    "gpt_neox.layers",
    "model.layers",
    "model.language_model.layers",
    "h",
    "decoder.layers",
    "layers",
)
# transformers/integrations/awq.py: model types whose MLP activation AWQ wraps in ScaledActivation
AWQ_SCALES_MAPPINGS = {
    "starcoder2": ("act", "c_fc"),
    "RefinedWebModel": ("act", "dense_h_to_4h"),
    "falcon": ("act", "dense_h_to_4h"),
    "mpt": ("act", "up_proj"),
    "gptj": ("act", "fc_in"),
    "gpt_neox": ("act", "dense_h_to_4h"),
    "gpt_bigcode": ("act", "c_fc"),
    "bloom": ("gelu_impl", "dense_h_to_4h"),
}


@dataclass(frozen=True)
class PackedFormat:
    """What a GPTQ or AWQ ``quantization_config`` says about the layout."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group over all the input features
    modules_in_block: tuple[str, ...] | None = None  # GPTQ's modules_in_block_to_quantize, flattened

    def groups(self, in_features: int) -> int:
        group = in_features if self.group_size == -1 else self.group_size
        # GPTQ rounds a partial group up (math.ceil), AWQ down (//); checkpoints have whole groups
        return -(-in_features // group) if self.method == "gptq" else in_features // group

    def describe(self) -> str:
        group = "per column" if self.group_size == -1 else f"per {self.group_size} inputs"
        return f"{self.method.upper()} {self.bits}-bit, fp16 scales {group}"


def packed_format(config: PretrainedConfig) -> PackedFormat:
    """The checkpoint's layout, refusing the variants whose tensors are laid out otherwise."""
    quantization = config.quantization_config
    fields = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = str(fields.get("quant_method")).lower()
    bits, group_size = fields.get("bits", 4), fields.get("group_size", 128)
    if not isinstance(group_size, int) or (group_size != -1 and group_size < 1):
        raise UserError(f"quantization_config.group_size {group_size!r} must be -1 or a positive integer.")
    if method == "gptq":
        layout = str(fields.get("checkpoint_format") or fields.get("format") or "gptq").lower()
        if bits not in GPTQ_BITS or layout not in GPTQ_FORMATS:
            raise UserError(
                f"A GPTQ checkpoint of {bits} bits in format {layout!r} is not modelled (GPTQ in formats "
                f"{', '.join(GPTQ_FORMATS)} of {', '.join(map(str, GPTQ_BITS))} bits is): {COUNT_IN_DTYPE}"
            )
        blocks = fields.get("modules_in_block_to_quantize")
        names = tuple(name for group in blocks for name in group) if blocks else None
        return PackedFormat(method, bits, group_size, modules_in_block=names)
    layout = str(fields.get("version") or fields.get("format") or AWQ_FORMAT).lower()
    if bits not in AWQ_BITS or layout != AWQ_FORMAT:
        raise UserError(
            f"An AWQ checkpoint of {bits} bits in version {layout!r} is not modelled (AWQ {AWQ_FORMAT} of 4 bits is): "
            + COUNT_IN_DTYPE
        )
    return PackedFormat(method, bits, group_size)


def packed_tensors(fmt: PackedFormat, in_features: int, out_features: int, bias: bool) -> dict[str, PublishedTensor]:
    """The tensors one replaced linear layer holds, by name (the module docstring cites their source)."""
    groups = fmt.groups(in_features)
    words = math.ceil(out_features * fmt.bits / PACK_BITS)
    if fmt.method == "gptq":
        tensors = {
            "qweight": PublishedTensor((math.ceil(in_features * fmt.bits / PACK_BITS), out_features), torch.int32),
            "qzeros": PublishedTensor((groups, words), torch.int32),
            "scales": PublishedTensor((groups, out_features), SCALE_DTYPE),
            "g_idx": PublishedTensor((in_features,), torch.int32),
        }
    else:
        tensors = {
            "qweight": PublishedTensor((in_features, words), torch.int32),
            "qzeros": PublishedTensor((groups, words), torch.int32),
            "scales": PublishedTensor((groups, out_features), SCALE_DTYPE),
        }
    if bias:
        tensors["bias"] = PublishedTensor((out_features,), SCALE_DTYPE)
    return tensors


def packed_modules(model: nn.Module, config: PretrainedConfig, fmt: PackedFormat) -> dict[str, nn.Module]:
    """The layers transformers replaces by quantized ones, by name."""
    if fmt.method == "awq":
        from transformers.quantizers import AutoHfQuantizer
        from transformers.quantizers.quantizers_utils import should_convert_module

        quantizer = AutoHfQuantizer.from_config(config.quantization_config, pre_quantized=True)
        skipped = quantizer.get_modules_to_not_convert(
            model, quantizer.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules, True
        )
        return {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and should_convert_module(name, skipped)
        }
    names = [name for name, _ in model.named_modules()]
    block = next((pattern for pattern in BLOCK_PATTERNS if any(name.startswith(pattern) for name in names)), None)
    if block is None:
        raise UserError(f"optimum finds no decoder blocks in {type(model).__name__} to quantize with GPTQ.")
    return {
        name: module
        for name, module in model.named_modules()
        if name.startswith(block)
        and (type(module) is nn.Linear or isinstance(module, Conv1D))
        and (fmt.modules_in_block is None or any(name.endswith(kept) for kept in fmt.modules_in_block))
    }


def replace_packed_linears(model: nn.Module, config: PretrainedConfig) -> None:
    """Swap the layers transformers quantizes for ``PackedLinear`` (and AWQ's scaled activations in)."""
    fmt = packed_format(config)
    for name, module in packed_modules(model, config, fmt).items():
        if not _returns_its_output(module):
            raise UserError(
                f"transformers' AWQ loading replaces {name}, a {type(module).__name__} (an nn.Linear returning more "
                "than its output), by a quantized linear layer, and the model then fails: a checkpoint that loads "
                "lists it in quantization_config.modules_to_not_convert; add it there."
            )
        in_features, out_features = (
            module.weight.shape
            if isinstance(module, Conv1D)
            else (module.in_features, module.out_features)  # (in, out)
        )
        packed = PackedLinear(fmt, in_features, out_features, module.bias is not None, module.weight.device)
        model.set_submodule(name, packed)
    if fmt.method == "awq" and config.model_type in AWQ_SCALES_MAPPINGS:
        _scale_activations(model, *AWQ_SCALES_MAPPINGS[config.model_type])


def _returns_its_output(module: nn.Module) -> bool:
    """Whether the layer returns one tensor, as the quantized layer replacing it does (Llama 4's router, an
    ``nn.Linear`` subclass, returns its scores and logits)."""
    if isinstance(module, Conv1D) or type(module).forward is nn.Linear.forward:
        return True
    return isinstance(module(module.weight.new_empty((1, module.in_features))), torch.Tensor)


def _scale_activations(model: nn.Module, activation: str, before: str) -> None:
    """``replace_quantization_scales``: an MLP's activation divided by the checkpoint's scales, one per output of the
    layer before it."""
    for parent in list(model.modules()):
        child = parent._modules.get(activation)
        layer = getattr(parent, before, None)
        if child is not None and layer is not None:
            floating = next(p for p in model.parameters() if p.is_floating_point())  # loaded in the model's dtype
            scales = torch.empty(layer.out_features, device=floating.device, dtype=floating.dtype)
            parent._modules[activation] = ScaledActivation(child, scales)


class ScaledActivation(nn.Module):
    """gptqmodel's ``ScaledActivation``: ``act(x) / scales``."""

    def __init__(self, act: nn.Module, scales: torch.Tensor) -> None:
        super().__init__()
        self.act = act
        self.scales = nn.Parameter(scales, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x) / self.scales.view(1, 1, -1)


class PackedLinear(nn.Linear):
    """A linear layer of a GPTQ or AWQ checkpoint: its packed tensors as buffers, as gptqmodel registers them (so
    FSDP2 and ZeRO-3, which shard parameters, leave them whole), and what its kernels allocate. A subclass of
    ``nn.Linear`` without a weight, so that peft wraps it as it wraps gptqmodel's layers: the adapters' input and
    output are the same."""

    weight = None  # no dense weight: peft reads the packed qweight for the adapters' device, as for gptqmodel's

    def __init__(self, fmt: PackedFormat, in_features: int, out_features: int, bias: bool, device) -> None:
        nn.Module.__init__(self)
        self.method, self.in_features, self.out_features = fmt.method, in_features, out_features
        for name, tensor in packed_tensors(fmt, in_features, out_features, bias).items():
            self.register_buffer(name, torch.empty(tensor.shape, dtype=tensor.dtype, device=device))
        if not bias:
            self.bias = None
        # the parameters the layer stands for (tracer/modules.py counts them: its tensors are buffers)
        self.packed_parameter_numel = in_features * out_features + (out_features if bias else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:  # the fused kernels: the output only, the bias added inside
            return x.new_empty((*x.shape[:-1], self.out_features))
        if self.method == "awq":  # AwqGEMMLinear.forward: the input in a 16-bit dtype, the output in the input's
            compute = x if x.dtype in (torch.float16, torch.bfloat16) else x.to(SCALE_DTYPE)
            out = _AwqGemm.apply(compute.contiguous(), self.qweight, self.bias, self.out_features)
            return out.to(x.dtype)
        # TorchLinear._forward_eager: dequantize, cast to the input's dtype, matmul (which saves the weight)
        weight = x.new_empty((self.in_features, self.out_features), dtype=self.scales.dtype)
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        out = torch.matmul(x.reshape(-1, self.in_features), weight).reshape(*x.shape[:-1], self.out_features)
        del weight
        if self.bias is not None:
            out.add_(self.bias if self.bias.dtype == out.dtype else self.bias.to(out.dtype))
        return out


class _AwqGemm(torch.autograd.Function):
    """``AwqGemmFn``: beyond ``AWQ_DEQUANTIZE_ROWS`` rows the weight dequantized to fp16 and multiplied, else the
    fused GEMM's output; the bias added out of place. Backward dequantizes the weight again for the input's
    gradient."""

    @staticmethod
    def forward(ctx, x, qweight, bias, out_features):
        ctx.save_for_backward(qweight)  # with qzeros and scales: tensors the layer holds anyway
        ctx.input_shape = x.shape
        rows, in_features = x.numel() // x.shape[-1], x.shape[-1]
        flat = x.reshape(rows, in_features)
        if rows > AWQ_DEQUANTIZE_ROWS:
            weight = flat.new_empty((in_features, out_features), dtype=SCALE_DTYPE)
            out = torch.matmul(flat, weight.to(flat.dtype))
            del weight
        else:
            out = flat.new_empty((rows, out_features))
        if bias is not None:
            out = out + (bias if bias.dtype == out.dtype else bias.to(out.dtype))
        return out.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_output):
        (qweight,) = ctx.saved_tensors
        weight = qweight.new_empty((ctx.input_shape[-1], grad_output.shape[-1]), dtype=SCALE_DTYPE)
        weight = weight.to(grad_output.dtype)
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        return torch.matmul(grad, weight.transpose(-1, -2)).reshape(ctx.input_shape), None, None, None
