"""The weights one vLLM tensor-parallel rank loads, from the model's parameters as transformers names them.

vLLM builds its own layers; each splits its weight over the ``--tensor-parallel-size`` ranks by a rule of
vllm/model_executor/layers/:

* ``ColumnParallelLinear`` and ``MergedColumnParallelLinear`` (linear.py): the output features divided by
  the degree (weight and bias); q, gate, up and the MLA up-projections.
* ``QKVParallelLinear`` (linear.py): the query heads divided; the key/value heads divided too, or, when the
  degree reaches their number, one head per rank (``num_kv_heads = 1``, ``num_kv_head_replicas = tp //
  total_num_kv_heads``).
* ``RowParallelLinear`` (linear.py): the input features divided; the bias is whole on every rank.
* ``VocabParallelEmbedding`` / ``ParallelLMHead`` (vocab_parallel_embedding.py): the vocabulary padded to a
  multiple of ``DEFAULT_VOCAB_PADDING_SIZE`` (64), then divided; a tied lm_head is the embedding itself.
* ``FusedMoE`` (fused_moe/layer.py) without expert parallelism: every expert on every rank, its
  ``intermediate_size_per_partition = intermediate_size // tp``; the router is a ``ReplicatedLinear``.
* ``ReplicatedLinear`` and everything else (norms, MLA's down-projections ``q_a_proj`` and
  ``kv_a_proj_with_mqa``, routers): whole on every rank.
* gpt-oss' attention sinks are divided with the heads (``GptOssAttention``: ``num_attention_heads // tp``).

With ``--quantization fp8`` (quantization/fp8.py, ``Fp8OnlineLinearMethod`` and ``Fp8OnlineMoEMethod``: a 16-bit
checkpoint quantized as it loads, layer by layer) the column-, row- and QKV-parallel layers and the experts hold
one byte per weight and one float32 scale per layer; embeddings, the lm_head, norms and the layers built without a
quantization config (routers) keep the model's dtype.

gpt-oss's MXFP4 experts (quantization/mxfp4.py, ``Mxfp4MoEMethod`` with the Triton backend vLLM picks on Hopper,
fused_moe/oracle/mxfp4.py) hold per rank an intermediate size rounded up to 64, two FP4 values per byte and a
uint8 scale per 32 as loaded, then ``_swizzle_mxfp4`` lays the values out again padded to 64 and the scales padded
to 256 rows, dropping the loaded values but keeping the loaded scales; the biases become float32.

GPTQ and AWQ checkpoints are followed from vLLM 0.19.0, the version of the published logs (paths under
vllm/model_executor/):

* The method: ``ModelConfig._verify_quantization`` (vllm/config/model.py) asks the Marlin overrides first.
  ``GPTQMarlinConfig.is_gptq_marlin_compatible`` (layers/quantization/gptq_marlin.py) takes a ``gptq`` checkpoint
  whose ``bits`` and ``sym`` are (4, true) or (8, true), whose ``group_size`` is -1, 32, 64 or 128
  (``MARLIN_SUPPORTED_GROUP_SIZES``, layers/quantization/utils/marlin_utils.py) and which states ``desc_act``;
  ``AWQMarlinConfig.is_awq_marlin_compatible`` (awq_marlin.py) an ``awq`` one of 4 bits with ``zero_point`` (uint4 is
  Marlin's one zero-point type, ``query_marlin_supported_quant_types``) and those group sizes; both on sm75 or
  newer (``get_min_capability``). Other checkpoints run on the older ``gptq`` (ExLlama) and ``awq`` kernels and are
  refused here, as are AWQ's GEMV layouts (vLLM reads every AWQ checkpoint as GEMM-packed), GPTQ's ``dynamic``
  per-module overrides and a quantized lm_head.
* The kernel, layer by layer: ``choose_mp_linear_kernel`` (kernels/linear/__init__.py) takes the first of
  ``_POSSIBLE_KERNELS`` that can implement the fused layer's shape on the rank (kernels/linear/mixed_precision/):
  ``MacheteLinearKernel`` (sm90 exactly; group -1, 64 or 128; input features per rank a multiple of 64, output
  features of 128, ``check_machete_supports_shape``; not an act-order layer whose input is split), then
  ``AllSparkLinearKernel`` (sm80 to sm89, 8-bit GPTQ per channel only: refused here), then ``MarlinLinearKernel``
  (input a multiple of 128, output of 64, whole groups per rank: ``verify_marlin_supports_shape``). An AWQ layer
  Marlin's shapes refuse (``check_marlin_supports_layer``) falls back to ``AWQLinearMethod`` (awq.py), which keeps
  the checkpoint's tensors as loaded.
* What a layer keeps after ``process_weights_after_loading``, per rank (``pack = 32 / bits``): the weight repacked
  (``gptq_marlin_repack``, ``machete_prepack_B``; AWQ's first by ``_convert_awq_to_standard_format``) into the same
  ``in x out x bits / 8`` bytes, and the scales, ``groups x out`` in the model dtype. GPTQ on Machete also keeps the
  loaded ``qzeros`` (``groups x out / pack`` int32) and ``g_idx`` (an int32 per input feature), and with act-order
  the activations' permutation ``perm`` (as many); on Marlin its zeros become an empty tensor and ``g_idx`` is kept
  sorted beside ``g_idx_sort_indices`` with act-order, both empty without (``marlin_sort_g_idx``,
  ``marlin_make_empty_g_idx``). AWQ's zero points become Marlin's packed int32 (``marlin_zero_points``, the bytes
  loaded) or, on Machete, ``-scale x zero`` in the model dtype, as large as the scales. Marlin's workspace
  (``marlin_make_workspace_new``: an int32 per SM, 528 bytes per layer on an H100) is not counted.
* Tensor parallelism: the column-parallel layers (qkv, gate_up) split the output and keep every input group; the
  row-parallel ones (o, down) split the input and their scales and zeros with it, unless the checkpoint is act-order
  or per channel (``marlin_repeat_scales_on_all_ranks``): then every rank holds all ``input / group`` rows
  (``GPTQMarlinLinearMethod.create_weights``).
* Unquantized: the embeddings, the lm_head, norms and the linear layers ``modules_to_not_convert`` names (AWQ,
  ``is_layer_skipped``) or ``modules_in_block_to_quantize`` leaves out (GPTQ, ``is_layer_gptq_quantized``), in the
  served dtype. Without those lists vLLM reads the quantized layers from the safetensors' dtypes
  (``maybe_update_config``), which a config does not carry: every linear layer of the decoder is counted quantized.
  ``dtype="auto"`` is the checkpoint's ``torch_dtype`` (``_get_and_verify_dtype``), float16 for most GPTQ and AWQ
  checkpoints; both methods take float16 or bfloat16 (``get_supported_act_dtypes``).

MoE experts of a GPTQ or AWQ checkpoint (one ``FusedMoE`` per MoE layer, fused_moe/layer.py: ``local_num_experts``
experts of ``hidden`` inputs and ``2 x inter`` gate/up outputs (w13), ``inter`` inputs and ``hidden`` outputs (w2),
where ``inter = intermediate_size // tp``; ``intermediate_size_full`` is passed to ``GPTQMarlinMoEMethod`` for
act-order):

* The method: ``GPTQMarlinConfig.get_quant_method`` and ``AWQMarlinConfig.get_quant_method`` give a ``FusedMoE``
  ``GPTQMarlinMoEMethod`` (gptq_marlin.py) or ``AWQMarlinMoEMethod`` (awq_marlin.py) when
  ``check_moe_marlin_supports_layer`` (marlin_utils.py) holds: ``hidden % 128 == 0``, ``inter % max(64, group_size)
  == 0`` and the router's weight not applied to the input (Llama 4's ``apply_router_weight_on_input``); otherwise
  both fall back to ``MoeWNA16Method`` (moe_wna16.py), whatever the GPU. GPTQ's ``modules_in_block_to_quantize`` does
  not reach the experts (only ``dynamic``, refused here); AWQ's ``modules_to_not_convert`` does (``is_layer_skipped``
  on ``...mlp.experts``, substring): skipped experts are ``UnquantizedFusedMoEMethod``'s, in the served dtype.
* ``GPTQMarlinMoEMethod`` keeps per layer and rank, after ``process_weights_after_loading``: ``w13_qweight`` and
  ``w2_qweight`` repacked by ``gptq_marlin_moe_repack`` into the same ``experts x in x out x bits / 8`` bytes; the
  scales ``w13_scales`` (``hidden / group`` rows of ``2 x inter``) and ``w2_scales`` (``inter / group`` rows of
  ``hidden``, or ``intermediate_size_full / group`` with act-order: ``load_full_w2``), one row each per channel,
  permuted in place of the loaded ones (``marlin_moe_permute_scales``, same shape), in the model dtype; the loaded
  ``w13_qzeros``/``w2_qzeros`` as created, ``groups x out / pack`` in the model dtype (``params_dtype``, not int32),
  never freed though a symmetric checkpoint's kernel does not read them; with act-order ``w13_g_idx``/``w2_g_idx``
  sorted and their ``_sort_indices``, an int32 per input feature and expert each (``hidden`` and ``inter``), without it
  empty tensors.
* ``AWQMarlinMoEMethod``: the weights repacked (``awq_marlin_moe_repack``) into the same bytes; scales ``hidden /
  group x 2 x inter`` and ``inter / group x hidden`` in the model dtype (split with the intermediate size); the zero
  points repacked by ``moe_awq_to_marlin_zero_points`` into int32 tensors of the loaded shape (``groups x out /
  pack``); empty sort indices, no ``g_idx``. It takes 4 bits only and a group size, not -1 (``hidden //
  group_size`` would be negative).
* ``MoeWNA16Method`` has no ``process_weights_after_loading``: it keeps what its loader writes, the weights as uint8
  (``experts x out x in x bits / 8``), the scales in the model dtype and, for AWQ's zero points, uint8 zeros of
  ``out x bits / 8`` rows, all with a group size halved until it divides ``inter`` and ``hidden`` (the loaded scales
  repeated; ``assert group_size >= 32``, a group of -1 fails); GPTQ's ``g_idx`` and symmetric zeros are empty
  (act-order is dropped: its loader skips ``g_idx``).
* Both Marlin methods also allocate ``marlin_make_workspace_new(device, 4)``, four int32 per SM and layer (2,112
  bytes on an H100's 132 SMs), not counted, as for the dense layers. ``fused_marlin_moe`` sizes its intermediate
  caches as ``fused_experts`` does, so the profile run's MoE peak (analysis/vllm.py) is unchanged.
* Expert parallelism (``--enable-expert-parallel``, not a flag here) would give each rank ``experts // ep`` experts
  (one more on the first ``experts % ep``, ``determine_expert_map``) with the whole intermediate size.

``get_rope`` (rotary_embedding.py) adds one ``cos_sin_cache`` buffer per distinct rotary setup,
``max_position_embeddings x rotary_dim`` in the model's dtype, shared by every layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from analysis.allocator import CachingAllocator
from tracer.errors import UserError
from tracer.packed import AWQ_FORMAT, GPTQ_FORMATS, PACK_BITS
from tracer.published import MXFP4_VALUES_PER_SCALE
from tracer.units import round_up

VOCAB_PADDING = 64  # vocab_parallel_embedding.py: DEFAULT_VOCAB_PADDING_SIZE
FP8_SCALE_BYTES = 4  # one float32 scale per layer (per tensor), as scaled_fp8_quant computes it
MXFP4_TRITON_ALIGNMENT = 64  # oracle/mxfp4.py: the intermediate size per rank rounded up for the Triton backend
WNA16 = ("gptq", "awq")  # checkpoints vLLM runs on its Marlin and Machete kernels
GPTQ_MARLIN_TYPES = ((4, True), (8, True))  # GPTQMarlinConfig.TYPE_MAP: (bits, sym)
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)  # marlin_utils.py: MARLIN_SUPPORTED_GROUP_SIZES
MACHETE_GROUP_SIZES = (-1, 64, 128)  # machete_utils.py: query_machete_supported_group_sizes for 16-bit activations
MACHETE_BLOCK = (64, 128)  # machete_utils.py: MACHETE_PREPACKED_BLOCK_SHAPE, input and output features per rank
MARLIN_MIN_THREAD = (128, 64)  # marlin_utils.py: GPTQ_MARLIN_MIN_THREAD_K and _N, input and output features per rank
HOPPER = (9, 0)  # MacheteLinearKernel.can_implement: is_device_capability(90)
# vllm/v1/attention/backends/mla/flashinfer_mla.py (0.19.0) makes g_fi_workspace = torch.zeros(128 MiB, uint8) on the
# GPU as it is imported, which the first MLA attention does while vLLM lists the MLA backends of a capability-9 GPU
# (platforms/cuda.py get_valid_backends imports each, FLASHINFER_MLA among them, before ruling it out).
FLASHINFER_MLA_WORKSPACE = 128 * 1024**2
# The projections vLLM and SGLang fuse into one parameter (QKVParallelLinear, MergedColumnParallelLinear), made where
# the first of them is: the parameter's name with the projection's replaced by the fused one's.
FUSED_ON_LOAD = (
    (re.compile(r"\.[qkv]_proj\.(weight|bias)$"), r".qkv_proj.\1"),
    (re.compile(r"\.(gate|up)_proj\.weight$"), ".gate_up_proj.weight"),
)
ROTARY_MADE_AFTER = re.compile(r"\.o_proj\.weight$")  # the first attention makes the rotary embedding after it
MIN_CAPABILITY = (7, 5)  # GPTQMarlinConfig's and AWQMarlinConfig's get_min_capability; Marlin's quant types from sm75
INDEX_BYTES = torch.int32.itemsize  # g_idx, g_idx_sort_indices and Machete's perm are int32
WORD_BYTES = torch.int32.itemsize  # packed weights and zero points: int32 words of ``pack`` values
BYTE_BYTES = torch.uint8.itemsize  # MoeWNA16Method packs its weights and zeros into uint8
MOE_MARLIN_HIDDEN = 128  # check_moe_marlin_supports_layer: hidden % 128
MOE_MARLIN_INTERMEDIATE = 64  # check_moe_marlin_supports_layer: intermediate per rank % max(64, group_size)
MOE_WNA16_MIN_GROUP = 32  # MoeWNA16Method.create_weights: assert group_size >= 32 once halved
MOE_METHODS = {"gptq": "GPTQMarlinMoEMethod", "awq": "AWQMarlinMoEMethod"}
MOE_WNA16 = "MoeWNA16Method"
ROUTER_WEIGHT_ON_INPUT = ("llama4", "llama4_text")  # Llama4MoE: FusedMoE(apply_router_weight_on_input=True)

_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head|wte|word_embeddings|embed_in|embed_out)\.weight$")
_KEY_VALUE = re.compile(r"\.(k_proj|v_proj)\.(weight|bias)$")
_COLUMN = re.compile(
    r"\.(q_proj|gate_proj|up_proj|gate_up_proj|c_fc|fc1|w1|w3|q_b_proj|kv_b_proj|query_key_value|dense_h_to_4h"
    r"|qkv_proj)\.(weight|bias)$"
)
_ROW = re.compile(r"\.(o_proj|down_proj|c_proj|fc2|w2|dense|dense_4h_to_h|out_proj)\.weight$")
_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_EXPERT_WEIGHTS = (".experts.gate_up_proj", ".experts.down_proj")  # transformers' fused 3-D experts
_SINKS = re.compile(r"\.sinks$")
_REPLICATED = re.compile(r"\.(gate|router|q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)$")


@dataclass(frozen=True)
class RankWeights:
    parameter_bytes: int  # the rank's share of every parameter of the language model
    rotary_bytes: int  # the cos/sin caches get_rope keeps
    kernels: dict[str, int] = field(default_factory=dict)  # GPTQ/AWQ: vLLM's kernel -> how many layers run on it
    vision_bytes: int = 0  # a multimodal checkpoint's vision tower and projector
    # What the caching allocator's blocks hold beyond the tensors (a request of 10 MiB or more gets a segment rounded
    # up to 2 MiB, handed out whole when less than 1 MiB would be left): max_memory_allocated counts blocks
    rounding_bytes: int = 0
    workspace_bytes: int = 0  # buffers a module makes as it is imported while the model is built

    @property
    def total(self) -> int:
        return self.parameter_bytes + self.rotary_bytes + self.vision_bytes + self.rounding_bytes + self.workspace_bytes


def vision_bytes(multimodal, tp: int, dtype: torch.dtype) -> int | None:
    """The vision tower and the projector of a multimodal checkpoint, which vLLM loads beside its language model,
    on one of ``tp`` ranks: the weights of their linear layers split over the ranks (vLLM's vision encoders and
    projectors build them as ``QKVParallelLinear``, ``ColumnParallelLinear`` and ``RowParallelLinear``:
    gemma3_mm.py's SigLIP, pixtral.py, mllama4.py), everything else (norms, embeddings, biases) whole. None when
    transformers has no image-text-to-text model for the config."""
    from transformers import AutoModelForImageTextToText

    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(multimodal, dtype=dtype)
    except ValueError:  # "Unrecognized configuration class ... for this kind of AutoModel"
        return None
    language = {id(parameter) for parameter in model.get_decoder().parameters()}
    language |= {id(parameter) for parameter in model.get_output_embeddings().parameters()}
    split = {id(module.weight) for module in model.modules() if isinstance(module, nn.Linear)}
    return sum(
        (parameter.numel() // tp if id(parameter) in split else parameter.numel()) * parameter.element_size()
        for parameter in model.parameters()
        if id(parameter) not in language
    )


@dataclass(frozen=True)
class Wna16:
    """A GPTQ or AWQ ``quantization_config`` as vLLM 0.19 reads it (``GPTQMarlinConfig``, ``AWQMarlinConfig``)."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group over every input feature
    desc_act: bool  # GPTQ's act-order; GPTQMarlinConfig drops it when there is one group
    quantized: tuple[str, ...] | None  # GPTQ's modules_in_block_to_quantize; None: every linear layer
    skipped: tuple[str, ...]  # AWQ's modules_to_not_convert

    @property
    def pack(self) -> int:
        return PACK_BITS // self.bits

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer ``module`` (its unfused name) is quantized: substring matches, as vLLM's
        ``is_layer_gptq_quantized`` and ``is_layer_skipped(skip_with_substr=True)``."""
        if any(name in module for name in self.skipped):
            return False
        return self.quantized is None or any(name in module for name in self.quantized)

    def quantizes_experts(self, module: str) -> bool:
        """Whether the ``FusedMoE`` ``module`` (``...mlp.experts``) is quantized: GPTQ gives every one its MoE method
        (``get_moe_quant_method``; only ``dynamic`` skips one), AWQ skips those ``modules_to_not_convert`` names."""
        return not any(name in module for name in self.skipped)


def wna16_format(config) -> Wna16:
    """The checkpoint's layout, refusing what vLLM 0.19 does not run on its Marlin or Machete kernels."""
    quantization = config.quantization_config
    fields = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = str(fields.get("quant_method")).lower()
    bits, group_size = fields.get("bits"), fields.get("group_size")
    fix = "Pass a config.json without quantization_config to size the 16-bit model."
    if group_size not in MARLIN_GROUP_SIZES:
        raise UserError(
            f"{method.upper()} group_size {group_size}: vLLM runs group sizes {', '.join(map(str, MARLIN_GROUP_SIZES))}"
            f" on Marlin (MARLIN_SUPPORTED_GROUP_SIZES) and others on its older {method} kernels, which are not "
            f"modelled. {fix}"
        )
    if fields.get("lm_head"):
        raise UserError(f"A {method.upper()} checkpoint with a quantized lm_head is not modelled. {fix}")
    if method == "gptq":
        sym, desc_act = fields.get("sym"), fields.get("desc_act")
        layout = str(fields.get("checkpoint_format") or "gptq").lower()
        if (bits, sym) not in GPTQ_MARLIN_TYPES or desc_act is None or layout not in GPTQ_FORMATS:
            raise UserError(
                f"GPTQ with bits={bits}, sym={sym}, desc_act={desc_act}, format {layout!r}: vLLM runs symmetric 4- and "
                "8-bit GPTQ checkpoints that state desc_act on gptq_marlin (is_gptq_marlin_compatible); this one would "
                f"load on its ExLlama gptq kernels, which are not modelled. {fix}"
            )
        if fields.get("dynamic"):
            raise UserError(f"GPTQ's dynamic per-module overrides (bits, group size by layer) are not modelled. {fix}")
        blocks = fields.get("modules_in_block_to_quantize") or ()
        names = tuple(name for group in blocks for name in ([group] if isinstance(group, str) else group))
        return Wna16(method, bits, group_size, bool(desc_act) and group_size != -1, names or None, ())
    layout = str(fields.get("version") or AWQ_FORMAT).lower()
    if layout != AWQ_FORMAT:
        raise UserError(
            f"AWQ version {layout!r}: vLLM reads every AWQ checkpoint as GEMM-packed (awq.py), so a {layout} "
            f"checkpoint does not load. Use the checkpoint's GEMM export. {fix}"
        )
    if bits != 4 or not fields.get("zero_point") or group_size == -1:
        raise UserError(
            f"AWQ with bits={bits}, zero_point={fields.get('zero_point')}, group_size={group_size}: vLLM runs 4-bit "
            "AWQ with zero points and groups on awq_marlin (is_awq_marlin_compatible); this one would load on its "
            f"older awq kernels, which are not modelled. {fix}"
        )
    skipped = tuple(fields.get("modules_to_not_convert") or ())
    return Wna16(method, bits, group_size, False, None, skipped)


def rank_weights(
    model: nn.Module,
    config,
    tp: int,
    quantization: str | None = None,
    compute_capability: tuple[int, int] = HOPPER,
) -> RankWeights:
    """What one of ``tp`` ranks holds of ``model`` (built on the meta device) once vLLM has loaded it: its linear
    layers and experts in FP8 with ``--quantization fp8``, gpt-oss's experts in MXFP4 for an ``mxfp4`` checkpoint,
    the linear layers of a GPTQ or AWQ checkpoint as the kernels ``compute_capability`` gets keep them."""
    heads = config.num_attention_heads
    if heads % tp:
        raise UserError(
            f"--tensor-parallel-size {tp} does not divide the {heads} attention heads; vLLM refuses it "
            "(ModelConfig.verify_with_parallel_config). Pick a degree that divides them."
        )
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = {getattr(config, name, None) for name in ("intermediate_size", "moe_intermediate_size")} - {None}
    wna16 = wna16_format(config) if quantization in WNA16 else None
    fused: dict[str, _FusedLinear] = {}
    total = 0
    experts: list[tuple[int, ...]] = []  # a GPTQ or AWQ checkpoint's quantized MoE layers: their gate_up shapes
    for name, parameter in model.named_parameters():
        if quantization == "mxfp4" and _EXPERTS.search(name):
            continue  # counted per layer below
        shape = tuple(parameter.shape)
        if wna16 and name.endswith(_EXPERT_WEIGHTS) and wna16.quantizes_experts(name.rpartition(".")[0]):
            if name.endswith(_EXPERT_WEIGHTS[0]):
                experts.append(shape)  # the layer, counted below; its down_proj with it
            continue
        if wna16 and name.endswith(".weight") and _quantized_linear(name) and wna16.quantizes(name[: -len(".weight")]):
            _fuse(fused, name, shape, tp, kv_heads)  # counted per fused layer below
            continue
        numel = _rank_numel(name, shape, tp, kv_heads, intermediate)
        quantized = quantization == "fp8" and _quantized_linear(name)
        total += numel + FP8_SCALE_BYTES if quantized else numel * parameter.element_size()
    if quantization == "mxfp4":
        total += config.num_hidden_layers * _mxfp4_experts_bytes(config, tp)
    kernels: dict[str, int] = {}
    for layer in fused.values():
        if len(layer.in_features) > 1:
            raise UserError(f"the layers vLLM fuses into {layer.name} have different input sizes: not modelled.")
        kernel = _wna16_kernel(wna16, layer, compute_capability)
        kernels[kernel] = kernels.get(kernel, 0) + 1
        total += _wna16_bytes(wna16, kernel, layer, _dtype(model).itemsize)
    for shape in experts:
        method, nbytes = _wna16_experts(wna16, config, shape, tp, _dtype(model).itemsize)
        kernels[method] = kernels.get(method, 0) + 1
        total += nbytes
    return RankWeights(total, _rotary_bytes(config, _dtype(model)), kernels)


@dataclass
class _FusedLinear:
    """One of vLLM's linear layers on one rank, its parts' shapes summed (QKVParallelLinear and
    MergedColumnParallelLinear fuse q/k/v and gate/up)."""

    name: str
    in_features: set[int]  # whole, before the row-parallel split
    in_rank: int = 0
    out_rank: int = 0
    row_parallel: bool = False


_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def _fuse(fused: dict[str, _FusedLinear], name: str, shape: tuple[int, ...], tp: int, kv_heads: int) -> None:
    """Add an ``nn.Linear`` weight (out x in) to the vLLM layer it is part of, with its share on one rank."""
    module = name[: -len(".weight")]
    parent, _, leaf = module.rpartition(".")
    key = f"{parent}.{_FUSED.get(leaf, leaf)}"
    in_features = shape[1]
    row_parallel = bool(_ROW.search(name)) and tp > 1
    in_rank = in_features // tp if row_parallel else in_features
    out_rank = _rank_numel(name, shape, tp, kv_heads, set()) // in_rank
    layer = fused.setdefault(key, _FusedLinear(key, set()))
    layer.in_features.add(in_features)
    layer.in_rank = in_rank
    layer.out_rank += out_rank
    layer.row_parallel = row_parallel


def _wna16_kernel(fmt: Wna16, layer: _FusedLinear, capability: tuple[int, int]) -> str:
    """The kernel vLLM 0.19 runs ``layer`` on (the module docstring cites the rules), by the name its log prints."""
    in_rank, out_rank, group = layer.in_rank, layer.out_rank, fmt.group_size
    if capability < MIN_CAPABILITY:
        raise UserError(
            f"{fmt.method.upper()} on sm{capability[0]}{capability[1]}: vLLM's Marlin kernels need sm"
            f"{''.join(map(str, MIN_CAPABILITY))} or newer; pick another --gpu."
        )
    whole_groups = group == -1 or in_rank % group == 0
    marlin = in_rank % MARLIN_MIN_THREAD[0] == 0 and out_rank % MARLIN_MIN_THREAD[1] == 0 and whole_groups
    if fmt.method == "awq" and not marlin:
        return "AWQLinearMethod"  # check_marlin_supports_layer failed: the unoptimized AWQ kernel, as loaded
    machete = (
        capability == HOPPER
        and group in MACHETE_GROUP_SIZES
        and in_rank % MACHETE_BLOCK[0] == 0
        and out_rank % MACHETE_BLOCK[1] == 0
        and not (fmt.desc_act and layer.row_parallel)
    )
    if machete:
        return "MacheteLinearKernel"
    if fmt.method == "gptq" and (8, 0) <= capability < HOPPER and group == -1 and fmt.bits == 8:
        raise UserError(
            f"{layer.name}: vLLM runs 8-bit per-channel GPTQ on Ampere with AllSparkLinearKernel, which is not "
            "modelled; pick another --gpu or a config.json without quantization_config."
        )
    if marlin:
        return "MarlinLinearKernel"
    raise UserError(
        f"{layer.name} ({in_rank} inputs x {out_rank} outputs per rank, group {group}): neither Machete nor Marlin "
        "fits it, and vLLM's other GPTQ kernels are not modelled. Lower --tensor-parallel-size."
    )


def _wna16_bytes(fmt: Wna16, kernel: str, layer: _FusedLinear, dtype_bytes: int) -> int:
    """What ``layer`` keeps on one rank after ``process_weights_after_loading`` on ``kernel``."""
    in_rank, out_rank = layer.in_rank, layer.out_rank
    (in_features,) = layer.in_features
    group = in_features if fmt.group_size == -1 else fmt.group_size
    repeated = fmt.desc_act or (fmt.group_size == -1 and layer.row_parallel)  # marlin_repeat_scales_on_all_ranks
    rows = (in_features if repeated else in_rank) // group
    packed_zeros = rows * out_rank // fmt.pack * WORD_BYTES
    total = in_rank * out_rank * fmt.bits // 8 + rows * out_rank * dtype_bytes  # the weight and the scales
    if fmt.method == "awq":
        return total + (rows * out_rank * dtype_bytes if kernel == "MacheteLinearKernel" else packed_zeros)
    if kernel == "MacheteLinearKernel":  # the loaded qzeros and g_idx stay; act-order adds the permutation
        return total + packed_zeros + in_rank * INDEX_BYTES * (2 if fmt.desc_act else 1)
    return total + (2 * in_rank * INDEX_BYTES if fmt.desc_act else 0)  # Marlin: sorted g_idx and its indices


def _wna16_experts(fmt: Wna16, config, gate_up: tuple[int, ...], tp: int, dtype_bytes: int) -> tuple[str, int]:
    """One MoE layer's GPTQ or AWQ experts on one of ``tp`` ranks (``gate_up``: transformers' fused gate/up
    parameter, experts first): the method vLLM 0.19 gives the ``FusedMoE`` and what it keeps (the module docstring
    cites both)."""
    experts, hidden = gate_up[0], config.hidden_size
    full = gate_up[1] * gate_up[2] // hidden // 2  # intermediate_size_full
    if full % tp:
        raise UserError(
            f"--tensor-parallel-size {tp} does not divide the experts' intermediate size {full}; vLLM asserts it "
            "(FusedMoE: intermediate_size % tp_size == 0). Pick a degree that divides it."
        )
    inter, group, pack = full // tp, fmt.group_size, fmt.pack
    marlin = (
        hidden % MOE_MARLIN_HIDDEN == 0
        and inter % max(MOE_MARLIN_INTERMEDIATE, group) == 0
        and config.model_type not in ROUTER_WEIGHT_ON_INPUT
    )
    weights = experts * 3 * hidden * inter * fmt.bits // 8  # w13 (2 x inter outputs) and w2, packed or repacked
    if marlin:
        rows13 = 1 if group == -1 else hidden // group  # scales_size13
        rows2 = 1 if group == -1 else (full if fmt.desc_act else inter) // group  # scales_size2 (load_full_w2)
        scales = experts * (rows13 * 2 * inter + rows2 * hidden) * dtype_bytes
        zero_words = experts * (rows13 * 2 * inter + rows2 * hidden) // pack
        if fmt.method == "awq":  # moe_awq_to_marlin_zero_points: int32, the loaded shape
            return MOE_METHODS["awq"], weights + scales + zero_words * WORD_BYTES
        sorted_g_idx = experts * (hidden + inter) * 2 * INDEX_BYTES if fmt.desc_act else 0  # and the sort indices
        return MOE_METHODS["gptq"], weights + scales + zero_words * dtype_bytes + sorted_g_idx  # qzeros: params_dtype
    if group == -1:
        raise UserError(
            f"a {fmt.method.upper()} MoE layer Marlin's MoE kernel does not take ({hidden} hidden, {inter} "
            "intermediate per rank) falls back to MoeWNA16Method, which cannot size per-channel scales (group_size -1) "
            "and fails to load. Lower --tensor-parallel-size."
        )
    wna16_group = group
    while inter % wna16_group or hidden % wna16_group:
        wna16_group //= 2  # MoeWNA16Method.create_weights: the loaded scales repeated to fit
    if wna16_group < MOE_WNA16_MIN_GROUP:
        raise UserError(
            f"a {fmt.method.upper()} MoE layer ({hidden} hidden, {inter} intermediate per rank) falls back to "
            f"MoeWNA16Method, which needs a group size of at least {MOE_WNA16_MIN_GROUP} dividing both and asserts; "
            "vLLM does not load it. Lower --tensor-parallel-size."
        )
    groups = experts * 3 * hidden * inter // wna16_group  # scale rows (2 x inter + hidden) x their groups
    zeros = groups * fmt.bits // 8 * BYTE_BYTES if fmt.method == "awq" else 0  # AWQ's zero points as uint8
    return MOE_WNA16, weights + groups * dtype_bytes + zeros


def _mxfp4_experts_bytes(config, tp: int) -> int:
    """One layer's MXFP4 experts on one rank, with the Triton backend's padding and the scales kept twice."""
    experts, hidden = config.num_local_experts, config.hidden_size
    inner = round_up(config.intermediate_size // tp, MXFP4_TRITON_ALIGNMENT)  # per rank
    values = round_up(hidden // 2, 64) * 2 * inner + round_up(inner // 2, 64) * hidden  # swizzled, padded
    group = MXFP4_VALUES_PER_SCALE
    loaded_scales = 2 * inner * hidden // group + hidden * inner // group
    swizzled_scales = round_up(2 * inner, 256) * hidden // group + round_up(hidden, 256) * inner // group
    biases = (2 * inner + hidden) * 4  # float32
    return experts * (values + loaded_scales + swizzled_scales + biases)


def _quantized_linear(name: str) -> bool:
    """A weight (not a bias) ``--quantization fp8`` quantizes: of a parallel linear layer, or the experts'."""
    if not name.endswith(("weight", "proj")):  # the experts' weights are ``...experts.gate_up_proj``
        return False
    return bool(_KEY_VALUE.search(name) or _COLUMN.search(name) or _ROW.search(name) or _EXPERTS.search(name))


def load_replay(model: nn.Module, config, tp: int, rotary_dtype: torch.dtype) -> CachingAllocator:
    """The caching allocator of one of ``tp`` ranks once a 16-bit ``model`` is built on the GPU as vLLM and SGLang
    build it (their model loaders allocate under ``with target_device``, then copy the checkpoint in from the host):
    its parameters in the order its modules make them, q/k/v and gate/up each fused into one (``QKVParallelLinear``,
    ``MergedColumnParallelLinear``); the first attention's rotary embedding right after its ``o_proj``, whose cos/sin
    cache is computed in float32 (``_compute_cos_sin_cache``: ``t``, ``freqs``, ``cos``, ``sin``, their ``cat``) and
    kept in ``rotary_dtype``."""
    allocations: dict[str, int] = {}  # in the order of each one's first part
    for name, nbytes in rank_parameters(model, config, tp):
        fused = next((pattern.sub(part, name) for pattern, part in FUSED_ON_LOAD if pattern.search(name)), name)
        allocations[fused] = allocations.get(fused, 0) + nbytes
    allocator = CachingAllocator()
    lengths, rotary_dim = rotary_caches(config)
    rotary_made = False
    for name, nbytes in allocations.items():
        allocator.malloc(nbytes)
        if not rotary_made and ROTARY_MADE_AFTER.search(name):
            rotary_made = True
            for positions in lengths:
                _rotary_cache(allocator, positions, rotary_dim, rotary_dtype)
    if not rotary_made:  # attention without an o_proj (GPT-NeoX's dense): where exactly is not modelled
        for positions in lengths:
            _rotary_cache(allocator, positions, rotary_dim, rotary_dtype)
    return allocator


def _rotary_cache(allocator: CachingAllocator, positions: int, rotary_dim: int, dtype: torch.dtype) -> None:
    """``RotaryEmbedding._compute_cos_sin_cache`` on the GPU: ``t = arange(positions)``, ``freqs = einsum(t,
    inv_freq)``, ``cos``, ``sin`` and their ``cat``, the cache kept (cast to ``dtype``); the rest freed as the
    function returns (``inv_freq`` and its temporaries are a few hundred bytes)."""
    fp32 = torch.float32.itemsize
    half = rotary_dim // 2
    temporaries = [allocator.malloc(half * fp32), allocator.malloc(positions * fp32)]  # inv_freq, t
    temporaries += [allocator.malloc(positions * half * fp32) for _ in range(3)]  # freqs, cos, sin
    cache = allocator.malloc(positions * rotary_dim * fp32)
    for block in temporaries:
        allocator.free(block)
    if dtype != torch.float32:
        allocator.malloc(positions * rotary_dim * dtype.itemsize)
        allocator.free(cache)


def rank_parameters(model: nn.Module, config, tp: int) -> Iterator[tuple[str, int]]:
    """Each parameter of a 16-bit ``model`` in the order its modules make them, with the bytes one of ``tp`` ranks
    holds of it."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = {getattr(config, name, None) for name in ("intermediate_size", "moe_intermediate_size")} - {None}
    for name, parameter in model.named_parameters():
        yield name, _rank_numel(name, tuple(parameter.shape), tp, kv_heads, intermediate) * parameter.element_size()


def _rank_numel(name: str, shape: tuple[int, ...], tp: int, kv_heads: int, intermediate: set[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    if tp == 1:
        return numel
    if _VOCAB.search(name):
        padded = round_up(shape[0], VOCAB_PADDING)
        return padded // tp * shape[1]
    if _KEY_VALUE.search(name):
        return numel // kv_heads * max(1, kv_heads // tp)
    if _COLUMN.search(name) or _SINKS.search(name):
        return numel // tp
    if _ROW.search(name):
        return numel // tp
    if _EXPERTS.search(name):
        return _expert_share(name, shape, tp, intermediate)
    if len(shape) > 1 and not _REPLICATED.search(name):
        raise UserError(
            f"--tensor-parallel-size {tp}: which of vLLM's parallel layers holds {name} {list(shape)} is not "
            "modelled, so its share per rank is unknown; use --tensor-parallel-size 1."
        )
    return numel


def _expert_share(name: str, shape: tuple[int, ...], tp: int, intermediate: set[int]) -> int:
    """transformers keeps each MoE layer's experts as 3-D tensors (experts x out x in, or x in x out); vLLM splits
    the intermediate dimension, which is the intermediate size or, fused with the gate, twice it."""
    numel = 1
    for size in shape:
        numel *= size
    for size in shape[1:]:
        if size in intermediate or size // 2 in intermediate:
            return numel // tp
    raise UserError(f"cannot tell which dimension of {name} {list(shape)} vLLM splits over the tensor-parallel ranks.")


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _rotary_bytes(config, dtype: torch.dtype) -> int:
    """vLLM's cos/sin caches (:func:`rotary_caches`)."""
    lengths, rotary_dim = rotary_caches(config)
    return sum(lengths) * rotary_dim * dtype.itemsize


def rotary_caches(config) -> tuple[list[int], int]:
    """The positions of each cos/sin cache vLLM and SGLang keep, one per distinct rope (``get_rope`` shares one
    among the layers that ask for the same): ``max_position_embeddings``, times the factor for linear scaling
    (``LinearScalingRotaryEmbedding``: ``max_position x scaling_factor``); and the rotary dim, each position's
    cos and sin. Gemma 3's sliding and full layers have one each."""
    head_dim = getattr(config, "qk_rope_head_dim", None) or getattr(config, "head_dim", None)
    head_dim = head_dim or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    positions = getattr(config, "max_position_embeddings", 0) or 0
    ropes = getattr(config, "rope_parameters", None) or {}
    per_layer_type = ropes and all(isinstance(rope, dict) for rope in ropes.values())
    distinct = {repr(sorted(rope.items())): rope for rope in (ropes.values() if per_layer_type else [ropes])}
    lengths = [
        int(positions * (rope.get("factor", 1) if rope.get("rope_type") == "linear" else 1))
        for rope in distinct.values()
    ]
    return lengths, rotary_dim
