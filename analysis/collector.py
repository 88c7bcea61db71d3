"""The cycle collector paused while a command estimates (not while ``measure`` runs a real step).

A run makes objects by the million and drops most of them soon: the traced ops and storages, each layout's rank
steps (tens of thousands of rows and ops, rebuilt by every transform), the traces unpickled from the planner's
worker processes. Reference counting frees them, as hardly any is in a cycle; the collector would only scan them again
and again, however rarely it ran. In runs alternated with the code that collected every 100,000 allocations
(2026-11-28, 2 cores), the 8B / 8-GPU plan in one process took 38.3 and 43.7 s instead of 54.0 and 57.8 s, for the
same output and at most 5% more peak memory (a collection after that plan finds 882 objects in cycles); the other
commands measured are in docs/usage.md.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
