"""A process group with a rank that hangs outside any collective is stopped at its deadline
and the hung rank is named (runtime/tools/spawn.py), so a hang fails a test, not CI.

The deadline counts from the processes' start, so it must leave the ranks time to start
(import torch, join the group) whatever the machine's load: a fixed 3 s did not beside two
CPU-bound processes (rank 0 had not returned and was named too), nor would any fixed figure
(a group of two ranks that return at once took 25 s to start at a load of 25). So the test
first times such a group, and gives the hung run three times that, plus 10 s. The hung rank
sleeps, so nothing but the deadline can stop it before the process group's own timeout,
which is set far beyond."""

from __future__ import annotations

import time

import pytest
from pipecc.runtime.tools.spawn import DEADLINE_ENV, spawn
from spawn_cases import return_rank, spin_on_rank_one

from pipecc.diagnostics import RankError


def test_a_rank_past_the_deadline_is_stopped_and_named() -> None:
    start = time.monotonic()
    assert spawn(return_rank, 2, None) == [0, 1]
    deadline = round(10 + 3 * (time.monotonic() - start))
    gloo_timeout = 10 * deadline
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        spawn(spin_on_rank_one, 2, None, deadline=deadline, timeout=gloo_timeout)
    message = str(caught.value)
    assert f"rank 1: still running after the run's deadline of {deadline} s" in message, message
    assert "rank 0" not in message.splitlines()[0], "rank 0 finished: not the one named"
    elapsed = time.monotonic() - start
    assert deadline <= elapsed < gloo_timeout / 2, "stopped at the deadline, not at gloo's"


def test_the_suite_bounds_every_group() -> None:
    import os

    assert float(os.environ[DEADLINE_ENV]) > 0, "tests/conftest.py sets a deadline"
