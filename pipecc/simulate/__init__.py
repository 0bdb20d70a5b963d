"""The simulator: a timed replay of a Program under a cost model (`timeline`)."""

from __future__ import annotations

from pipecc.simulate.timeline import (
    Blocked,
    DeadlockedError,
    RankStats,
    TimedOp,
    Timeline,
    op_name,
    simulate,
)

__all__ = [
    "Blocked",
    "DeadlockedError",
    "RankStats",
    "TimedOp",
    "Timeline",
    "op_name",
    "simulate",
]
