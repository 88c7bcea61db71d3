"""Context parallelism's ring attention as torch runs it, for one rank of C on CPU: the reference the traced ring
(tracer/context_parallel.py) is checked against.

``context_parallel`` itself does not run on a CPU (its dispatcher handles CUDA's flash, memory-efficient and cuDNN
kernels only), so the reference runs what its flash handler runs, torch's own ``_templated_ring_attention`` and
``_templated_ring_attention_backward`` (the all-gather key/value rotater, the all-to-all gradient rotater, float32
merging), over the CPU's flash kernel: a dispatch mode above the recorder intercepts that kernel and its backward
wherever autocast and autograd call them, as the dispatcher's handlers do, in a real step on the rank's seq/C
tokens, on a fake process group of C ranks. Real CPU tensors, every storage counted (tests/pipeline_runtime.py's
recorder, which reads through the collectives' async wrappers), the third step measured."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from pipeline_runtime import recorded_third_step
from runtimes import data_parallel, fake_process_group, reshard_argument, tensor_parallelize
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _templated_ring_attention,
    _templated_ring_attention_backward,
)
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode

from analysis.peak import find_peak, timeline
from strategies.layout import Layout
from strategies.tensor_parallel import megatron_plan
from tracer.context_parallel import local_length
from tracer.modules import decoder_blocks, model_structure
from tracer.resolve import Model
from tracer.training import TrainingSetup

SEQ_DIM = 2
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class RingDispatch(TorchDispatchMode):
    """What ``context_parallel``'s dispatcher does for CUDA's flash kernel, for the CPU's: the kernel and its
    backward, wherever autocast and autograd call them, run as torch's ring attention over ``group``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        group = self.group
        if func is FLASH:
            query, key, value, dropout_p, is_causal = args[:5]
            return tuple(
                _templated_ring_attention(
                    group, SEQ_DIM, func, query, key, value, is_causal, dropout_p=dropout_p, scale=kwargs.get("scale")
                )
            )
        if func is FLASH_BACKWARD:
            grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
            return tuple(
                _templated_ring_attention_backward(
                    group,
                    SEQ_DIM,
                    func,
                    grad_out=grad_out,
                    grad_out_name="grad_out",
                    query=query,
                    key=key,
                    value=value,
                    out=out,
                    logsumexp=logsumexp,
                    is_causal=is_causal,
                    dropout_p=dropout_p,
                    scale=kwargs.get("scale"),
                )
            )
        return func(*args, **kwargs)


def context_parallel_peak(model: Model, setup: TrainingSetup, layout: Layout) -> int:
    """Peak tensor bytes of the first rank of ``layout`` (context-parallel rank 0, the busiest) over its third step
    on its ``setup.seq_len / cp`` tokens: its modules split by DTensor tensor parallelism over ``layout.tp`` GPUs
    (the lm_head's logits left sharded and the loss computed under ``loss_parallel`` unless ``tp_output`` gathers
    them), its parameters replicated (DDP) or sharded (FSDP2, a bf16 MixedPrecisionPolicy for --mixed-precision)
    over the data-parallel x context-parallel ranks, as torchtitan's dp_shard_cp mesh shards them."""
    local = dataclasses.replace(setup, seq_len=local_length(setup.seq_len, layout.cp))
    sharded = layout.zero >= 2
    if sharded and local.mixed_precision is not None:  # FSDP2's MixedPrecisionPolicy over float32 weights
        local = dataclasses.replace(local, mixed_precision=None)
    with fake_process_group(layout.gpus, 0):
        mesh = init_device_mesh("cpu", (layout.dp, layout.cp, layout.tp), mesh_dim_names=("dp", "cp", "tp"))
        replicas = mesh["dp", "cp"]._flatten("dp_cp")
        torch.manual_seed(0)
        net = model.build(local)
        if layout.tp > 1:
            structure = model_structure(net)
            plan = megatron_plan(structure, layout.tp, 0, gathered_output=layout.tp_output == "gathered")
            tensor_parallelize(net, mesh["tp"], plan)
        buckets: dict[int, torch.Tensor] = {}
        wrapped = net
        if sharded:
            policy = (
                MixedPrecisionPolicy(torch.bfloat16, torch.float32) if setup.mixed_precision else MixedPrecisionPolicy()
            )
            reshard = reshard_argument(layout.zero == 3)
            for block in decoder_blocks(net):
                fully_shard(net.get_submodule(block), mesh=replicas, reshard_after_forward=reshard, mp_policy=policy)
            fully_shard(net, mesh=replicas, reshard_after_forward=reshard, mp_policy=policy)
        elif layout.replicas > 1:
            wrapped, buckets = data_parallel(net, replicas.get_group())
        parallel_loss = layout.tp > 1 and layout.tp_output == "parallel"
        ring_group = mesh["cp"].get_group()

        @contextmanager
        def around() -> Iterator[None]:
            with RingDispatch(ring_group), loss_parallel() if parallel_loss else nullcontext():
                yield

        step = recorded_third_step(model, local, net, wrapped, buckets, around)
        return find_peak(timeline(step, rounded=False)).bytes
