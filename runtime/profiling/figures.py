"""The statistics a profile is made of, over samples grouped by timed step.

A figure of one (stage, op) is the median over the timed steps of each step's mean
(runtime/profiling/recorder.py says why the mean within a step and the median across
steps), and its spread the relative interquartile range of those means. `fit_latency` is
the rendezvous rule solved for a latency: the one under which a set of waits would have
been released when they were.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple

Samples = dict[int, list[float]]  # step -> the seconds of one (stage, op) measured in it


class Figure(NamedTuple):
    """One (stage, op)'s duration over the timed steps: the median of the per-step means
    (ms) and their spread (module docstring; None with one step)."""

    ms: float
    spread: float | None


def relative_iqr(values: Sequence[float]) -> float | None:
    """(Q3 − Q1) / median of `values` (inclusive quartiles); None for fewer than two."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    middle = statistics.median(values)
    return (q3 - q1) / middle if middle > 0 else 0.0


def figure(samples: Samples) -> Figure:
    """The median over steps of each step's mean, and the spread of those means."""
    means = [statistics.fmean(seconds) for _, seconds in sorted(samples.items()) if seconds]
    spread = relative_iqr(means)
    return Figure(
        round(statistics.median(means) * 1e3, 4), None if spread is None else round(spread, 4)
    )


def fit_latency(waits: list[tuple[float, float, float]]) -> float:
    """The smallest latency c ≥ 0 with Σ max(start, ready + c) = Σ release over `waits`
    (seconds).

    The left side grows with c, is at most the right side at c = 0 (no wait is released
    before it starts or before its transfer can start) and at least it at c = the longest
    release − ready, so bisection finds it.
    """
    target = sum(release for _, _, release in waits)
    low, high = 0.0, max((release - ready for _, ready, release in waits), default=0.0)
    while high - low > 1e-9:
        middle = (low + high) / 2
        if sum(max(start, ready + middle) for start, ready, _ in waits) < target:
            low = middle
        else:
            high = middle
    return max(high, 0.0)
