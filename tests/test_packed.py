"""GPTQ and AWQ checkpoints as transformers 5.24 loads them into gptqmodel's layers. gptqmodel (which needs torch
2.14 and CUDA kernels) cannot run here, so the expected layouts are worked by hand from the source lines that
tracer/packed.py cites: optimum's ``get_layers`` and transformers' ``replace_with_awq_linear`` for which layers,
``GPTQQuantLinear._register_gptq_buffers`` and ``AWQuantLinear.__init__`` for what each holds."""

from __future__ import annotations

import math

import pytest
import torch
from test_cli import _assert_user_error, _config_file, _run
from tiny_models import tiny_model
from torch import nn

from analysis.estimate import analyze
from tracer.errors import UserError
from tracer.packed import PackedLinear
from tracer.step import build_model
from tracer.training import LoraSetup, Target, TrainingSetup

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}
INFERENCE = TrainingSetup(target=Target.CPU, mode="inference", dtype="bf16", batch_size=2, seq_len=16)


def _linears(family: str, **overrides) -> dict[str, nn.Module]:
    with torch.device("meta"):
        model = build_model(tiny_model(family, **overrides).config, TrainingSetup())
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def _packed(family: str, quantization: dict, device: str = "meta") -> dict[str, PackedLinear]:
    with torch.device(device):
        model = build_model(tiny_model(family, quantization_config=quantization).config, INFERENCE)
    return {name: module for name, module in model.named_modules() if isinstance(module, PackedLinear)}


def test_gptq_replaces_plain_linears_in_the_blocks_and_awq_every_linear_but_the_skipped():
    """Llama 4's router is an nn.Linear subclass with a forward of its own: optimum's exact type check leaves it to
    GPTQ; AWQ's isinstance takes it, which breaks the model unless modules_to_not_convert names it. Both leave the
    lm_head, AWQ also what modules_to_not_convert names; the fused experts are not nn.Linear at all."""
    linears = _linears("llama4_text")
    in_blocks = {name for name, module in linears.items() if name.startswith("model.layers.")}
    plain = {name for name in in_blocks if type(linears[name]) is nn.Linear}
    assert {name.rpartition(".")[2] for name in in_blocks - plain} == {"router"}
    assert set(_packed("llama4_text", GPTQ)) == plain
    with pytest.raises(UserError, match=r"model\.layers\.1\.feed_forward\.router, a Llama4Router"):
        _packed("llama4_text", AWQ)
    skipped = {**AWQ, "modules_to_not_convert": ["model.layers.*.feed_forward.(router|shared_expert)"]}
    assert set(_packed("llama4_text", skipped)) == {name for name in plain if "shared_expert" not in name}


@pytest.mark.parametrize(
    ("quantization", "bias"),
    [(GPTQ, False), ({**GPTQ, "bits": 3, "group_size": -1}, True), (AWQ, True), ({**AWQ, "group_size": -1}, False)],
)
def test_each_layer_holds_gptqmodels_buffers(quantization, bias):
    family = "qwen2" if bias else "llama"  # Qwen2's q, k and v have biases
    linears = _linears(family)
    packed = _packed(family, quantization)
    bits, group = quantization["bits"], quantization["group_size"]
    for name, layer in packed.items():
        k, n = linears[name].in_features, linears[name].out_features
        groups = 1 if group == -1 else k // group
        if quantization["quant_method"] == "gptq":
            expected = {
                "qweight": ((math.ceil(k * bits / 32), n), torch.int32),
                "qzeros": ((groups, math.ceil(n * bits / 32)), torch.int32),
                "scales": ((groups, n), torch.float16),
                "g_idx": ((k,), torch.int32),
            }
        else:
            expected = {
                "qweight": ((k, math.ceil(n * bits / 32)), torch.int32),
                "qzeros": ((groups, math.ceil(n * bits / 32)), torch.int32),
                "scales": ((groups, n), torch.float16),
            }
        if linears[name].bias is not None:
            expected["bias"] = ((n,), torch.float16)
        assert {key: (tuple(t.shape), t.dtype) for key, t in layer.named_buffers()} == expected, name
        assert not list(layer.parameters())
    assert bias == any(layer.bias is not None for layer in packed.values())


