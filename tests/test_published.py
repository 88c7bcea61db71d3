"""Checkpoints published quantized (FP8 blocks, MXFP4), counted as transformers holds them for inference."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM
from transformers.quantizers import AutoHfQuantizer

from analysis.cli import EXIT_USER_ERROR, main
from analysis.estimate import analyze
from strategies.layout import Layout
from tracer.errors import UserError
from tracer.training import Target, TrainingSetup

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
GPT_OSS_SKIPS = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_SKIPS}


def _inference(**options) -> TrainingSetup:
    return TrainingSetup(target=Target.CPU, mode="inference", dtype="bf16", batch_size=2, seq_len=16, **options)


def _parameters_bytes(report) -> int:
    return report.breakdown["parameters"] + report.breakdown["buffers"]


def test_fp8_weights_are_transformers_quantized_model():
    """Every parameter and buffer, FP8 weights and their scales among them, as transformers' own quantizer lays
    out the model it loads an FP8 checkpoint into (a MoE model: its fused experts are FP8 too)."""
    model = tiny_model("deepseek_v3", quantization_config=FP8)
    quantizer = AutoHfQuantizer.from_config(model.config.quantization_config, pre_quantized=True)
    quantizer.quantization_config.dequantize = False
    with torch.device("meta"):
        loaded = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    quantizer.preprocess_model(loaded, dtype=torch.bfloat16)
    tensors = {t.untyped_storage()._cdata: t for t in (*loaded.parameters(), *loaded.buffers())}
    expected = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors.values())
    assert any(t.dtype == torch.float8_e4m3fn for t in tensors.values())
    report = analyze(model, _inference(max_new_tokens=2))
    assert _parameters_bytes(report) == expected
    assert "published in FP8" in report.assumptions["checkpoint_weights"]


def test_mxfp4_experts_as_the_checkpoint_stores_them():
    """gpt-oss's experts: per projection, blocks of 16 bytes (32 FP4 values) with one uint8 scale each, and float32
    biases; everything else (attention, router, embeddings, lm_head) in bf16."""
    model = tiny_model("gpt_oss", quantization_config=MXFP4)
    config = model.config
    experts, hidden, inner = config.num_local_experts, config.hidden_size, config.intermediate_size
    blocks = experts * 2 * inner * hidden // 32 + experts * hidden * inner // 32  # 32-value blocks
    per_layer = blocks * (16 + 1) + experts * (2 * inner + hidden) * 4
    dequantized = analyze(model, _inference(max_new_tokens=2, dequantize=True))
    published = analyze(model, _inference(max_new_tokens=2))
    expert_bf16 = (experts * 2 * inner * hidden + experts * hidden * inner + experts * (2 * inner + hidden)) * 2
    layers = config.num_hidden_layers
    expected_change = layers * (per_layer - expert_bf16)
    # each storage is counted in 512-byte blocks: up to 511 bytes apart per tensor
    assert abs(_parameters_bytes(published) - _parameters_bytes(dequantized) - expected_change) <= 512 * 8 * layers
    assert "dequantize" in dequantized.assumptions["checkpoint_weights"]


def test_fine_tuning_loads_published_weights_dequantized():
    model = tiny_model("gpt_oss", quantization_config=MXFP4)
    report = analyze(model, TrainingSetup(target=Target.CPU, batch_size=1, seq_len=8))
    assert "fine-tuning loads it dequantized" in report.assumptions["checkpoint_weights"]
    assert main(["analyze", "gpt2", "--quiet", "--dequantize"]) == EXIT_USER_ERROR


def test_published_weights_refuse_tensor_parallelism():
    model = tiny_model("deepseek_v3", quantization_config=FP8, num_attention_heads=8, num_key_value_heads=8)
    with pytest.raises(UserError, match="--dequantize"):
        analyze(model, _inference(), Layout(gpus=2, tp=2))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_id", "seq_len", "limit_bytes"),
    [("openai/gpt-oss-120b", 2048, 80 * 10**9), ("openai/gpt-oss-20b", 1024, 16 * 10**9)],
)
def test_gpt_oss_fits_as_its_model_card_states(model_id, seq_len, limit_bytes):
    """The model cards: gpt-oss-120b runs on one 80 GB GPU, gpt-oss-20b within 16 GB (MXFP4 weights)."""
    setup = TrainingSetup(mode="inference", dtype="bf16", batch_size=1, seq_len=seq_len, max_new_tokens=256)
    report = analyze(model_id, setup)
    assert report.device_total_bytes <= limit_bytes
