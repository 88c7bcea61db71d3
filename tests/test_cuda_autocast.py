"""CUDA autocast emulation against PyTorch's CUDA autocast op lists (aten/src/ATen/autocast_mode.h)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from tracer.cuda.autocast import CUDA_POLICY, LATER_THAN_2_11, CastPolicy, CudaAutocast, registered_ops

BF16 = torch.bfloat16


def _base(name: str) -> str:
    return name.removeprefix("aten::").partition(".")[0]


def test_policy_table_matches_the_ops_cuda_autocast_registers():
    registered = {_base(op) for op in registered_ops("AutocastCUDA")}
    assert registered <= set(CUDA_POLICY), f"unknown to the table: {registered - set(CUDA_POLICY)}"
    # cuDNN's RNN wrapper is registered by builds with cuDNN only; rms_norm joined the fp32 list after 2.11.
    everywhere = {name for name, policy in CUDA_POLICY.items() if policy is not CastPolicy.CUDNN_ONLY}
    known_here = {name for name in everywhere - LATER_THAN_2_11 if hasattr(torch.ops.aten, name)}
    assert known_here <= registered, f"not registered for AutocastCUDA: {known_here - registered}"


def test_cuda_and_cpu_policies_differ_where_documented():
    assert CUDA_POLICY["softmax"] is CastPolicy.FP32_SET_OPT_DTYPE
    assert CUDA_POLICY["pow"] is CastPolicy.FP32
    assert CUDA_POLICY["layer_norm"] is CastPolicy.FP32
    assert CUDA_POLICY["linear"] is CastPolicy.LOWER_PRECISION_FP
    assert "avg_pool3d" not in CUDA_POLICY  # CPU autocast runs it in fp32, CUDA autocast leaves it alone


def _outputs(fn):
    x = torch.randn(4, 8)
    with CudaAutocast() as emulation, emulation.region(BF16):
        return fn(x)


def test_lower_precision_and_fp32_policies():
    w = torch.randn(8, 8, requires_grad=True)
    assert _outputs(lambda x: F.linear(x, w)).dtype == BF16
    assert _outputs(lambda x: torch.softmax(x.to(BF16), -1)).dtype == torch.float32
    assert _outputs(lambda x: torch.softmax(x.to(BF16), -1, dtype=BF16)).dtype == BF16
    assert _outputs(lambda x: x.to(BF16).pow(2)).dtype == torch.float32
    assert _outputs(lambda x: torch.rsqrt(x.to(BF16))).dtype == torch.float32
    assert _outputs(lambda x: F.layer_norm(x.to(BF16), (8,))).dtype == torch.float32
    assert _outputs(lambda x: x.to(BF16).sum()).dtype == torch.float32
    assert _outputs(lambda x: torch.addcmul(x, x.to(BF16), x.to(BF16))).dtype == torch.float32
    assert _outputs(lambda x: torch.norm(x.to(BF16))).dtype == torch.float32


def test_cpu_only_policies_fall_through():
    with FakeTensorMode():  # the CPU kernel of avg_pool3d has no bf16 implementation; its meta kernel does
        volume = torch.randn(1, 1, 4, 4, 4, dtype=BF16)
        _compare_pooling(volume)


def _compare_pooling(volume):
    with torch.autocast("cpu", dtype=BF16):
        assert F.avg_pool3d(volume, 2).dtype == torch.float32  # CPU autocast's fp32 list
        assert torch.softmax(volume, -1).dtype == BF16
    with CudaAutocast() as emulation, emulation.region(BF16):
        assert F.avg_pool3d(volume, 2).dtype == BF16
        assert torch.softmax(volume, -1).dtype == torch.float32


def test_disabled_regions_inside_autocast_are_respected():
    w = torch.randn(8, 8, requires_grad=True)
    with CudaAutocast() as emulation, emulation.region(BF16), torch.autocast("cpu", enabled=False):
        assert F.linear(torch.randn(4, 8), w).dtype == torch.float32


class _CountCasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def test_weight_casts_are_cached_until_the_outermost_region_exits():
    layer = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, dtype=BF16)
    counter = _CountCasts()
    with CudaAutocast() as emulation, counter:
        with emulation.region(BF16):
            layer(x)
            layer(x)
            with torch.autocast("cpu", enabled=False):
                pass
            layer(x)
        assert counter.casts == 1  # one cast of the weight, reused
        with emulation.region(BF16):
            layer(x)
        assert counter.casts == 2  # the cache was cleared when the region exited


def test_kernels_are_restored_on_exit():
    with CudaAutocast() as emulation, emulation.region(BF16):
        pass
    with torch.autocast("cpu", dtype=BF16):
        assert torch.softmax(torch.randn(4, dtype=BF16), -1).dtype == BF16
