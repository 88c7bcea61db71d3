"""CUDA kernel choices reproduced in the CPU trace, against CUDA's documented selection rules."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from tracer.cuda.kernels import SdpaBackend, select_sdpa_backend
from tracer.cuda.workspaces import cublas_workspace_bytes, flash_backward_scratch
from tracer.gpus import find_gpu
from tracer.roles import Phase, Role
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup

BF16, FP32 = torch.bfloat16, torch.float32


def _qkv(dtype, heads=8, kv_heads=8, seq=128, kv_seq=None, head_dim=64, grad=True):
    make = lambda h, s: torch.randn(2, h, s, head_dim, dtype=dtype, requires_grad=grad)  # noqa: E731
    return make(heads, seq), make(kv_heads, kv_seq or seq), make(kv_heads, kv_seq or seq)


TORCH_2_10, TORCH_2_11, TORCH_2_13 = (2, 10), (2, 11), (2, 13)


@pytest.mark.parametrize(
    ("case", "gpu", "expected"),
    [
        # torch 2.10: flash, efficient, math (its wheels bundle a cuDNN that check_prefer_cudnn_attention refuses)
        (dict(dtype=BF16), "h100", SdpaBackend.FLASH),
        (dict(dtype=torch.float16), "a100-80gb", SdpaBackend.FLASH),
        (dict(dtype=torch.float16), "t4", SdpaBackend.EFFICIENT),  # flash needs sm80 or newer
        (dict(dtype=BF16), "v100-32gb", SdpaBackend.MATH),  # no bf16 kernels before sm80
        (dict(dtype=FP32), "h100", SdpaBackend.EFFICIENT),  # flash is half precision only
        (dict(dtype=BF16, kv_heads=2, gqa=True), "h100", SdpaBackend.FLASH),
        (dict(dtype=BF16, kv_heads=2, gqa=False), "h100", SdpaBackend.MATH),
        (dict(dtype=FP32, kv_heads=2, gqa=True), "h100", SdpaBackend.MATH),  # efficient has no GQA
        (dict(dtype=BF16, mask=True), "h100", SdpaBackend.EFFICIENT),  # flash takes no mask
        (dict(dtype=BF16, kv_seq=64, causal=True), "h100", SdpaBackend.EFFICIENT),  # causal must be square
        (dict(dtype=BF16, head_dim=320), "h100", SdpaBackend.EFFICIENT),  # flash: head dim <= 256
        (dict(dtype=BF16, head_dim=256, dropout=0.1), "l40s", SdpaBackend.EFFICIENT),  # sm89 training limit
        (dict(dtype=BF16, head_dim=256, dropout=0.1), "h100", SdpaBackend.FLASH),
        # torch 2.11 on and sm90/sm100: cuDNN first
        (dict(dtype=BF16, torch=TORCH_2_11), "h100", SdpaBackend.CUDNN),
        (dict(dtype=BF16, torch=TORCH_2_13), "h100", SdpaBackend.CUDNN),
        (dict(dtype=BF16, torch=TORCH_2_13), "b200", SdpaBackend.CUDNN),
        (dict(dtype=BF16, torch=TORCH_2_13), "a100-80gb", SdpaBackend.FLASH),  # cuDNN is preferred on sm90/sm100
        (dict(dtype=FP32, torch=TORCH_2_13), "h100", SdpaBackend.EFFICIENT),  # cuDNN is half precision only
        (dict(dtype=BF16, mask=True, torch=TORCH_2_13), "h100", SdpaBackend.CUDNN),  # cuDNN takes a mask
        (dict(dtype=BF16, kv_heads=2, gqa=True, torch=TORCH_2_13), "h100", SdpaBackend.CUDNN),
        (dict(dtype=BF16, kv_heads=2, gqa=False, torch=TORCH_2_13), "h100", SdpaBackend.MATH),
        (dict(dtype=BF16, head_dim=256, torch=TORCH_2_13), "h100", SdpaBackend.FLASH),  # cuDNN: head dim <= 128
        (dict(dtype=BF16, head_dim=20, torch=TORCH_2_13), "h100", SdpaBackend.FLASH),  # cuDNN: multiple of 8
        # GPT-2's attention dropout 0.1: cuDNN in 2.11, refused from 2.12 (dropout resolution 1/16)
        (dict(dtype=BF16, dropout=0.1, torch=TORCH_2_11), "h100", SdpaBackend.CUDNN),
        (dict(dtype=BF16, dropout=0.1, torch=TORCH_2_13), "h100", SdpaBackend.FLASH),
        (dict(dtype=BF16, dropout=0.125, torch=TORCH_2_13), "h100", SdpaBackend.CUDNN),
    ],
)
def test_backend_selection(case, gpu, expected):
    q, k, v = _qkv(
        case["dtype"], kv_heads=case.get("kv_heads", 8), kv_seq=case.get("kv_seq"), head_dim=case.get("head_dim", 64)
    )
    mask = torch.ones(128, case.get("kv_seq") or 128, dtype=torch.bool) if case.get("mask") else None
    chosen = select_sdpa_backend(
        q,
        k,
        v,
        mask,
        case.get("dropout", 0.0),
        case.get("causal", True),
        case.get("gqa", False),
        find_gpu(gpu),
        case.get("torch", TORCH_2_10),
    )
    assert chosen is expected


def test_cudnn_can_be_deprioritized(monkeypatch):
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    q, k, v = _qkv(BF16)
    assert select_sdpa_backend(q, k, v, None, 0.0, True, False, find_gpu("h100"), TORCH_2_13) is SdpaBackend.FLASH


def _setup(**options) -> TrainingSetup:
    return TrainingSetup(batch_size=2, seq_len=64, **options)


def _square_attention_storages(trace, setup: TrainingSetup, heads: int):
    square = (setup.batch_size, heads, setup.seq_len, setup.seq_len)
    return [s for s in trace.storages.values() if s.shape == square]


def test_flash_saves_a_logsumexp_not_the_attention_matrix():
    setup = _setup(mixed_precision="bf16", gpu="a100-80gb")
    trace = trace_step(tiny_model("llama"), setup)
    assert trace.assumptions["sdpa_backend"] == "flash"
    assert "aten._scaled_dot_product_flash_attention.default" in {op.target for op in trace.ops}
    assert not _square_attention_storages(trace, setup, heads=4)
    lse = [s for s in trace.storages.values() if s.shape == (2, 4, 64) and s.dtype == "float32"]
    assert lse and all(s.role is Role.ACTIVATION for s in lse)


def test_cudnn_saves_a_logsumexp_and_its_philox_state(monkeypatch):
    monkeypatch.setattr("tracer.cuda.kernels.installed_torch_version", lambda: TORCH_2_13)
    setup = _setup(mixed_precision="bf16")  # an H100
    trace = trace_step(tiny_model("llama"), setup)
    assert trace.assumptions["sdpa_backend"] == "cudnn"
    targets = [op.target for op in trace.ops]
    assert targets.count("aten._scaled_dot_product_cudnn_attention.default") == 2
    assert targets.count("aten._scaled_dot_product_cudnn_attention_backward.default") == 2
    assert not _square_attention_storages(trace, setup, heads=4)
    # out (B, H, L, D), logsumexp (B, H, L, 1) fp32, philox seed and offset: as a trace on an H200 recorded them
    cudnn = next(op for op in trace.ops if op.target == "aten._scaled_dot_product_cudnn_attention.default")
    created = [trace.storages[s] for s in cudnn.outputs if trace.storages[s].created_at == cudnn.index]
    assert [(s.nbytes, s.dtype, tuple(s.shape)) for s in created] == [
        (2 * 4 * 64 * 16 * 2, "bfloat16", (2, 4, 64, 16)),
        (2 * 4 * 64 * 4, "float32", (2, 4, 64, 1)),
        (8, "int64", ()),
        (8, "int64", ()),
    ]


def test_cpu_target_runs_the_cpu_kernel():
    trace = trace_step(tiny_model("llama"), _setup(mixed_precision="bf16", target=Target.CPU))
    targets = {op.target for op in trace.ops}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets
    assert "aten._scaled_dot_product_flash_attention.default" not in targets


def test_eager_attention_materialises_the_attention_matrix():
    setup = _setup(attn="eager", mixed_precision="bf16")
    assert _square_attention_storages(trace_step(tiny_model("llama"), setup), setup, heads=4)


@pytest.mark.parametrize("family", ["gpt2", "codegen", "gpt_neo"])
def test_cuda_autocast_runs_gelu_tanh_in_fp32(family):
    """GELU-tanh ("gelu_new") calls pow: CUDA autocast runs pow in fp32 and the saved GELU chain stays
    fp32; CPU autocast leaves it in bf16."""
    for target, dtype in ((Target.CUDA, "float32"), (Target.CPU, "bfloat16")):
        trace = trace_step(tiny_model(family), _setup(mixed_precision="bf16", target=target))
        pows = [
            trace.storages[op.outputs[0]]
            for op in trace.ops
            if op.target == "aten.pow.Tensor_Scalar" and op.phase is Phase.FORWARD
        ]
        assert pows and {s.dtype for s in pows} == {dtype}


def test_dropout_saves_a_bool_mask_on_cuda():
    model = tiny_model("gpt2", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    cuda = trace_step(model, _setup())
    masks = [cuda.storages[op.outputs[1]] for op in cuda.ops if op.target == "aten.native_dropout.default"]
    assert masks and {m.dtype for m in masks} == {"bool"}
    cpu = trace_step(model, _setup(target=Target.CPU))
    assert "aten.native_dropout.default" not in {op.target for op in cpu.ops}
    assert "aten.bernoulli_.float" in {op.target for op in cpu.ops}


def test_cublas_workspace_by_architecture(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace_bytes(find_gpu("h100")) == 32 * 1024**2
    assert cublas_workspace_bytes(find_gpu("b200")) == 32 * 1024**2
    assert cublas_workspace_bytes(find_gpu("a100-80gb")) == 8 * 1024**2 + 128 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cublas_workspace_bytes(find_gpu("a100-80gb")) == 32 * 1024**2


def test_workspaces_appear_in_the_cuda_trace(monkeypatch):
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")  # flash, whose backward scratch is known
    trace = trace_step(tiny_model("llama"), _setup(mixed_precision="bf16"))
    workspace = [s for s in trace.storages.values() if s.role is Role.WORKSPACE]
    assert [s.nbytes for s in workspace] == [32 * 1024**2] * 2  # the forward's thread and autograd's
    backward = next(op for op in trace.ops if op.target == "aten._scaled_dot_product_flash_attention_backward.default")
    made_before = {
        op.index for op in trace.ops[backward.index - 4 : backward.index] if op.target == "aten.new_empty.default"
    }
    scratch = [s for s in trace.storages.values() if s.created_at in made_before]
    assert all(s.freed_after == backward.index for s in scratch)
    q = torch.empty(2, 4, 64, 16, dtype=BF16, device="meta")
    kv = torch.empty(2, 2, 64, 16, dtype=BF16, device="meta")
    expected = sorted(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in flash_backward_scratch(q, kv))
    assert sorted(s.nbytes for s in scratch) == expected


def test_optimizer_runs_foreach_with_step_counters_on_the_host():
    cuda = trace_step(tiny_model("llama"), _setup())
    targets = {op.target for op in cuda.ops if op.phase is Phase.OPTIMIZER}
    assert "aten._foreach_sqrt.default" in targets
    counters = [s for s in cuda.storages.values() if s.name.endswith(".step")]
    assert counters and not any(s.on_device for s in counters)
    cpu = trace_step(tiny_model("llama"), _setup(target=Target.CPU))
    assert "aten._foreach_sqrt.default" not in {op.target for op in cpu.ops}
    assert all(s.on_device for s in cpu.storages.values())
