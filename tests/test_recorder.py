"""The recorder's lifetimes follow eager reference counting, on real and on fake tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tracer.modules import ModuleScope
from tracer.recorder import StepRecorder
from tracer.roles import Phase, Role


def _record(fn, model=None):
    recorder = StepRecorder(ModuleScope(model or nn.Module()), device_type="cpu")
    with recorder.recording():
        fn(recorder)
    return recorder.trace()


@pytest.mark.parametrize("fake", [False, True])
def test_a_storage_dies_when_its_last_reference_goes(fake):
    def body(recorder):
        x = torch.ones(256)
        y = x * 2  # op 1
        del x  # x dies after op 1, not after its last use
        z = y + 1  # op 2
        w = z.view(16, 16)  # a view shares z's storage
        del z
        w.sum()  # op 4

    with FakeTensorMode() if fake else torch.no_grad():
        trace = _record(body)
    targets = [op.target for op in trace.ops]
    assert targets == [
        "aten.ones.default",
        "aten.mul.Tensor",
        "aten.add.Tensor",
        "aten.view.default",
        "aten.sum.default",
    ]
    x, y, z, total = trace.storages[0], trace.storages[1], trace.storages[2], trace.storages[3]
    assert (x.created_at, x.freed_after) == (0, 1)
    assert (y.created_at, y.freed_after) == (1, 4)  # freed when the function returns
    assert (z.created_at, z.freed_after) == (2, 4)  # the view kept it alive
    assert total.nbytes == 4 and len(trace.storages) == 4


def test_activations_are_what_forward_leaves_alive_for_backward():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    recorder = StepRecorder(ModuleScope(model), device_type="cpu")
    for name, param in model.named_parameters():
        recorder.track_existing(param, Role.PARAMETER, name)
    x = torch.randn(4, 8)
    with recorder.recording():
        loss = model(x).sum()
        recorder.enter(Phase.BACKWARD)
        loss.backward()
        recorder.enter(Phase.OPTIMIZER)
    trace = recorder.trace()
    tanh_out = next(trace.storages[op.outputs[0]] for op in trace.ops if op.target == "aten.tanh.default")
    assert tanh_out.role is Role.ACTIVATION  # tanh saves its output
    roles = {trace.storages[s].role for op in trace.ops for s in op.outputs if op.target == "aten.sum.default"}
    assert roles == {Role.ACTIVATION}  # the loss is still referenced when backward starts
    grads = {s.param: s.nbytes for s in trace.storages.values() if s.role is Role.GRADIENT}
    assert grads == {"0.weight": 256, "0.bias": 32}


def test_ops_are_attributed_to_modules_in_forward_and_backward():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    recorder = StepRecorder(ModuleScope(model), device_type="cpu")
    with recorder.recording():
        loss = model(torch.randn(4, 8)).sum()
        recorder.enter(Phase.BACKWARD)
        loss.backward()
    trace = recorder.trace()
    modules = {(op.phase, op.target): op.module for op in trace.ops}
    assert modules[(Phase.FORWARD, "aten.addmm.default")] == "0"
    assert modules[(Phase.FORWARD, "aten.tanh.default")] == "1"
    assert modules[(Phase.BACKWARD, "aten.tanh_backward.default")] == "1"
    assert modules[(Phase.BACKWARD, "aten.mm.default")] == "0"
