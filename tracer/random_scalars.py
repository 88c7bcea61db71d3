"""The one data-dependent question a trace answers from the values' range alone: where a fresh uniform sample lies
relative to a constant outside or at the edge of its range.

LayerDrop (``if torch.rand([]) < self.layerdrop: continue``, in OPT and other models of transformers 5.17 without
a ``layerdrop > 0`` guard) reads a random scalar on the host. A trace without data cannot read it, but with
``layerdrop`` 0.0 the answer does not depend on the sample: ``torch.rand`` draws from [0, 1), so no sample is below
0.0 and the real run keeps every layer. Only comparisons that every sample answers alike are answered, and only
for a tensor ``aten.rand`` made itself (not a view of it, not arithmetic on it); any other ``.item()``, or a
constant inside the range, still fails as data-dependent.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
RAND = aten.rand.default
LOCAL_SCALAR_DENSE = aten._local_scalar_dense.default
# Where fp32 or fp64 samples of ``rand`` lie: 0 <= x < 1. Lower precisions can round a sample up to 1.0.
EXACT_DTYPES = (torch.float32, torch.float64)


def _answer(op: torch._ops.OpOverload, exclusive_top: bool, constant: float) -> bool | None:
    """``sample <op> constant`` for every sample in [0, 1) (``exclusive_top``) or [0, 1]; None where samples differ."""
    below_all = constant < 0.0  # sample > constant for every sample
    top_reached = constant >= 1.0 if exclusive_top else constant > 1.0  # sample < constant for every sample
    if op is aten.lt.Scalar:
        return False if constant <= 0.0 else True if top_reached else None
    if op is aten.ge.Scalar:
        return True if constant <= 0.0 else False if top_reached else None
    if op is aten.le.Scalar:
        return False if below_all else True if constant >= 1.0 else None
    if op is aten.gt.Scalar:
        return True if below_all else False if constant >= 1.0 else None
    return None


COMPARISONS = (aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar)


class RandomScalarAnswers(TorchDispatchMode):
    """Answers ``.item()`` of a comparison of a fresh ``rand`` sample with a constant, where every sample agrees."""

    def __init__(self) -> None:
        super().__init__()
        self._samples: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # rand output -> exclusive top
        self._answers: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # comparison output -> bool

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is LOCAL_SCALAR_DENSE and args[0] in self._answers:
            return self._answers[args[0]]
        out = func(*args, **kwargs)
        if func is RAND:
            self._samples[out] = out.dtype in EXACT_DTYPES
        elif func in COMPARISONS and args[0] in self._samples and isinstance(args[1], int | float):
            answer = _answer(func, self._samples[args[0]], float(args[1]))
            if answer is not None:
                self._answers[out] = answer
        return out
