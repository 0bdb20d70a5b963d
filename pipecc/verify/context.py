"""What every check shares: the program, its wiring, and how to name an instruction.

Checks report through `Context.report`, which keeps at most `limit` violations of one code
(a dropped recv shifts every later message of its pair; one witness per kind is what a user
needs) and counts the rest for a closing note.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipecc.diagnostics import Note, Span, Violation
from pipecc.ir.keys import MessageKeys
from pipecc.ir.ops import Compute, Fused, Instr, Send
from pipecc.ir.printer import describe, has_pipes
from pipecc.ir.program import Program
from pipecc.semantics import Wiring

DEFAULT_LIMIT = 5


@dataclass
class Context:
    """One verification run: the program, its wiring, and the violations found so far."""

    program: Program
    wiring: Wiring
    limit: int = DEFAULT_LIMIT
    violations: list[Violation] = field(default_factory=list)
    kept: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)

    @property
    def keys(self) -> MessageKeys:
        """The message keys the wiring numbered the program's messages with."""
        return self.wiring.keys

    def report(self, violation: Violation) -> None:
        code = violation.code
        if self.kept[code] >= self.limit:
            self.dropped[code] += 1
            return
        self.kept[code] += 1
        self.violations.append(violation)

    def instr(self, rank: int, index: int) -> Instr:
        return self.program.ranks[rank][index]

    def span(self, rank: int, index: int) -> Span | None:
        """The source of an instruction: its own span, else the compute op it serves (a send
        follows the op producing its tensor; a recv or wait precedes the op consuming it)."""
        instrs = self.program.ranks[rank]
        if not 0 <= index < len(instrs):
            return None
        own = instrs[index].span
        if own is not None:
            return own
        forward = type(instrs[index]) is not Send
        order = (range(index + 1, len(instrs)), range(index - 1, -1, -1))
        for positions in order if forward else order[::-1]:
            for i in positions:
                if type(instrs[i]) in (Compute, Fused) and instrs[i].span is not None:
                    return instrs[i].span
        return None

    def line(self, rank: int, index: int) -> str:
        """`file:line:col` of an instruction's source, or "" when it has none."""
        span = self.span(rank, index)
        return span.location() if span is not None else ""

    def describe(self, rank: int, index: int) -> str:
        """`rank 1 @12 recv act stage 1 mb 2 from rank 0`: position and instruction."""
        return f"rank {rank} @{index} {self.what(self.instr(rank, index))}"

    def what(self, instr: Instr) -> str:
        """An instruction in words, with pipe numbers only when the program has two pipes."""
        return describe(instr, pipes=self._pipes, places=True)

    @property
    def _pipes(self) -> bool:
        return has_pipes(self.program)

    def note(self, rank: int, index: int, text: str) -> Note:
        return (self.span(rank, index), text)
