"""``serve --engine vllm``: vLLM's sharding of the weights and its KV-cache arithmetic, worked by hand from the
rules analysis/vllm.py cites, and the command line's answers to bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from test_cli import _assert_user_error, _config_file, _run
from tiny_models import tiny_model
from transformers import CLIPConfig

from analysis.vllm import VllmSetup, vllm_startup
from analysis.vllm_weights import vision_bytes
from tracer.errors import UserError
from tracer.gpus import Gpu, find_gpu
from tracer.registry import find_bundled
from tracer.units import GIB


def _startup(family: str, **setup):
    config = tiny_model(family).config
    return config, vllm_startup(config, VllmSetup(gpu_memory_bytes=GIB, **setup))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_weights_per_rank_follow_vllms_layers(tp):
    """Column- and row-parallel projections divided, key/value heads divided or one per rank once the degree
    reaches them, the vocabulary padded to 64 then divided, norms whole, and one rotary cache."""
    config, startup = _startup("llama", tensor_parallel_size=tp)
    hidden, inter, heads, kv = config.hidden_size, config.intermediate_size, 4, 2
    head = hidden // heads
    vocab = -(-config.vocab_size // 64) * 64 // tp if tp > 1 else config.vocab_size
    per_layer = (
        hidden * head * heads // tp * 2  # q and o
        + 2 * hidden * head * max(1, kv // tp)  # k and v
        + 3 * hidden * inter // tp  # gate, up, down
        + 2 * hidden  # the two norms
    )
    tied = getattr(config, "tie_word_embeddings", False)
    parameters = config.num_hidden_layers * per_layer + hidden + vocab * hidden * (1 if tied else 2)
    assert startup.weights.parameter_bytes == parameters * 2  # vLLM serves an fp32 checkpoint in 16 bits
    assert startup.weights.rotary_bytes == config.max_position_embeddings * head * 2


def test_kv_cache_tokens_fill_the_rest_of_the_utilization():
    config, startup = _startup("llama", gpu_memory_utilization=0.5, block_size=16, max_num_batched_tokens=256)
    head = config.hidden_size // config.num_attention_heads
    page = 2 * 16 * config.num_key_value_heads * head * 2
    kv = GIB // 2 - startup.weights.total - startup.activation_peak_bytes
    assert startup.kv_cache_bytes == kv
    assert startup.num_blocks == kv // page // config.num_hidden_layers
    assert startup.kv_cache_tokens == startup.num_blocks * 16


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_quantization_stores_linear_layers_in_one_byte(tp):
    """--quantization fp8: q/k/v/o and gate/up/down one byte per weight and one float32 scale each; the
    embeddings, lm_head and norms in 16 bits."""
    config, bf16 = _startup("llama", tensor_parallel_size=tp)
    _, fp8 = _startup("llama", tensor_parallel_size=tp, quantization="fp8")
    hidden, inter, heads, kv = config.hidden_size, config.intermediate_size, 4, 2
    head = hidden // heads
    linear = hidden * head * heads // tp * 2 + 2 * hidden * head * max(1, kv // tp) + 3 * hidden * inter // tp
    scales = 7 * 4
    assert bf16.weights.parameter_bytes - fp8.weights.parameter_bytes == config.num_hidden_layers * (linear - scales)


def test_mxfp4_experts_of_gpt_oss():
    """gpt-oss's experts as vLLM's Triton MXFP4 backend holds them per rank: the intermediate size rounded up to 64,
    two values per byte, the loaded scales (one per 32) kept beside the swizzled ones padded to 256 rows, float32
    biases; the rest in 16 bits. A checkpoint already quantized refuses --quantization."""
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    config = tiny_model("gpt_oss", quantization_config=mxfp4).config
    plain = tiny_model("gpt_oss").config
    setup = VllmSetup(gpu_memory_bytes=GIB)
    experts, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
    padded = -(-inner // 64) * 64
    per_layer = experts * (
        -(-hidden // 2 // 64) * 64 * 2 * padded
        + -(-padded // 2 // 64) * 64 * hidden
        + (2 * padded * hidden + hidden * padded) // 32
        + (-(-2 * padded // 256) * 256 * hidden + -(-hidden // 256) * 256 * padded) // 32
        + (2 * padded + hidden) * 4
    )
    bf16_experts = experts * (2 * inner * hidden + hidden * inner + 2 * inner + hidden) * 2
    weights = [vllm_startup(each, setup).weights for each in (plain, config)]
    difference = weights[0].parameter_bytes - weights[1].parameter_bytes  # the plain one's blocks are replayed too
    assert difference == config.num_hidden_layers * (bf16_experts - per_layer)
    with pytest.raises(UserError, match="already quantized"):
        vllm_startup(config, VllmSetup(gpu_memory_bytes=GIB, quantization="fp8"))


# A Llama whose projections every kernel's tiles fit: hidden 256 (4 heads of 64, 2 key/value heads), intermediate 512
WNA16_SHAPE = dict(hidden_size=256, intermediate_size=512)
HOPPER, AMPERE, VOLTA = find_gpu("h100"), find_gpu("a100-80gb"), find_gpu("v100-32gb")


def _wna16(quantization: dict, gpu: Gpu, tp: int = 1, family: str = "llama", **shape):
    """The quantized checkpoint's weights and the same model's in fp16, on one rank."""
    shape = shape or WNA16_SHAPE
    setup = VllmSetup(gpu_memory_bytes=GIB, dtype=torch.float16, tensor_parallel_size=tp, gpu=gpu)
    quantized = tiny_model(family, quantization_config=quantization, **shape).config
    return vllm_startup(quantized, setup).weights, vllm_startup(tiny_model(family, **shape).config, setup).weights


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize(
    "quantization, capability, tp, per_layer, kernels",
    [
        # Machete keeps the packed weight (in x out / 2 bytes), the fp16 scales (in / 128 rows), the loaded qzeros
        # (rows x out / 8 int32) and g_idx (int32 per input): qkv 256x512, o 256x256, gate_up 256x1024, down 512x256
        (
            GPTQ,
            HOPPER,
            1,
            (65536 + 2048 + 512 + 1024) + (32768 + 1024 + 256 + 1024) + (131072 + 4096 + 1024 + 1024)
            + (65536 + 2048 + 512 + 2048),
            {"MacheteLinearKernel": 8},
        ),
        # Marlin on Ampere: the weight and the scales; zeros and g_idx become empty tensors
        (
            GPTQ,
            AMPERE,
            1,
            (65536 + 2048) + (32768 + 1024) + (131072 + 4096) + (65536 + 2048),
            {"MarlinLinearKernel": 8},
        ),
        # act-order at TP 2: qkv (256 in x 256 out per rank) and gate_up (256 x 512) on Machete with g_idx and perm;
        # o (128 x 256) and down (256 x 256) split their input, which Machete refuses with act-order: Marlin, the
        # scales' rows whole on every rank (256 / 128 and 512 / 128), g_idx sorted and its sort indices
        (
            GPTQ | {"desc_act": True},
            HOPPER,
            2,
            (32768 + 1024 + 256 + 2 * 1024) + (16384 + 2 * 256 * 2 + 2 * 128 * 4) + (65536 + 2048 + 512 + 2 * 1024)
            + (32768 + 4 * 256 * 2 + 2 * 256 * 4),
            {"MacheteLinearKernel": 4, "MarlinLinearKernel": 4},
        ),
        # AWQ on Machete: the zero points as -scale x zero in fp16, as large as the scales
        (
            AWQ,
            HOPPER,
            1,
            (65536 + 2 * 2048) + (32768 + 2 * 1024) + (131072 + 2 * 4096) + (65536 + 2 * 2048),
            {"MacheteLinearKernel": 8},
        ),
        # AWQ on Marlin: the zero points packed eight to an int32, as loaded
        (
            AWQ,
            AMPERE,
            1,
            (65536 + 2048 + 512) + (32768 + 1024 + 256) + (131072 + 4096 + 1024) + (65536 + 2048 + 512),
            {"MarlinLinearKernel": 8},
        ),
    ],
)  # fmt: skip
def test_gptq_and_awq_layers_as_vllm_keeps_them(quantization, capability, tp, per_layer, kernels):
    """GPTQ and AWQ linear layers per rank after vLLM 0.19's process_weights_after_loading, by hand from the rules
    analysis/vllm_weights.py cites; embeddings, lm_head and norms stay in fp16."""
    weights, fp16 = _wna16(quantization, capability, tp)
    linear = (256 * 512 + 256 * 256 + 256 * 1024 + 512 * 256) // tp * 2  # fp16 bytes of q/k/v/o/gate/up/down
    assert fp16.parameter_bytes - weights.parameter_bytes == 2 * (linear - per_layer)
    assert weights.kernels == kernels


def test_awq_layer_marlin_refuses_falls_back_to_the_awq_kernel():
    """AWQ with groups of 64 at TP 2 and intermediate 640: down has 320 inputs per rank, not a multiple of Marlin's
    128, so it runs on AWQLinearMethod with the checkpoint's tensors; the rest on Machete."""
    weights, fp16 = _wna16(AWQ | {"group_size": 64}, HOPPER, 2, hidden_size=256, intermediate_size=640)
    per_layer = (
        (32768 + 2 * 4 * 256 * 2)  # qkv 256 x 256: weight, scales and fp16 zeros of 4 groups
        + (16384 + 2 * 2 * 256 * 2)  # o 128 x 256
        + (81920 + 2 * 4 * 640 * 2)  # gate_up 256 x 640
        + (40960 + 5 * 256 * 2 + 5 * 256 // 2)  # down 320 x 256 as loaded: 5 groups of scales, packed qzeros
    )
    linear = (256 * 256 + 128 * 256 + 256 * 640 + 320 * 256) * 2
    assert fp16.parameter_bytes - weights.parameter_bytes == 2 * (linear - per_layer)
    assert weights.kernels == {"MacheteLinearKernel": 6, "AWQLinearMethod": 2}


@pytest.mark.parametrize(
    "quantization, setup, fragment",
    [
        (GPTQ | {"bits": 3}, {}, "GPTQ with bits=3"),
        (GPTQ | {"sym": False}, {}, "ExLlama gptq kernels"),
        (GPTQ | {"group_size": 256}, {}, "group_size 256"),
        (GPTQ | {"lm_head": True}, {}, "quantized lm_head"),
        (GPTQ | {"dynamic": {"-:.*mlp.*": {}}}, {}, "dynamic per-module overrides"),
        (AWQ | {"version": "gemv"}, {}, "GEMM-packed"),
        (AWQ | {"zero_point": False}, {}, "older awq kernels"),
        (AWQ, {"gpu": VOLTA}, "need sm75"),
        (GPTQ, {"gpu": AMPERE, "tensor_parallel_size": 4}, "neither Machete nor Marlin"),
        ({"quant_method": "bitsandbytes"}, {}, "published quantized (bitsandbytes)"),
        (GPTQ, {"quantization": "fp8"}, "already quantized"),
    ],
)
def test_quantized_checkpoints_not_modelled_are_refused(quantization, setup, fragment):
    config = tiny_model("llama", quantization_config=quantization, **WNA16_SHAPE).config
    with pytest.raises(UserError, match=re.escape(fragment)):
        vllm_startup(config, VllmSetup(gpu_memory_bytes=GIB, **setup))


MOE_SHAPE = dict(hidden_size=256, moe_intermediate_size=256, head_dim=64)  # four experts, two MoE layers
EXPERTS_ONLY = {"gptq": {"modules_in_block_to_quantize": ["mlp.experts"]}, "awq": {"modules_to_not_convert": ["attn"]}}


def _moe_experts(quantization: dict, tp: int = 1, **shape):
    """One MoE layer's experts on one rank: fp16 bytes less the checkpoint's (attention left unquantized: GPTQ's
    modules_in_block_to_quantize does not reach a FusedMoE, AWQ's modules_to_not_convert skips the attention)."""
    quantization = EXPERTS_ONLY[quantization["quant_method"]] | quantization
    weights, fp16 = _wna16(quantization, HOPPER, tp, family="qwen3_moe", **(MOE_SHAPE | shape))
    return (fp16.parameter_bytes - weights.parameter_bytes) // 2, weights.kernels


@pytest.mark.parametrize(
    "quantization, tp, kept, kernels",
    [
        # GPTQMarlinMoEMethod: w13 (256 in x 2 x 256 out) and w2 (256 x 256) of 4 experts repacked at 4 bits, fp16
        # scales of 2 groups (w13: 2 x 512, w2: 2 x 256), the loaded qzeros in fp16 (params_dtype), 8 to a word
        (GPTQ, 1, 4 * 3 * 256 * 256 // 2 + 4 * (2 * 512 + 2 * 256) * 2 + 4 * (2 * 512 + 2 * 256) // 8 * 2,
         {"GPTQMarlinMoEMethod": 2}),
        # act-order at TP 2 (128 intermediate per rank): w2's scales and zeros keep all 256 / 128 rows
        # (load_full_w2), g_idx sorted and its sort indices per expert (256 for w13, 128 for w2, int32)
        (GPTQ | {"desc_act": True}, 2, 4 * 3 * 256 * 128 // 2 + 4 * (2 * 256 + 2 * 256) * 2
         + 4 * (2 * 256 + 2 * 256) // 8 * 2 + 4 * (256 + 128) * 2 * 4, {"GPTQMarlinMoEMethod": 2}),
        # AWQMarlinMoEMethod: the zero points repacked into int32 words of the loaded shape
        (AWQ, 1, 4 * 3 * 256 * 256 // 2 + 4 * (2 * 512 + 2 * 256) * 2 + 4 * (2 * 512 + 2 * 256) // 8 * 4,
         {"AWQMarlinMoEMethod": 2}),
        # TP 4: 64 intermediate per rank is not a multiple of max(64, 128), so MoeWNA16Method: uint8-packed weights,
        # groups halved to 64 (scales repeated), fp16 scales of 3 x 256 x 64 / 64 per expert
        (GPTQ, 4, 4 * 3 * 256 * 64 // 2 + 4 * 3 * 256 * 2, {"MoeWNA16Method": 2}),
        # and AWQ's zero points as uint8, half a byte per group and output
        (AWQ, 4, 4 * 3 * 256 * 64 // 2 + 4 * 3 * 256 * 2 + 4 * 3 * 256 // 2, {"MoeWNA16Method": 2}),
    ],
)  # fmt: skip
def test_gptq_and_awq_experts_as_vllm_keeps_them(quantization, tp, kept, kernels):
    """A GPTQ or AWQ MoE layer per rank after vLLM 0.19's process_weights_after_loading, by hand from the rules
    analysis/vllm_weights.py cites (its intermediate size split over the ranks); the router stays in fp16."""
    saved, used = _moe_experts(quantization, tp)
    assert saved == 4 * 3 * 256 * 256 // tp * 2 - kept
    assert used == kernels


def test_awq_experts_named_in_modules_to_not_convert_stay_16_bit():
    saved, used = _moe_experts(AWQ | {"modules_to_not_convert": ["attn", "experts"]})
    assert saved == 0 and used == {}


def test_quantized_moe_layouts_vllm_does_not_load_are_refused():
    """MoeWNA16Method, the fallback, asserts a group of at least 32 dividing the intermediate size per rank (48 at
    TP 2) and cannot size per-channel scales; the experts' intermediate size must divide by the degree."""
    for quantization, tp, shape, fragment in (
        (GPTQ, 2, {"moe_intermediate_size": 96}, "group size of at least 32"),
        (GPTQ | {"group_size": -1}, 4, {"moe_intermediate_size": 96}, "per-channel scales"),
        (AWQ, 4, {"moe_intermediate_size": 258}, "does not divide the experts' intermediate size 258"),
    ):
        with pytest.raises(UserError, match=re.escape(fragment)):
            _moe_experts(quantization, tp, **shape)


def test_serve_sizes_a_gptq_moe_checkpoint(tmp_path, capsys):
    """The whole checkpoint: attention on Machete, the experts on Marlin's MoE method, the router in fp16."""
    path = _config_file(tmp_path, family="qwen3_moe", quantization_config=GPTQ, **MOE_SHAPE)
    code, out, _ = _run(capsys, "serve", str(path), "--gpu-memory", "1GiB", "--json")
    assert code == 0
    assert json.loads(out)["weight_kernels"] == {"MacheteLinearKernel": 4, "GPTQMarlinMoEMethod": 2}


def test_serve_sizes_a_gptq_checkpoint_on_the_gpus_kernels(tmp_path, capsys):
    path = _config_file(tmp_path, quantization_config=GPTQ, **WNA16_SHAPE)
    code, out, _ = _run(capsys, "serve", str(path), "--gpu", "a100-80gb", "--max-model-len", "64")
    assert code == 0 and "8 layers on MarlinLinearKernel" in out
    code, out, _ = _run(capsys, "serve", str(path), "--gpu-memory", "1GiB", "--json")
    assert code == 0 and json.loads(out)["weight_kernels"] == {"MacheteLinearKernel": 8}
    bad = _config_file(tmp_path, quantization_config=AWQ | {"bits": 8}, **WNA16_SHAPE)
    code, _, err = _run(capsys, "serve", str(bad), "--gpu-memory", "1GiB")
    _assert_user_error(code, err, "AWQ with bits=8", "config.json without quantization_config")


def test_fp8_kv_cache_halves_the_page_of_a_16_bit_model():
    _, bf16 = _startup("llama", dtype=torch.bfloat16)
    _, fp8 = _startup("llama", dtype=torch.bfloat16, kv_cache_dtype="fp8")
    assert fp8.layout.page_bytes * 2 == bf16.layout.page_bytes


def test_serve_prints_the_start_up_log(tmp_path, capsys):
    code, out, _ = _run(capsys, "serve", str(_config_file(tmp_path)), "--gpu-memory", "1GiB", "--max-model-len", "64")
    assert code == 0
    for line in (
        "model weights take",
        "PyTorch activation peak memory takes",
        "GPU KV cache size:",
        "Maximum concurrency",
    ):
        assert line in out
    code, out, _ = _run(capsys, "serve", str(_config_file(tmp_path)), "--gpu-memory", "1GiB", "--json")
    assert code == 0 and json.loads(out)["kv_cache_tokens"] > 0


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (("--tp", "3"), "does not divide the 4 attention heads"),
        (("--gpu-memory-utilization", "1.5"), "must be in (0, 1]"),
        (("--max-model-len", "100000"), "exceeds the model's max_position_embeddings"),
    ],
)
def test_serve_refuses_bad_input(tmp_path, capsys, flags, fragment):
    code, _, err = _run(capsys, "serve", str(_config_file(tmp_path)), "--gpu-memory", "1GiB", *flags)
    _assert_user_error(code, err, fragment)


def test_cuda_graphs_pool_is_the_largest_captures_working_set():
    """vLLM 0.19's default capture sizes (1, 2, 4, multiples of 8 then 16 up to min(2 x max_num_seqs, 512,
    max_num_batched_tokens)), a PIECEWISE graph per piece (layers + 1) and a FULL graph per size, and the shared pool:
    the decoder layer's peak at the largest size, plus FA3's 32 split-KV accumulators in float32 in the FULL graph on
    Hopper. The KV cache does not change with the graphs; the process holds the utilization plus the pool."""
    config, startup = _startup("llama", max_num_seqs=256, max_num_batched_tokens=8192)
    graphs = startup.graphs
    assert graphs.sizes == (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
    assert graphs.modes == {"PIECEWISE": config.num_hidden_layers + 1, "FULL": 1}
    hidden, heads, kv, inter = config.hidden_size, 4, 2, config.intermediate_size
    head = hidden // heads
    attention = (2 * 512 * hidden + 512 * (heads * head * 2 + 2 * kv * head)) * 2
    mlp = (2 * 512 * hidden + 512 * 3 * inter) * 2
    assert graphs.pool_parts["PIECEWISE"] == max(attention, mlp)
    assert graphs.pool_parts["FULL"] == max(attention, mlp) + 32 * heads * 512 * (head + 1) * 4
    assert graphs.pool_bytes == graphs.pool_parts["FULL"]
    assert startup.process_bytes == startup.requested_bytes + graphs.pool_bytes
    _, small = _startup("llama", max_num_seqs=2, max_num_batched_tokens=8192)
    assert small.graphs.sizes == (1, 2, 4)
    _, ampere = _startup("llama", gpu=AMPERE)
    assert ampere.graphs.pool_bytes == ampere.graphs.pool_parts["PIECEWISE"]  # no FA3 before Hopper


def test_serve_reports_the_graphs(tmp_path, capsys):
    code, out, _ = _run(capsys, "serve", str(_config_file(tmp_path)), "--gpu-memory", "1GiB", "--max-model-len", "64")
    assert code == 0 and "Graph capturing (after the KV cache is allocated) takes at least" in out
    assert "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0" in out
    code, out, _ = _run(capsys, "serve", str(_config_file(tmp_path)), "--gpu-memory", "1GiB", "--json")
    report = json.loads(out)
    assert report["process_bytes_at_least"] == report["requested_bytes"] + report["cuda_graph_pool_bytes"]


def test_serve_counts_a_multimodal_checkpoints_vision_tower(capsys):
    """vLLM loads the vision tower and projector beside the language model (logs: benchmarks/vllm_published.py)."""
    code, out, _ = _run(capsys, "serve", "google/gemma-3-4b-it", "--max-model-len", "8192")
    assert code == 0 and "vision tower and projector" in out
    code, out, _ = _run(capsys, "serve", "google/gemma-3-1b-it", "--max-model-len", "8192")  # text only
    assert code == 0 and "vision tower" not in out


def test_serve_says_when_it_cannot_count_the_vision_tower(capsys, tmp_path):
    """A checkpoint whose vision tower transformers cannot build is served with a line saying it is left out and why,
    not silently without it."""
    config = find_bundled("google/gemma-3-4b-it").load()
    config["vision_config"]["model_type"] = "no_such_vision"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, _ = _run(capsys, "serve", str(path), "--max-model-len", "8192")
    assert code == 0
    if "not counted" not in out and "vision tower and projector" in out:
        pytest.skip(f"transformers {transformers.__version__} builds an unknown vision model type as the default one")
    assert "the vision tower and projector are not counted (transformers cannot build this checkpoint's whole " in out
    assert "Unrecognized model type for subconfig: no_such_vision)" in out
    code, out, _ = _run(capsys, "serve", str(path), "--max-model-len", "8192", "--json")
    assert json.loads(out)["vision_tower_not_counted"].endswith("no_such_vision")
    assert vision_bytes(CLIPConfig(), 1, torch.bfloat16) is None  # no image-text-to-text model: the caller says so


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "qwen3_moe", "deepseek_v3"])
def test_loading_counts_whole_blocks_and_mla_the_flashinfer_workspace(family):
    """The weights are the allocator's blocks, never less than the tensors (GPT-NeoX's attention has no o_proj to
    place the rotary embedding after); MLA on a capability-9 GPU adds the 128 MiB FlashInfer-MLA workspace its
    backend's import makes, not on a capability-8 one."""
    config = tiny_model(family).config
    hopper = vllm_startup(config, VllmSetup(gpu_memory_bytes=GIB)).weights
    ampere = vllm_startup(config, VllmSetup(gpu_memory_bytes=GIB, gpu=find_gpu("a100-80gb"))).weights
    assert hopper.rounding_bytes >= 0 and hopper.rounding_bytes == ampere.rounding_bytes
    mla = getattr(config, "kv_lora_rank", None) is not None
    assert (hopper.workspace_bytes, ampere.workspace_bytes) == ((128 * 1024**2, 0) if mla else (0, 0))
