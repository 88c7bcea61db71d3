"""Which storages of a CUDA step live on the host rather than the GPU.

With ``capturable=False`` (the default), torch optimizers keep their ``step`` counters as CPU tensors and
update them with CPU scalars (``torch.tensor(1.0, device="cpu")`` in ``_multi_tensor_adam``). In the trace
every tensor is a CPU tensor, so host placement is propagated from the counters: in the optimizer phase, a
storage created by an op whose other inputs all live on the host lives on the host too.
"""

from __future__ import annotations

from tracer.roles import Phase
from tracer.trace import Trace


def mark_host_storages(trace: Trace) -> None:
    storages = trace.storages
    for op in trace.ops:
        if op.phase is not Phase.OPTIMIZER:
            continue
        created = [s for s in op.outputs + op.inputs if storages[s].created_at == op.index]
        consumed = [s for s in op.inputs if storages[s].created_at != op.index]
        if created and all(not storages[s].on_device for s in consumed):
            for storage_id in created:
                storages[storage_id].on_device = False
