"""Workers for tests/runtime/test_spawn_deadline.py (a spawned process imports its worker by
module name, so workers live outside the test module)."""

from __future__ import annotations

import time
from typing import Any


def spin_on_rank_one(rank: int, world: int, payload: Any) -> int:
    """Rank 0 returns at once; rank 1 never reaches a collective (no backend timeout fires)."""
    while rank == 1:
        time.sleep(0.05)
    return rank


def return_rank(rank: int, world: int, payload: Any) -> int:
    """Every rank returns at once: the time a group takes to start."""
    return rank
