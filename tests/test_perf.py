"""pipecc.perf.paused_gc: the collector paused inside, restored after, the caller's GC state
left as it was."""

from __future__ import annotations

import gc

from pipecc.perf import paused_gc


def test_collector_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled(), "a collector the caller disabled stays disabled"
    finally:
        gc.enable()


def test_new_objects_skip_the_young_generations() -> None:
    with paused_gc():
        made = [[index] for index in range(1000)]
    young = {id(o) for o in gc.get_objects(generation=0)} | {
        id(o) for o in gc.get_objects(generation=1)
    }
    assert not any(id(o) in young for o in made)


def test_objects_the_caller_froze_stay_frozen() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with paused_gc():
            made = [[index] for index in range(1000)]
        assert gc.get_freeze_count() == frozen
        assert made
    finally:
        gc.unfreeze()
