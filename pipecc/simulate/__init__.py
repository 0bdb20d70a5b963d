"""The simulator: a timed replay of a Program under a cost model (`timeline`)."""

from __future__ import annotations
