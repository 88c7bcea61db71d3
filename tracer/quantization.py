"""Frozen base weights stored as bitsandbytes stores them, with the temporaries its matmuls allocate.

Follows bitsandbytes 0.50: ``nn.Linear4bit`` / ``Params4bit`` and ``functional.quantize_4bit`` for NF4 with
double quantization (QLoRA), ``nn.Linear8bitLt`` for LLM.int8(); ``autograd/_functions.py`` (``MatMul4Bit``,
``MatMul8bitLt``) and ``backends/cuda/ops.py`` for what forward and backward allocate. The kernels are
emulated with tensor ops that allocate the same bytes, so that fake tensors can run them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from tracer.modules import output_layer

NF4_BLOCKSIZE = 64  # Linear4bit's blocksize (and BitsAndBytesConfig's default)
NESTED_BLOCKSIZE = 256  # the absmax of each NF4 block, quantized again in blocks of 256 (compress_statistics)
NF4_CODE_SIZE = 16  # the NF4 code book, float32
# gemm_4bit always runs its fused kernel for this many rows or fewer (_GEMM_4BIT_CUSTOM_FLOOR_M, decoding).
FUSED_KERNEL_MAX_ROWS = 4
NESTED_CODE_SIZE = 256  # the dynamic map of the nested quantization, float32


def quantize_base_weights(model: nn.Module, kind: str) -> None:
    """Replace the decoder layers' linear layers by quantized ones, as ``load_in_4bit`` / ``load_in_8bit``
    do (``replace_with_bnb_linear``: modules whose type is exactly ``nn.Linear``, not a subclass such as Llama 4's
    router, and GPT-2's ``Conv1D``; the lm_head stays in full precision)."""
    output = output_layer(model)
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child is output or not (type(child) is nn.Linear or isinstance(child, Conv1D)):
                continue
            weight = child.weight if isinstance(child, nn.Linear) else child.weight.t()  # Conv1D is (in, out)
            linear = _Shape(weight, child.bias)
            quantized = Linear8bitLt(linear) if kind == "int8" else Linear4bit(linear)
            setattr(module, child_name, quantized)


class _Shape:
    """What the quantized layers take from the layer they replace."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape


class Linear4bit(nn.Linear):
    """NF4 (or FP4: the same storage) weights: two 4-bit values per byte, one uint8 absmax per block of 64,
    quantized again in blocks of 256 (a float32 absmax each), an offset and the two code books."""

    def __init__(self, linear: _Shape) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight
        numel = weight.numel()
        blocks = -(-numel // NF4_BLOCKSIZE)
        self.weight = nn.Parameter(weight.new_empty(((numel + 1) // 2, 1), dtype=torch.uint8), requires_grad=False)
        self.bias = linear.bias
        self.register_buffer("absmax", weight.new_empty(blocks, dtype=torch.uint8))
        self.register_buffer("nested_absmax", weight.new_empty(-(-blocks // NESTED_BLOCKSIZE), dtype=torch.float32))
        self.register_buffer("offset", weight.new_empty((), dtype=torch.float32))
        self.register_buffer("code", weight.new_empty(NF4_CODE_SIZE, dtype=torch.float32))
        self.register_buffer("nested_code", weight.new_empty(NESTED_CODE_SIZE, dtype=torch.float32))
        self.compute_dtype = weight.dtype
        self.logical_weight_numel = numel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MatMul4Bit.apply(x, self.weight, self.absmax, self.offset, self.bias, self.out_features)


class _MatMul4Bit(torch.autograd.Function):
    """Forward: the fused kernel for at most 4 rows (decoding), else the dequantize-then-``F.linear`` path of
    ``gemm_4bit`` (``_dequant_linear_fallback``), which CUDA takes beyond 1536 rows and on most GPUs for
    training shapes: the nested absmax is dequantized to
    float32 and the offset added into a second buffer, the weight is dequantized to the compute dtype, all
    three live through the matmul. Only the packed weight is saved; backward dequantizes it again
    (``functional.dequantize_4bit``: the absmax in place, then the weight) for the input's gradient."""

    @staticmethod
    def forward(ctx, x, packed, absmax, offset, bias, out_features):
        ctx.save_for_backward(packed, absmax, offset)
        ctx.out_features = out_features
        rows = x.numel() // x.shape[-1]
        if rows <= FUSED_KERNEL_MAX_ROWS:  # the fused kernel reads the packed weight directly
            output = x.new_empty((*x.shape[:-1], out_features))
            return output if bias is None else output + bias
        absmax_dequantized = torch.empty_like(absmax, dtype=torch.float32)
        absmax_with_offset = absmax_dequantized + offset
        weight = _empty_weight(packed, out_features, x.dtype)
        output = nn.functional.linear(x, weight, bias)
        del absmax_dequantized, absmax_with_offset, weight
        return output

    @staticmethod
    def backward(ctx, grad_output):
        packed, absmax, offset = ctx.saved_tensors
        weight = _dequantize_4bit(packed, absmax, offset, ctx.out_features, grad_output.dtype)
        return torch.matmul(grad_output, weight), None, None, None, None, None


def _dequantize_4bit(packed, absmax, offset, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    dequantized_absmax = torch.empty_like(absmax, dtype=torch.float32)
    dequantized_absmax += offset
    weight = _empty_weight(packed, out_features, dtype)
    del dequantized_absmax
    return weight


def _empty_weight(packed: torch.Tensor, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight: two values per packed byte, whatever dtype stores the bytes (``quant_storage``)."""
    in_features = packed.nbytes * 2 // out_features
    return torch.empty((out_features, in_features), dtype=dtype, device=packed.device)


class Linear8bitLt(nn.Linear):
    """LLM.int8() weights (``has_fp16_weights=False``): int8 values (``CB``) and one float32 scale per output
    row (``SCB``)."""

    def __init__(self, linear: _Shape) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight
        self.weight = nn.Parameter(torch.empty_like(weight, dtype=torch.int8), requires_grad=False)
        self.bias = linear.bias
        self.register_buffer("scales", weight.new_empty(self.out_features, dtype=torch.float32))
        self.logical_weight_numel = weight.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MatMul8bitLt.apply(x, self.weight, self.scales, self.bias)


class _MatMul8bitLt(torch.autograd.Function):
    """Forward: the input is cast to fp16 and quantized row-wise (int8 values, a float32 scale per row), the
    int8 product accumulates in int32 and is dequantized into the output; the input is saved. Outlier
    columns (threshold 6.0) depend on the data and are assumed absent. Backward: the weight is dequantized
    to the input's dtype (``CB.to(dtype).mul_(SCB / 127)``) for the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, scales, bias):
        ctx.save_for_backward(x, weight, scales)
        rows = x.numel() // x.shape[-1]
        x16 = x.to(torch.float16)
        quantized = torch.empty_like(x16, dtype=torch.int8)
        row_scales = torch.empty(rows, dtype=torch.float32, device=x.device)
        del x16
        accumulated = torch.empty((rows, weight.shape[0]), dtype=torch.int32, device=x.device)
        output = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        del quantized, row_scales, accumulated
        return output if bias is None else output + bias

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, scales = ctx.saved_tensors
        dequantized = weight.to(x.dtype, copy=True).mul_(scales.unsqueeze(1).mul(1.0 / 127.0))
        grad = grad_output.to(x.dtype).reshape(-1, grad_output.shape[-1]).contiguous()
        return torch.matmul(grad, dequantized).view(x.shape), None, None, None
