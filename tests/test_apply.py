"""Layouts end to end: the ranks a report shows include the busiest one."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from analysis.peak import find_peak, timeline
from strategies.layout import Layout, Rank, prepare
from tracer.graph import build_graph
from tracer.tracing import trace_step
from tracer.training import Target, TrainingSetup


@pytest.mark.parametrize(
    "layout",
    [
        Layout(gpus=8, zero=3),
        Layout(gpus=8, zero=2),
        Layout(gpus=8, zero=1),
        Layout(gpus=4, tp=4),
        Layout(gpus=8, tp=2, zero=3),
        Layout(gpus=8, zero=3, engine="deepspeed"),
    ],
    ids=lambda layout: layout.describe(),
)
@pytest.mark.parametrize("vocab", [256, 250])
@pytest.mark.parametrize("target", list(Target))
def test_the_reported_ranks_include_the_busiest(layout, vocab, target):
    setup = TrainingSetup(target=target, batch_size=2, seq_len=32)
    model = tiny_model("llama", vocab_size=vocab, num_attention_heads=8, num_key_value_heads=8)
    prepared = prepare(layout, setup, model.config)
    step = build_graph(trace_step(model, prepared.traced))

    def peak(rank: Rank) -> int:
        return find_peak(timeline(prepared.rank_step(step, rank))).bytes

    every = [Rank(dp, tp) for dp in range(layout.dp) for tp in range(layout.tp)]
    assert max(peak(rank) for rank in prepared.ranks(step)) == max(peak(rank) for rank in every)
