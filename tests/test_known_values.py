"""A trace answers host reads of values known from how the tensors were made: positions (``arange`` and what
follows from it) exactly, and a comparison of a fresh ``rand`` sample with a constant only where every sample agrees
(LayerDrop at 0.0 in transformers 5.17's OPT: ``if torch.rand([]) < self.layerdrop``). Against eager execution with
the RoPE variants that branch on positions: tests/test_accuracy_cpu.py."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from test_accuracy_cpu import ROPE
from tiny_models import tiny_model
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from transformers import AutoModelForCausalLM

from tracer.known_values import KnownValues


@pytest.mark.parametrize(
    ("compare", "expected"),
    [
        (lambda r: r < 0.0, False),
        (lambda r: r < -1.0, False),
        (lambda r: r >= 0, True),
        (lambda r: r < 1.0, True),
        (lambda r: r >= 1.0, False),
        (lambda r: r <= 1.0, True),
        (lambda r: r > 1.0, False),
        (lambda r: r > -0.5, True),
        (lambda r: r <= -0.5, False),
    ],
)
def test_comparisons_every_sample_answers_alike(compare, expected):
    with FakeTensorMode(), KnownValues():
        assert bool(compare(torch.rand([]))) is expected


@pytest.mark.parametrize(
    "compare",
    [
        lambda r: r < 0.5,  # LayerDrop above 0: the sample decides
        lambda r: r <= 0.0,  # rand may draw 0.0
        lambda r: r > 0.0,
        lambda r: r * 2 < 0.0,  # not the sample itself
        lambda r: r.to(torch.bfloat16) < 1.0,
    ],
)
def test_what_samples_decide_stays_data_dependent(compare):
    with FakeTensorMode(), KnownValues(), pytest.raises(DataDependentOutputException):
        bool(compare(torch.rand([])))


def test_a_low_precision_sample_may_round_up_to_one():
    with FakeTensorMode(), KnownValues():
        assert bool(torch.rand([], dtype=torch.bfloat16) < 0.0) is False
        with pytest.raises(DataDependentOutputException):
            bool(torch.rand([], dtype=torch.bfloat16) < 1.0)


def test_positions_are_known_from_their_construction():
    """transformers 5.17's longrope and every 5.x dynamic NTK RoPE: ``seq_len = torch.max(position_ids) + 1``."""
    with FakeTensorMode(), KnownValues():
        cache_position = torch.arange(5, 5 + 7)
        position_ids = cache_position.unsqueeze(0).expand(3, -1)
        seq_len = torch.max(position_ids) + 1
        assert seq_len.item() == 12
        assert bool(seq_len > 11) and not bool(seq_len > 12)
        assert bool(torch.maximum(seq_len, torch.tensor(20, dtype=seq_len.dtype)) == 20)
        grown = torch.cat([position_ids, torch.arange(2).view(1, -1) + position_ids[..., -1:]], dim=-1)
        assert grown.amax().item() == 12 and grown[0, 0].item() == 5


def test_values_from_data_stay_unknown():
    with FakeTensorMode(), KnownValues():
        data = torch.empty(4, dtype=torch.long)
        positions = torch.arange(4)
        for unknown in (data.max(), (positions + data).max(), torch.rand(4).sum()):
            with pytest.raises(DataDependentOutputException):
                unknown.item()


def test_an_in_place_write_forgets_what_it_overwrites():
    with FakeTensorMode(), KnownValues():
        positions = torch.arange(4)
        row = positions.view(1, 4)
        assert positions.max().item() == 3
        positions.add_(torch.empty(4, dtype=torch.long))
        for stale in (positions, row):
            with pytest.raises(DataDependentOutputException):
                stale.max().item()


def _rotary_state(config, seq_len: int, fake: bool) -> dict:
    """The rotary embedding's branch-dependent state after a forward over ``seq_len`` positions."""
    with FakeTensorMode() if fake else nullcontext(), KnownValues() if fake else nullcontext():
        model = AutoModelForCausalLM.from_config(config)
        model(torch.zeros((1, seq_len), dtype=torch.long))
        rotary = model.model.rotary_emb
        cached = rotary.max_seq_len_cached
        return {
            "inv_freq": rotary.inv_freq.shape,
            "long_inv_freq": getattr(rotary, "long_inv_freq", None) is not None,
            "max_seq_len_cached": int(cached.item() if isinstance(cached, torch.Tensor) else cached),
            "attention_scaling": float(rotary.attention_scaling),
        }


@pytest.mark.parametrize("seq_len", [24, 48])
@pytest.mark.parametrize("rope", list(ROPE))
def test_the_trace_takes_the_branch_eager_takes(rope, seq_len):
    """Longrope computes its long frequencies beyond original_max_position_embeddings (32), dynamic NTK regrows its
    own beyond max_position_embeddings (32): the trace's rotary embedding ends as eager's does."""
    family, overrides = ROPE[rope]
    config = tiny_model(family, **overrides).config
    assert _rotary_state(config, seq_len, fake=True) == _rotary_state(config, seq_len, fake=False)
