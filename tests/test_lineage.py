"""Every storage of a parameter (its gradient, optimizer state, optimizer temporaries) knows its parameter,
and the decoder blocks are found: strategies shard and schedule memory by both."""

from __future__ import annotations

import pytest
from tiny_models import FAMILIES, tiny_model

from tracer.roles import Phase, Role
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("target", "optimizer"), [(Target.CUDA, "adamw"), (Target.CPU, "sgd")])
def test_parameter_lineage(family, target, optimizer):
    trace = trace_step(tiny_model(family), TrainingSetup(batch_size=2, seq_len=16, target=target, optimizer=optimizer))
    params = {s.param: s for s in trace.storages.values() if s.role is Role.PARAMETER}
    for storage in trace.storages.values():
        made_in_optimizer = storage.created_at is not None and trace.ops[storage.created_at].phase is Phase.OPTIMIZER
        if storage.role in (Role.GRADIENT, Role.OPTIMIZER_STATE) or (made_in_optimizer and storage.nbytes > 4):
            assert storage.param in params, (storage, trace.ops[storage.created_at] if made_in_optimizer else None)
        if storage.role is Role.GRADIENT or (made_in_optimizer and storage.nbytes > 4):
            assert storage.nbytes == params[storage.param].nbytes
    blocks = trace.structure.blocks
    assert len(blocks) == 2 and blocks[1].endswith(".1")
