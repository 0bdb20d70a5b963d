"""The choices a replay is made under: the comm model and the timing (DESIGN §5, §6)."""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol

from pipecc.ir.ops import Collective, Compute, Fused, Phase, Send, Sequential, StageOp


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


class Overhead(NamedTuple):
    """Host time a rank spends on communication besides the transfers themselves."""

    post: float  # on each Send/Recv it posts; the op (its group) is posted at the end of it
    wait: float  # on each Wait, after the Wait is released


NO_OVERHEAD = Overhead(0.0, 0.0)


class Timing(Protocol):
    """Durations, latencies and host overheads for a timed replay (the simulator's cost
    model)."""

    def duration(
        self, rank: int, index: int, instr: Compute | Fused | Sequential | StageOp | Phase
    ) -> float:
        """How long compute instruction `index` of `rank` runs (a MoE phase included)."""
        ...

    def latency(self, rank: int, index: int, send: Send) -> float:
        """From the moment the transfer of this send can start to its data being available
        at the receiver (not busy time)."""
        ...

    def collective(self, rank: int, index: int, op: Collective) -> float:
        """From the moment the last member of this collective is ready (posted, and under
        nccl at the head of its streams) to its completion on every member."""
        ...

    def overhead(self, rank: int) -> tuple[float, float]:
        """Host time `rank` spends on each post and after each Wait's release: (post, wait),
        an `Overhead`."""
        ...


class ZeroTiming:
    """Every duration, latency and overhead is 0: the untimed replay."""

    def duration(
        self, rank: int, index: int, instr: Compute | Fused | Sequential | StageOp | Phase
    ) -> float:
        return 0.0

    def latency(self, rank: int, index: int, send: Send) -> float:
        return 0.0

    def collective(self, rank: int, index: int, op: Collective) -> float:
        return 0.0

    def overhead(self, rank: int) -> Overhead:
        return NO_OVERHEAD


ZERO_TIMING = ZeroTiming()
