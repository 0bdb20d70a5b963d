"""Performance helpers shared by the passes, the verifier and the simulator."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for an allocation-heavy pass.

    A large program allocates 10⁶ small tuples; each allocation burst triggers collections
    that walk every live object, which costs 2–3× the pass itself. The IR is acyclic (tuples
    of tuples), so reference counting frees everything and nothing leaks while the collector
    is paused. Re-enabled on exit only if it was enabled on entry.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
