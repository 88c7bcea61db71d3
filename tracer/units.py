"""Bytes for people. Internally everything stays an integer number of bytes."""

import math

from tracer.errors import UserError

GIB = 1024**3
MIB = 1024**2


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``: the padding kernels and allocators apply."""
    return -(-value // multiple) * multiple


def next_power_of_2(value: int) -> int:
    """The smallest power of two at least ``value`` (1 for 0), as Triton's ``next_power_of_2``."""
    return 1 << max(value - 1, 0).bit_length()


def format_bytes(nbytes: int, decimals: int = 3) -> str:
    """Binary units, three decimals unless told: "12.345 GiB", "512.000 MiB", "4.0 KiB"."""
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.{decimals}f} GiB"
    if abs(nbytes) >= MIB:
        return f"{nbytes / MIB:.{decimals}f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def format_count(count: int) -> str:
    """Counts of parameters: "6.74B", "4.19M", "12.3K", "512"."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}"
    return str(count)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1024, "mib": MIB, "gib": GIB}
_UNITS["tib"] = 1024 * GIB
_LARGEST = 1024**5 * 1024  # 1 EiB: beyond any device, within float precision for whole bytes


def parse_bytes(text: str, flag: str) -> int:
    """``"80GiB"``, ``"24 GB"``, ``"81920MiB"`` -> bytes (GB decimal, GiB binary, as they are defined)."""
    number = text.strip().lower().rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = text.strip().lower()[len(number) :].strip()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not 0 < value < math.inf:
        raise UserError(f"{flag} takes a size such as 80GiB or 24GB (got {text!r}).")
    if value * _UNITS[unit] > _LARGEST:
        raise UserError(f"{flag} {text} is beyond {_LARGEST // 1024**5} PiB; give the memory of one GPU.")
    return int(value * _UNITS[unit])
