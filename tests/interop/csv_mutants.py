"""Edits of a torch CSV's rows, for the tests that check what verify and torch make of them."""

from __future__ import annotations

from collections.abc import Callable


def mutated(text: str, rank: int, edit: Callable[[list[str]], list[str]]) -> str:
    rows = [line.split(",") for line in text.splitlines()]
    rows[rank] = edit(rows[rank])
    return "".join(",".join(row) + "\n" for row in rows)


def reduce_first(row: list[str]) -> list[str]:
    """REDUCE_GRAD of the row's first stage moved before its last backward."""
    cell = next(c for c in row if c.endswith("REDUCE_GRAD"))
    stage = cell[: -len("REDUCE_GRAD")]
    row.remove(cell)
    last = max(i for i, c in enumerate(row) if c.startswith(stage) and c[len(stage)] in "BW")
    return [*row[:last], cell, *row[last:]]


def merge(text: str, rank: int, start: int, count: int) -> str:
    """Cells start..start+count-1 of row `rank` merged into one OVERLAP_F_B, in order."""
    rows = [line.split(",") for line in text.splitlines()]
    row = rows[rank]
    row[start : start + count] = ["(" + ";".join(row[start : start + count]) + ")OVERLAP_F_B"]
    return "".join(",".join(r) + "\n" for r in rows)


# Sequential OVERLAP_F_B cells torch trains correctly (pipecc used to refuse or reorder them):
# a W then an F, three sub-actions, a B then an F. (schedule, P, M, rank, first cell, count)
OVERLAPS = {
    "W;F": ("zb_h1", 2, 4, 0, 3, 2),
    "I;W;F": ("zb_h1", 2, 4, 0, 5, 3),
    "B;F": ("1f1b", 2, 4, 0, 2, 2),
}
