"""PyTorch's pipeline-parallel runtime, ``torch.distributed.pipelining`` (``PipelineStage`` with ``ScheduleGPipe``
or ``Schedule1F1B``), run for one stage of P on CPU with a fake process group: the reference the per-stage
estimate is checked against. Real CPU tensors, every storage counted by the project's recorder from before the
step (parameters, optimizer states, the batch and the stage's receive buffers) to its last reference, the third
step measured; torch's MemTracker and a run under FakeTensorMode count the same bytes.

The model is split as torchtitan splits its Llama (``pipeline_llama_manual_split``): contiguous layers, the first
stages taking one more; stage 0 also holds the token embedding, the last the final norm and the lm_head. Each
stage runs transformers' decoder layers as ``LlamaModel.forward`` does, positions, mask and rotary embedding
included; the last stage's loss is the model's own, over the microbatch, divided by their number (the loop's
accumulation, as torchtitan rescales it with ``scale_grads=False``).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

import torch
from runtimes import fake_process_group
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import stage as stage_module
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import _PipelineSchedule
from transformers.masking_utils import create_causal_mask

from analysis.peak import find_peak, timeline
from strategies.pipeline import layer_split
from tracer.graph import build_graph
from tracer.inference import CACHE_KWARG
from tracer.modules import ModuleScope
from tracer.recorder import StepRecorder
from tracer.resolve import ResolvedModel
from tracer.roles import Phase, Role
from tracer.step import build_optimizer, make_token_batch
from tracer.training import TrainingSetup

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class _Stage(nn.Module):
    """One stage of a transformers causal LM, as torchtitan's pruned copy of its model runs."""

    def __init__(self, causal_lm: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        base = causal_lm.model
        self.config = causal_lm.config
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        self.rotary_emb = type(base.rotary_emb)(config=causal_lm.config)  # each stage has its own
        self.norm = base.norm if last else None
        self.lm_head = causal_lm.lm_head if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, position_ids=positions, **{CACHE_KWARG: None}
        )
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        if self.norm is not None:
            h = self.lm_head(self.norm(h))
        return h


@contextmanager
def _as_a_real_run() -> Iterator[None]:
    """Under the fake process group the schedule's warm-up vote receives zeros and would fall back to dynamic
    shape inference, which a run whose ranks all pass the same static metadata never does; and receives leave
    the buffers as ``empty`` made them, whose garbage would reach the weights (they are filled when made: the
    same allocation)."""

    def vote(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    make = stage_module._make_tensor_from_meta

    def make_filled(meta, device):
        tensor = make(meta, device)
        if tensor.is_floating_point():
            with torch.no_grad():
                tensor.uniform_(-1e-2, 1e-2)
        return tensor

    with (
        patch.object(_PipelineSchedule, "_warmup_p2p", vote),
        patch.object(stage_module, "_make_tensor_from_meta", make_filled),
    ):
        yield


def _receive_buffers(stage: PipelineStage) -> Iterator[torch.Tensor]:
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        yield from (info.buffer for info in infos if info.buffer is not None)


def pipeline_peak(model: ResolvedModel, setup: TrainingSetup, stages: int, stage: int, schedule: str, mbs: int) -> int:
    """Peak tensor bytes of stage ``stage`` of ``stages`` over its third step of ``mbs`` microbatches of
    ``setup.batch_size`` (``schedule.step``, then the optimizer's step and ``zero_grad``)."""
    config = model.config
    first, last = stage == 0, stage == stages - 1
    with fake_process_group(stages, stage), _as_a_real_run():
        torch.manual_seed(0)
        causal_lm = model.build(setup)
        causal_lm = causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm
        dtype = next(causal_lm.parameters()).dtype
        model_loss = causal_lm.loss_function  # transformers' ForCausalLMLoss: shifts the labels itself
        module = _Stage(causal_lm, layer_split(config.num_hidden_layers, stages)[stage], first, last)
        del causal_lm
        gc.collect()
        shape = (setup.batch_size, setup.seq_len)
        inputs = (
            torch.empty(shape, dtype=torch.long, device="meta")
            if first
            else torch.empty(*shape, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
        )
        width = config.vocab_size if last else config.hidden_size
        outputs = torch.empty(*shape, width, dtype=dtype, device="meta", requires_grad=True)
        pipeline = PipelineStage(module, stage, stages, torch.device("cpu"), input_args=inputs, output_args=outputs)
        optimizer = build_optimizer(module, setup, foreach=None)

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return model_loss(logits=logits, labels=labels, vocab_size=config.vocab_size) / mbs

        schedule_run = SCHEDULES[schedule](pipeline, n_microbatches=mbs, loss_fn=loss_fn, scale_grads=False)
        whole = dataclasses.replace(setup, batch_size=setup.batch_size * mbs)  # every rank loads the whole batch
        batch = make_token_batch(config.vocab_size, whole, "cpu")

        def step(on_phase=lambda phase: None) -> None:
            on_phase(Phase.FORWARD)
            args = (batch.input_ids,) if first else ()
            target = batch.labels if last else None
            schedule_run.step(*args, target=target, losses=[] if last else None, return_outputs=False)
            on_phase(Phase.OPTIMIZER)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        step()
        recorder = StepRecorder(ModuleScope(module), device_type="cpu")
        names = {id(param): name for name, param in module.named_parameters()}
        for name, param in module.named_parameters():
            recorder.track_existing(param, Role.PARAMETER, name)
        for name, buffer in module.named_buffers():
            recorder.track_existing(buffer, Role.BUFFER, name)
        for param, state in optimizer.state.items():
            for key, value in state.items():
                recorder.track_existing(value, Role.OPTIMIZER_STATE, f"{names[id(param)]}.{key}", names[id(param)])
        recorder.track_existing(batch.input_ids, Role.INPUT, "input_ids")
        recorder.track_existing(batch.labels, Role.INPUT, "labels")
        for index, buffer in enumerate(_receive_buffers(pipeline)):
            recorder.track_existing(buffer, Role.COMMUNICATION, f"receive buffer {index}")
        with recorder.recording():
            step(recorder.enter)
        return find_peak(timeline(build_graph(recorder.trace()), rounded=False)).bytes
