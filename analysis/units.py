"""Bytes for people. Internally everything stays an integer number of bytes."""

GIB = 1024**3
MIB = 1024**2


def format_bytes(nbytes: int) -> str:
    """Binary units, three significant decimals: "12.345 GiB", "512.000 MiB", "4.0 KiB"."""
    if abs(nbytes) >= GIB:
        return f"{nbytes / GIB:.3f} GiB"
    if abs(nbytes) >= MIB:
        return f"{nbytes / MIB:.3f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def format_count(count: int) -> str:
    """Counts of parameters: "6.74B", "4.19M", "12.3K", "512"."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{suffix}"
    return str(count)
