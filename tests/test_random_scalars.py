"""A trace answers a comparison of a fresh ``rand`` sample with a constant only where every sample agrees
(LayerDrop at 0.0 in transformers 5.17's OPT: ``if torch.rand([]) < self.layerdrop``)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from tracer.random_scalars import RandomScalarAnswers


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
    with FakeTensorMode(), RandomScalarAnswers():
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
    with FakeTensorMode(), RandomScalarAnswers(), pytest.raises(DataDependentOutputException):
        bool(compare(torch.rand([])))


def test_a_low_precision_sample_may_round_up_to_one():
    with FakeTensorMode(), RandomScalarAnswers():
        assert bool(torch.rand([], dtype=torch.bfloat16) < 0.0) is False
        with pytest.raises(DataDependentOutputException):
            bool(torch.rand([], dtype=torch.bfloat16) < 1.0)
