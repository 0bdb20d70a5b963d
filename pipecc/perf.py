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

    On exit the objects made during the pause join the oldest generation (`gc.freeze` then
    `gc.unfreeze`, two list splices): they are the pass's long-lived result, and left in the
    youngest generation the first allocation after the pause would walk every one of them
    (0.2 s for a program of 10⁶ instructions). Full collections still see them, as they see
    every old object; young objects made before the pause are promoted too, so a cycle
    among them is collected by the next full collection instead of a young one. A caller
    that froze objects itself (`gc.freeze`, as before a fork) keeps them frozen: then the
    promotion is skipped, since `gc.unfreeze` would thaw theirs too.
    """
    was_enabled = gc.isenabled()
    promote = gc.get_freeze_count() == 0
    gc.disable()
    try:
        yield
    finally:
        if promote:
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()
