"""Host reads (``.item()``, ``if tensor:``) that a trace without data can still answer: the values are known from
how the tensor was made, not from any data.

A trace runs on fake tensors, which have shapes but no values, so a Python branch on a tensor fails as
data-dependent. Two kinds of tensor have answers all the same, and the real run's branch depends on them:

- Positions. Models and ``generate()`` number tokens with ``torch.arange`` (``cache_position``) and views of it
  (``position_ids = cache_position.unsqueeze(0)``), and RoPE variants branch on them: transformers 5.17's longrope
  (Phi-3, Phi-4-mini) picks its long or short factors with ``seq_len = torch.max(position_ids) + 1; if seq_len >
  original_max_position_embeddings``, and dynamic NTK (``rope_type="dynamic"``, every 5.x) recomputes its
  frequencies when ``seq_len`` grows past the cached length. The values of such a tensor follow from its
  construction, so this mode keeps them: alongside each fake tensor made by a factory with Python-number arguments
  (``arange``, ``full``...) or a constant (``torch.tensor(4096)``), and each result of a view or of the small
  arithmetic, reductions and comparisons in ``VALUE_OPS`` over such tensors and Python scalars, it computes the
  same op on real CPU tensors and answers the host read with the real result. The branch taken, and so the
  buffers registered (longrope's long frequencies, dynamic NTK's regrown ones), is the real run's for that
  sequence length.
- A fresh ``torch.rand`` sample against a constant at or beyond the edge of its range. LayerDrop (``if
  torch.rand([]) < self.layerdrop: continue``, in OPT and other models of transformers 5.17 without a ``layerdrop >
  0`` guard) reads a random scalar; with ``layerdrop`` 0.0 every sample of [0, 1) answers alike and the real run
  keeps every layer. Only the sample ``aten.rand`` made itself is answered (not a view of it, not arithmetic on
  it), and only where every sample agrees.

Everything else (a value computed from data or weights, a rand sample inside the range, a known tensor after an
in-place write this mode does not follow, a result of more than ``MAX_ELEMENTS`` elements) stays unknown, and
reading it still fails as data-dependent, naming the op.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
RAND = aten.rand.default
LOCAL_SCALAR_DENSE = aten._local_scalar_dense.default
# Where fp32 or fp64 samples of ``rand`` lie: 0 <= x < 1. Lower precisions can round a sample up to 1.0.
EXACT_DTYPES = (torch.float32, torch.float64)
SAMPLE_COMPARISONS = (aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar)

# Factories whose values follow from their Python-number arguments.
FACTORIES = {aten.arange, aten.full, aten.ones, aten.zeros, aten.scalar_tensor}
# torch.tensor(constant): the constant, a real tensor, lifted into the fake mode.
CONSTANTS = {aten.lift_fresh, aten.lift_fresh_copy}
# Ops computed on real values when every tensor argument is known (their out= and in-place overloads are not:
# an in-place write forgets what it overwrites). Views of a known tensor are known whatever the view op.
VALUE_OPS = {
    aten.clone,
    aten._to_copy,
    aten.max,
    aten.min,
    aten.amax,
    aten.amin,
    aten.sum,
    aten.cumsum,
    aten.cat,
    aten.add,
    aten.sub,
    aten.rsub,
    aten.mul,
    aten.div,
    aten.neg,
    aten.remainder,
    aten.floor_divide,
    aten.maximum,
    aten.minimum,
    aten.clamp,
    aten.eq,
    aten.ne,
    aten.lt,
    aten.le,
    aten.gt,
    aten.ge,
    aten.logical_not,
    aten.logical_and,
    aten.logical_or,
    aten.masked_fill,
    aten.where,
}
# Known tensors are small (positions, a few scalars); a larger result is left unknown rather than computed twice.
MAX_ELEMENTS = 1 << 22
CPU = torch.device("cpu")


def _sample_answer(op: torch._ops.OpOverload, exclusive_top: bool, constant: float) -> bool | None:
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


def _written(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes to (in-place and out= arguments)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name, args[i] if i < len(args) and not argument.kwarg_only else None)
        written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return written


class KnownValues(TorchDispatchMode):
    """Answers host reads of tensors whose values are known from their construction (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._values: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # fake tensor -> real CPU tensor
        self._storages: set[StorageWeakRef] = set()  # storages of the fake tensors in _values
        self._samples: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # rand output -> exclusive top

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is LOCAL_SCALAR_DENSE and args[0] in self._values:
            with _disable_current_modes():
                return self._values[args[0]].item()
        out = func(*args, **kwargs)
        if func._schema.is_mutable:
            self._forget(_written(func, args, kwargs))
        elif func is RAND:
            self._samples[out] = out.dtype in EXACT_DTYPES
        elif func in SAMPLE_COMPARISONS and args[0] in self._samples and isinstance(args[1], int | float):
            answer = _sample_answer(func, self._samples[args[0]], float(args[1]))
            if answer is not None:
                with _disable_current_modes():
                    self._keep(out, torch.tensor(answer))
        elif self._may_know(func, (*args, *kwargs.values())):
            self._follow(func, args, kwargs, out)
        return out

    def _may_know(self, func: torch._ops.OpOverload, arguments: tuple) -> bool:
        """Whether ``func``'s output may be known: a factory's or a constant's, or a view's or value op's that reads
        a known tensor (directly or in a list). The cheap test that spares most ops of a step the walk over their
        arguments."""
        if func.overloadpacket in FACTORIES or func.overloadpacket in CONSTANTS:
            return True
        if not (func.is_view or func.overloadpacket in VALUE_OPS):
            return False
        for arg in arguments:
            if isinstance(arg, torch.Tensor):
                if arg in self._values:
                    return True
            elif isinstance(arg, list | tuple) and any(isinstance(a, torch.Tensor) and a in self._values for a in arg):
                return True
        return False

    def _follow(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> None:
        """Compute ``func`` on the real values of its arguments, where every tensor among them is known."""
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not func.is_view and any(t.numel() > MAX_ELEMENTS for t in outputs):
            return
        unknown = False

        def real(value):
            nonlocal unknown
            if isinstance(value, torch.Tensor):
                if func.overloadpacket in CONSTANTS and not _is_fake(value):
                    return value  # torch.tensor(constant): the constant itself
                if value not in self._values:
                    unknown = True
                return self._values.get(value)
            if isinstance(value, torch.device):
                return CPU
            return value

        real_args, real_kwargs = tree_map(real, args), tree_map(real, kwargs)
        if unknown:
            return
        with _disable_current_modes():
            values = [t for t in tree_flatten(func(*real_args, **real_kwargs))[0] if isinstance(t, torch.Tensor)]
            if func.overloadpacket in CONSTANTS:
                values = [t.clone() for t in values]
        for fake, value in zip(outputs, values, strict=True):
            self._keep(fake, value)

    def _keep(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        self._values[fake] = value
        self._storages.add(StorageWeakRef(fake.untyped_storage()))
        if len(self._storages) > 2 * len(self._values) + 64:  # drop the storages no known tensor holds any more
            self._storages = {storage for storage in self._storages if not storage.expired()}

    def _forget(self, written: list[torch.Tensor]) -> None:
        """An in-place write to a known tensor's storage makes every tensor over that storage unknown."""
        for tensor in written:
            storage = StorageWeakRef(tensor.untyped_storage())
            if storage in self._storages:
                self._storages.discard(storage)
                for fake in [t for t in self._values if StorageWeakRef(t.untyped_storage()) == storage]:
                    del self._values[fake]
            self._samples.pop(tensor, None)


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)
