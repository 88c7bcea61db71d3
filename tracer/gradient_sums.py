"""The autograd engine's gradient sums as a plain run makes them: in place where nothing else holds the first.

A tensor used twice gets two gradients, which the engine adds in the input buffer of the node that consumes them
(``InputBuffer::accumulate`` in torch/csrc/autograd/input_buffer.cpp): ``old_var.add_(var)`` when it holds the last
reference to the buffered gradient and to its storage, the gradient is dense, and neither operand is
"tensor-subclass-like"; ``old_var + var`` otherwise. ``at::isTensorSubclassLike`` is true for every tensor while a
``TorchDispatchMode`` is active and for FakeTensors, so the recorded step adds out of place where the user's run
adds in place: one gradient-sized block more at each such sum (tests/test_gradient_sums.py). A tied embedding's
two vocabulary-sized gradients are the largest.

The recorder marks the sums whose buffered gradient a plain run could reuse (``Op.sums_gradients``); the trace
tells whether the buffer held the last reference: the gradient's storage dies at the sum. Then the sum takes that
storage over: the gradient is freed just before the sum allocates, which is what the live bytes of an in-place add
are, and the allocator replay gives the sum that very block (analysis/replay.py). "Just before" is after the op
before the sum, so a sum that begins its module's backward, where a runtime's hook could run in between (FSDP's
pre-backward all-gather), stays out of place; in no model traced so far does one (a node's sums follow its own ops).

DTensors are tensor subclasses, so a tensor-parallel run sums out of place where a gradient is one (a tied
embedding's weight gradients; under sequence parallelism, a gathered input's); its other gradients are plain local
tensors, summed in place (strategies/tensor_parallel.py: ``dtensor_sums_out_of_place``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tracer.graph import StorageRow
from tracer.trace import Op, Storage, Trace
from tracer.training import TrainingSetup


def hands_over(op: Op, storages: Mapping[int, Storage] | Mapping[int, StorageRow]) -> bool:
    """Whether ``op`` is a sum made in place: its buffered gradient handed over to it (:func:`in_place`)."""
    return op.sums_gradients and storages[op.inputs[0]].freed_after == op.index - 1


def in_place(trace: Trace) -> Trace:
    """The trace with each gradient sum that a plain run makes in place taking over its buffered gradient."""
    handed_over = {}
    for op in trace.ops:
        if not op.sums_gradients:
            continue
        buffered = trace.storages[op.inputs[0]]
        if buffered.freed_after == op.index and trace.ops[op.index - 1].module == op.module:
            handed_over[buffered.id] = dataclasses.replace(buffered, freed_after=op.index - 1)
    if not handed_over:
        return trace
    return dataclasses.replace(trace, storages=trace.storages | handed_over)


def as_run(trace: Trace, setup: TrainingSetup) -> Trace:
    """The trace's gradient sums as the setup's run makes them: in place where they can be, unless it runs under a
    dispatch mode, as the trace was recorded."""
    return trace if setup.dispatch_mode else in_place(trace)
