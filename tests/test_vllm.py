"""``serve --engine vllm``: vLLM's sharding of the weights and its KV-cache arithmetic, worked by hand from the
rules analysis/vllm.py cites, and the command line's answers to bad input."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli import _assert_user_error, _config_file, _run
from tiny_models import tiny_model

from analysis.vllm import VllmSetup, vllm_startup
from tracer.errors import UserError
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
    difference = vllm_startup(plain, setup).weights.total - vllm_startup(config, setup).weights.total
    assert difference == config.num_hidden_layers * (bf16_experts - per_layer)
    with pytest.raises(UserError, match="already quantized"):
        vllm_startup(config, VllmSetup(gpu_memory_bytes=GIB, quantization="fp8"))


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
