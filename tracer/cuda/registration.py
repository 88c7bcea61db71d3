"""Python kernels registered over ATen's for as long as an emulation is active.

``Library.impl`` refuses, by default in torch 2.11 (``allow_override=False``) and not in 2.13, a second Python
kernel for an op and dispatch key that a live ``Library`` already overrides. Both accept ``allow_override=True``,
which replaces the kernel as C++ registration does and restores the earlier one when the later library goes;
it is passed wherever ``impl`` takes it, so that the emulations behave alike on every torch the project supports.

Registration is all or nothing: a library whose registration fails part way is destroyed before the error
propagates, so that no kernel outlives a failed ``__enter__`` (a leaked CUDA kernel would go on replacing CPU's
in eager runs of the same process).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable

import torch

Kernel = tuple[str | torch._ops.OpOverload, Callable, str]

_OVERRIDE = (
    {"allow_override": True} if "allow_override" in inspect.signature(torch.library.Library.impl).parameters else {}
)


def register_kernels(kernels: Iterable[Kernel]) -> torch.library.Library:
    """A ``Library`` holding ``(op, kernel, dispatch_key)`` for each of ``kernels``; ``_destroy()`` it to undo."""
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" is the point
            for op, kernel, dispatch_key in kernels:
                library.impl(op, kernel, dispatch_key, **_OVERRIDE)
    except BaseException:
        library._destroy()
        raise
    return library
