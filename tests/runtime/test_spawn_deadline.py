"""A process group with a rank that hangs outside any collective is stopped at its deadline
and the hung rank is named (runtime/tools/spawn.py), so a hang fails a test, not CI."""

from __future__ import annotations

import time

import pytest
from pipecc.runtime.tools.spawn import DEADLINE_ENV, spawn
from spawn_cases import spin_on_rank_one

from pipecc.diagnostics import RankError


def test_a_rank_past_the_deadline_is_stopped_and_named() -> None:
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        spawn(spin_on_rank_one, 2, None, deadline=3.0)
    message = str(caught.value)
    assert "rank 1: still running after the run's deadline of 3 s" in message, message
    assert "rank 0" not in message.splitlines()[0], "rank 0 finished: not the one named"
    assert time.monotonic() - start < 60, "stopped at the deadline, not at gloo's timeout"


def test_the_suite_bounds_every_group() -> None:
    import os

    assert float(os.environ[DEADLINE_ENV]) > 0, "tests/conftest.py sets a deadline"
