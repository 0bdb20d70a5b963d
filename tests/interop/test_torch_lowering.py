"""pipecc's reimplementation of torch's lowering equals torch's own, action for action.

torch is the oracle: for every export of the nine bundled schedules torch can express (P=2
and P=4, M=8, and a few more sizes), torch's `_add_unshard_reshard`, `_add_reduce_grad`,
`_add_send_recv` and `_defer_recv_ops` lower the compute-only CSV pipecc writes, and
pipecc's `torch_lowering` must print the same cells in the same order, or raise where torch
raises.
"""

from __future__ import annotations

import csv
import io
from typing import Any

import pytest
from helpers import compile_bundled

from pipecc.api import bundled_schedules
from pipecc.interop import torch_csv
from pipecc.ir.program import Program
from pipecc.passes import torch_lowering
from pipecc.passes.torch_actions import compute_actions, stage_ranks

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

SCHEDULES = tuple(name for name in bundled_schedules() if name != "dualpipe")
EXPORTS = [(s, p, 8) for s in SCHEDULES for p in (2, 4)]
MORE = [("looped_bfs", 3, 6), ("interleaved_1f1b", 3, 6), ("zbv", 3, 4), ("dualpipev", 3, 6),
        ("interleaved_zb", 4, 4), ("zb_h2", 3, 5), ("1f1b", 4, 3)]  # fmt: skip


def torch_rows(program: Program) -> dict[int, list[Any]]:
    """The compute-only export, parsed by torch."""
    rows = csv.reader(io.StringIO(torch_csv.dumps(program)))
    return {r: [schedules._Action.from_str(c) for c in row] for r, row in enumerate(rows)}


def torch_lowering_of(program: Program, defer: bool) -> list[list[str]] | str:
    """torch's lowering of the export, as cells; the message if torch raises."""
    rows = torch_rows(program)
    mapping = schedules._validate_schedule(
        rows, program.num_ranks, program.placement.num_stages(0), program.num_microbatches
    )
    try:
        lowered = {
            r: schedules._add_reduce_grad(
                schedules._add_unshard_reshard(actions), program.num_microbatches
            )
            for r, actions in rows.items()
        }
        lowered = schedules._add_send_recv(lowered, lambda s: mapping[s], len(mapping))
        if defer:
            lowered = schedules._defer_recv_ops(lowered, lambda s: mapping[s])
    except AssertionError as err:
        return str(err)
    return [[str(a) for a in lowered[r]] for r in range(program.num_ranks)]


def pipecc_lowering_of(program: Program, defer: bool) -> list[list[str]] | str:
    try:
        lowered = torch_lowering.lower(
            compute_actions(program), program.num_microbatches, stage_ranks(program), defer=defer
        )
    except torch_lowering.MalformedSchedule as err:
        return str(err)
    return [[str(a) for a in row] for row in lowered]


@pytest.mark.parametrize("defer", [False, True], ids=["torch", "torch-defer"])
@pytest.mark.parametrize(("schedule", "ranks", "microbatches"), EXPORTS + MORE)
def test_lowering_equals_torch(schedule: str, ranks: int, microbatches: int, defer: bool) -> None:
    program = compile_bundled(schedule, ranks, microbatches)
    want = torch_lowering_of(program, defer)
    got = pipecc_lowering_of(program, defer)
    if isinstance(want, str):
        assert isinstance(got, str), f"torch raises {want!r}, pipecc lowers it"
        return
    assert not isinstance(got, str), f"pipecc raises {got!r}, torch lowers it"
    for rank in range(ranks):
        assert got[rank] == want[rank], f"rank {rank}"


# V=4 chunks: several stages leave the prefetch window at once (the eviction order counts)
CHUNKY = [("interleaved_1f1b", 2, 8, 4), ("looped_bfs", 2, 4, 4), ("interleaved_zb", 2, 4, 4)]


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches", "chunks"), [(*e, 0) for e in EXPORTS] + CHUNKY
)
def test_each_pass_equals_torch(schedule: str, ranks: int, microbatches: int, chunks: int) -> None:
    defines = {"V": chunks} if chunks else {}
    program = compile_bundled(schedule, ranks, microbatches, **defines)
    rows = torch_rows(program)
    mine = compute_actions(program)
    for rank, actions in rows.items():
        assert [str(a) for a in mine[rank]] == [str(a) for a in actions]
        for window in (1, 2, 3):
            want = schedules._add_unshard_reshard(actions, window)
            got = torch_lowering.add_unshard_reshard(mine[rank], window)
            assert [str(a) for a in got] == [str(a) for a in want], (rank, window)
        want = schedules._add_reduce_grad(actions, microbatches)
        got = torch_lowering.add_reduce_grad(mine[rank], microbatches)
        assert [str(a) for a in got] == [str(a) for a in want]
        assert [str(a) for a in torch_lowering.merge_bw(mine[rank])] == [
            str(a) for a in schedules._merge_bw(list(actions))
        ]


def test_malformed_schedule_is_refused_as_torch_does() -> None:
    # each rank's first forward needs the other's: no rank can place anything
    text = "0B0,0F0,0F1,0B1\n1F0,1B0,1F1,1B1\n"
    loaded = torch_csv.loads(text).program
    with pytest.raises(torch_lowering.MalformedSchedule, match="malformed compute schedule"):
        torch_lowering.lower(compute_actions(loaded), 2, stage_ranks(loaded))
    rows = {r: [schedules._Action.from_str(c) for c in line.split(",")]
            for r, line in enumerate(text.splitlines())}  # fmt: skip
    with pytest.raises(AssertionError, match="Malformed compute schedule"):
        schedules._add_send_recv(rows, lambda s: s, 2)


def test_unshard_reshard_on_random_orders_equals_torch() -> None:
    """Orders no bundled schedule makes: several stages evicted at once, large stage
    numbers (the eviction order is a set's), overlapped pairs on one stage."""
    import random

    from pipecc.passes.torch_actions import Action, ActionKind, overlap

    rng = random.Random(7)
    for _ in range(300):
        mine: list[Action | None] = []
        for _ in range(rng.randrange(1, 30)):
            stage = rng.choice((0, 1, 2, 3, 5, 8, 9, 16, 17, 25))
            roll = rng.random()
            if roll < 0.1:
                mine.append(None)
            elif roll < 0.3:
                other = rng.choice((stage, stage + 8, 1))
                mine.append(
                    overlap((Action(stage, ActionKind.F, 0), Action(other, ActionKind.B, 1)))
                )
            else:
                mine.append(Action(stage, rng.choice((ActionKind.F, ActionKind.W)), 0))
        theirs = [None if a is None else schedules._Action.from_str(str(a)) for a in mine]
        for window in (1, 2, 3, 4):
            want = [str(a) for a in schedules._add_unshard_reshard(theirs, window)]
            assert [str(a) for a in torch_lowering.add_unshard_reshard(mine, window)] == want
        want = [str(a) for a in schedules._add_reduce_grad(theirs, 2)]
        assert [str(a) for a in torch_lowering.add_reduce_grad(mine, 2)] == want
