"""Write a found order as a .sched file that compiles back to the same compute order.

Each rank's order is written as its op letters and chunks (`F0 I1 W1 ...`); where ops of one
kind and stage run in microbatch order (the search always runs them so) the bare op takes
the next microbatch of its counter, and a `W` the oldest pending `I` of its chunk, so no
microbatch needs naming; an op out of that order names its microbatch (`I0[3]`, `W0[3]`).
Periodic stretches become `repeat N { ... }` (the longest saving tandem repeat first); the
ranks' listings are the branches of `if rank == r` chains, since a searched order has no
closed form in `rank`, in three phases: each rank's warm-up (before its first I), steady
state (up to its last F) and cool-down (a phase whose ops are the same on every rank needs
no chain). A `require` line pins the file to the size it was searched for. Without the split
(`--no-split`) the order is written with full backwards, `B0`, and no `W`.
"""

from __future__ import annotations

from pipecc.ir.ops import Kind
from pipecc.search.lower import chunk_of, program_order
from pipecc.search.problem import Order, Problem, SearchOp

MAX_BLOCK = 12  # longest repeated block looked for
WIDTH = 96


def op_tokens(problem: Problem, ops: tuple[SearchOp, ...]) -> list[str]:
    """The DSL spelling of one rank's ops (bare where the counter gives the microbatch)."""
    loop = problem.placement == "loop"
    nxt: dict[tuple[Kind, int], int] = {}
    pending: dict[int, list[int]] = {}  # stage -> microbatches whose I ran, W not yet
    tokens = []
    for op in ops:
        chunk = "" if loop else str(chunk_of(problem, op.stage))
        first = problem.first_mb(op.stage)
        mb = first + op.mb  # the global number (a second pipe's come after the first's)
        if op.kind is Kind.W:
            queue = pending[op.stage]
            bare = queue[0] == mb
            queue.remove(mb)
        else:
            counter = (op.kind, op.stage)
            bare = nxt.get(counter, first) == mb
            if bare:
                nxt[counter] = mb + 1
            if op.kind is Kind.I:
                pending.setdefault(op.stage, []).append(mb)
        if op.kind is not Kind.W or bare:
            tokens.append(f"{op.kind.value}{chunk}" + ("" if bare else f"[{mb}]"))
        else:
            tokens.append(f"W{chunk or '0'}[{mb}]")
    return tokens


def _best_repeat(tokens: list[str], i: int) -> tuple[int, int]:
    """(block length, count) of the tandem repeat at `i` that saves most tokens (count 1:
    none)."""
    best = (1, 1)
    saved = 0
    for length in range(1, min(MAX_BLOCK, (len(tokens) - i) // 2) + 1):
        block = tokens[i : i + length]
        count = 1
        while tokens[i + count * length : i + (count + 1) * length] == block:
            count += 1
        if length * (count - 1) >= 2 and length * (count - 1) > saved:
            best, saved = (length, count), length * (count - 1)
    return best


def compress(tokens: list[str]) -> list[str]:
    """Tokens with tandem repeats folded into `repeat N { ... }` (nested blocks are not
    folded again)."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        length, count = _best_repeat(tokens, i)
        if count == 1:
            out.append(tokens[i])
            i += 1
        else:
            out.append(f"repeat {count} {{ {' '.join(tokens[i : i + length])} }}")
            i += length * count
    return out


def _wrap(items: list[str], indent: str) -> list[str]:
    lines, line = [], indent
    for item in items:
        if len(line) + len(item) + 1 > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += item + " "
    if line.strip():
        lines.append(line.rstrip())
    return lines


PHASES = ("warmup", "steady", "cooldown")


def split_phases(tokens: list[str]) -> tuple[list[str], list[str], list[str]]:
    """A rank's tokens before its first I (warm-up), up to its last F (steady state), and
    after it (cool-down)."""
    first_i = next((k for k, t in enumerate(tokens) if t[0] in "IB"), len(tokens))
    last_f = max((k + 1 for k, t in enumerate(tokens) if t.startswith("F")), default=0)
    middle = max(first_i, last_f)
    return tokens[:first_i], tokens[first_i:middle], tokens[middle:]


def _phase(name: str, per_rank: list[list[str]]) -> list[str]:
    """One phase: the same ops on every rank, or an `if rank == r` chain over the ranks
    that have ops in it."""
    if all(not tokens for tokens in per_rank):
        return []
    lines = [f"phase {name} {{"]
    if all(tokens == per_rank[0] for tokens in per_rank):
        lines += _wrap(compress(per_rank[0]), "  ")
        return [*lines, "}"]
    keyword = "if"
    for rank, tokens in enumerate(per_rank):
        if tokens:
            lines.append(f"  {keyword} rank == {rank} {{")
            lines += _wrap(compress(tokens), "    ")
            keyword = "} elif"
    return [*lines, "  }", "}"]


def write_sched(problem: Problem, order: Order, name: str, header: str = "") -> str:
    """The .sched text of `order` (module docstring)."""
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += [
        f"schedule {name}",
        *placement_lines(problem),
        f"require P == {problem.ranks}, M == {problem.total_microbatches}",
    ]
    split = [split_phases(op_tokens(problem, ops)) for ops in program_order(problem, order)]
    for k, phase in enumerate(PHASES):
        body = _phase(phase, [parts[k] for parts in split])
        if body:
            lines += ["", *body]
    return "\n".join(lines) + "\n"


def placement_lines(problem: Problem) -> list[str]:
    """The placement declaration: its name, or for a table (`--placement-from`) each chunk's
    pipe and stage as a chain over the ranks."""
    layout = problem.ir_placement()
    if problem.placement != "table":
        return [f"placement {problem.placement}"]
    lines = ["placement {"]
    for chunk in range(layout.num_chunks(0)):
        slots = [layout.slot(rank, chunk) for rank in range(problem.ranks)]
        pipe = _by_rank([slot.pipe for slot in slots])
        stage = _by_rank([slot.stage for slot in slots])
        lines.append(f"  chunk {chunk}: pipe {pipe}, stage {stage}")
    return [*lines, "}"]


def _by_rank(values: list[int]) -> str:
    """An expression of `rank` with these values on ranks 0, 1, ...: `if rank == 0 then 3
    else if rank == 1 then 2 else 1`."""
    text = str(values[-1])
    if len(set(values)) == 1:
        return text
    for rank in range(len(values) - 2, -1, -1):
        text = f"if rank == {rank} then {values[rank]} else {text}"
    return text
