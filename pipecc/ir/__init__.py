"""The intermediate representation: instructions, placement, programs (DESIGN §2, §4).

This layer imports only `pipecc.diagnostics` and the standard library.
"""

from __future__ import annotations

from pipecc.ir.ops import Compute, Fused, Instr, Kind, Msg, Recv, Send, Wait, computations
from pipecc.ir.placement import Placement, StageSlot
from pipecc.ir.program import Program

__all__ = [
    "Compute",
    "Fused",
    "Instr",
    "Kind",
    "Msg",
    "Placement",
    "Program",
    "Recv",
    "Send",
    "StageSlot",
    "Wait",
    "computations",
]
