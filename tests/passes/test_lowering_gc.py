"""The comm lowering pauses Python's cyclic collector over its 10⁶ objects whoever calls it
(the command line's resolution lowered with it running: 2.7 s of a 10⁶-instruction compile),
and gives it back as it found it."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from pipecc.driver.compile import compile_order
from pipecc.ir.ops import Instr
from pipecc.passes import insert_comms as module


@pytest.fixture
def collector_state(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether the collector ran during each rank's emission, recorded by a wrapper."""
    seen: list[bool] = []
    emit = module.emit_rank

    def recording(*args: Any) -> tuple[Instr, ...]:
        seen.append(gc.isenabled())
        return emit(*args)

    monkeypatch.setattr(module, "emit_rank", recording)
    return seen


@pytest.mark.parametrize("enabled", [True, False])
def test_the_lowering_runs_with_the_collector_paused(
    collector_state: list[bool], enabled: bool
) -> None:
    order = compile_order("zbv", ranks=2, microbatches=4)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        module.insert_comms(order)
        assert gc.isenabled() is enabled, "given back as it was"
    finally:
        (gc.enable if was else gc.disable)()
    assert collector_state == [False, False], "paused on both ranks"
