"""The intermediate representation: instructions, placement, programs (DESIGN §2, §4), the
message key (`keys`) and the formatter (`printer`).

This layer imports only `pipecc.diagnostics` and the standard library.
"""

from __future__ import annotations

from pipecc.ir.keys import Message, MessageKeys
from pipecc.ir.ops import Compute, Fused, Instr, Kind, Msg, Recv, Send, Wait, computations
from pipecc.ir.placement import Placement, StageSlot
from pipecc.ir.program import Backend, Program

__all__ = [
    "Backend",
    "Compute",
    "Fused",
    "Instr",
    "Kind",
    "Message",
    "MessageKeys",
    "Msg",
    "Placement",
    "Program",
    "Recv",
    "Send",
    "StageSlot",
    "Wait",
    "computations",
]
