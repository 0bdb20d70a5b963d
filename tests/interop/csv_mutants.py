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
