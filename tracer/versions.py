"""The installed library versions whose behaviour the trace follows (attention backends, FSDP2's parameters)."""

from __future__ import annotations

import torch


def installed_torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor), without its local build tag."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)
