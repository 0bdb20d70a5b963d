"""What every check shares: the program, its wiring, and how to name an instruction.

Checks report through `Context.report`, which keeps at most `limit` violations of one code
(a dropped recv shifts every later message of its pair; one witness per kind is what a user
needs) and counts the rest for a closing note.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipecc.diagnostics import Note, Span, Violation
from pipecc.ir.ops import Compute, Fused, Instr, Recv, Send, Wait, computations
from pipecc.ir.program import Program
from pipecc.semantics import Wiring
from pipecc.semantics.wiring import MessageKeys

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
    keys: MessageKeys = field(init=False)

    def __post_init__(self) -> None:
        self.keys = MessageKeys(self.program)

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
        match instr:
            case Compute() | Fused():
                return compute_words(instr, self._pipes)
            case Send() | Recv():
                verb, arrow = ("send", "to") if type(instr) is Send else ("recv", "from")
                group = f" [group {instr.group}]" if instr.group is not None else ""
                return (
                    f"{verb} {message_words(instr, self._pipes)} {arrow} rank {instr.peer}{group}"
                )
            case Wait(ops=ops):
                return "wait " + " ".join(str(i) for i in ops)
            case _:
                raise AssertionError(f"unknown instruction {instr!r}")

    @property
    def _pipes(self) -> bool:
        return self.program.placement.num_pipes > 1

    def note(self, rank: int, index: int, text: str) -> Note:
        return (self.span(rank, index), text)


def message_words(op: Send | Recv, pipes: bool) -> str:
    pipe = f"pipe {op.pipe} " if pipes else ""
    return f"{op.what.value} {pipe}stage {op.stage} mb {op.mb}"


def compute_words(instr: Compute | Fused, pipes: bool) -> str:
    """`F0.2 (stage 3, mb 2)`; a fused op names both halves."""
    parts = computations(instr)
    where = "; ".join(
        (f"pipe {op.pipe} " if pipes else "") + f"stage {op.stage} mb {op.mb}" for op in parts
    )
    return f"{instr.label()} ({where})"


def torch_name(op: Compute) -> str:
    """torch.distributed.pipelining's name of a computation: stage, letter, microbatch."""
    return f"{op.stage}{op.kind.value}{op.mb}"