def test_inference_counts_the_packed_layers_and_the_rest_in_dtype():
    """Parameters and buffers at the peak: the embeddings, norms and lm_head in bf16, each replaced layer's
    qweight, qzeros, scales and g_idx as worked out above, every storage in 512-byte blocks."""
    model = tiny_model("llama", quantization_config=GPTQ)
    linears = _linears("llama")
    with torch.device("meta"):
        dense = build_model(tiny_model("llama").config, TrainingSetup(dtype="bf16"))

    def blocks(nbytes: int) -> int:
        return -(-nbytes // 512) * 512

    replaced = {name for name in linears if name.startswith("model.layers.")}
    tensors = (*dense.named_parameters(), *dense.named_buffers())
    kept = sum(blocks(t.numel() * t.element_size()) for n, t in tensors if n.rpartition(".")[0] not in replaced)
    packed = 0
    for name in replaced:
        k, n, groups = linears[name].in_features, linears[name].out_features, linears[name].in_features // 32
        packed += blocks(k // 8 * n * 4) + blocks(groups * n // 8 * 4) + blocks(groups * n * 2) + blocks(k * 4)
    report = analyze(model, INFERENCE)
    assert report.breakdown["parameters"] + report.breakdown["buffers"] == kept + packed
    assert "GPTQ 4-bit" in report.assumptions["checkpoint_weights"]


def test_the_parameter_count_is_the_models():
    plain = analyze(tiny_model("llama"), INFERENCE)
    packed = analyze(tiny_model("llama", quantization_config=AWQ), INFERENCE)
    assert packed.parameter_count == plain.parameter_count


def _saved_shapes(quantization: dict, rows: int) -> list[tuple[int, ...]]:
    """What autograd keeps of one layer's forward in training, run eagerly on real CPU tensors."""
    layer = next(iter(_packed("llama", quantization, device="cpu").values()))  # the first layer's q_proj
    x = torch.randn(rows, layer.in_features, dtype=torch.float16, requires_grad=True)
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        layer.train()(x).sum().backward()
    assert x.grad.shape == x.shape
    return saved


def test_gptq_training_keeps_the_dequantized_weight_and_awq_does_not():
    """TorchLinear's torch.matmul saves the fp16 weight it dequantized for the input's gradient; AwqGemmFn saves
    only the packed tensors the layer holds (qweight standing for them)."""
    gptq = _saved_shapes(GPTQ, rows=4)
    hidden = tiny_model("llama").config.hidden_size
    assert (hidden, hidden) in gptq
    assert _saved_shapes(AWQ, rows=2048) == [(hidden, hidden // 8)]


def test_lora_on_a_packed_checkpoint_trains_only_the_adapters():
    model = tiny_model("llama", quantization_config=AWQ)
    setup = TrainingSetup(target=Target.CPU, dtype="bf16", batch_size=1, seq_len=8, lora=LoraSetup(r=4))
    report = analyze(model, setup)
    assert report.breakdown["gradients"] == 0  # freed at the step's end; the adapters' states are all that remain
    assert 0 < report.trainable_parameter_count < report.parameter_count
    assert "AWQ 4-bit" in report.assumptions["checkpoint_weights"]


@pytest.mark.parametrize(
    ("quantization", "flags", "fragment"),
    [
        (GPTQ, (), "fine-tune LoRA adapters on them (--lora-r)"),
        (AWQ, ("--qlora", "--dtype", "bf16"), "already quantized (awq)"),
        ({**AWQ, "version": "gemv"}, ("--mode", "inference"), "version 'gemv' is not modelled"),
        ({**GPTQ, "bits": 5}, ("--mode", "inference"), "GPTQ checkpoint of 5 bits"),
        (GPTQ, ("--mode", "inference", "--gpus", "2", "--tp", "2"), "not modelled with tensor parallelism"),
    ],
)
def test_refusals_name_the_fix(tmp_path, capsys, quantization, flags, fragment):
    path = _config_file(tmp_path, quantization_config=quantization)
    code, _, err = _run(capsys, "analyze", str(path), "--seq-len", "16", "--quiet", *flags)
    _assert_user_error(code, err, fragment)
