"""The choices a replay is made under: the comm model and the timing (DESIGN §5, §6)."""

from __future__ import annotations

import enum
from typing import Protocol

from pipecc.ir.ops import Compute, Fused, Send


class CommModel(enum.Enum):
    """How posted sends and receives complete (DESIGN §5; the package docstring)."""

    NCCL = "nccl"
    NCCL_SINGLE = "nccl-single"
    RENDEZVOUS = "rendezvous"
    EAGER = "eager"

    @property
    def has_streams(self) -> bool:
        """True for the models in which ops queue on FIFO streams (nccl, nccl-single)."""
        return self is CommModel.NCCL or self is CommModel.NCCL_SINGLE


class Timing(Protocol):
    """Durations and latencies for a timed replay (the simulator's cost model)."""

    def duration(self, rank: int, index: int, instr: Compute | Fused) -> float:
        """How long compute instruction `index` of `rank` runs."""
        ...

    def latency(self, rank: int, index: int, send: Send) -> float:
        """From the moment the transfer of this send can start to its data being available
        at the receiver (not busy time)."""
        ...


class ZeroTiming:
    """Every duration and latency is 0: the untimed replay."""

    def duration(self, rank: int, index: int, instr: Compute | Fused) -> float:
        return 0.0

    def latency(self, rank: int, index: int, send: Send) -> float:
        return 0.0


ZERO_TIMING = ZeroTiming()
