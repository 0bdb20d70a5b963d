"""Every bundled schedule verifies clean, and the default lowering is safe under every model.

- Grid: every file in schedules/ for P ∈ 2..8 and every M ≤ 4P its requires allow, under
  nccl, nccl-single, rendezvous and eager.
- The default lowering (passes.insert_comms) never turns a runnable compute order into a
  deadlock or a mismatch (DESIGN §5): random runnable compute orders (projections of a random
  topological order of the whole step, with random F&B fusions) are lowered and verified
  under every model; random per-rank shuffles are either refused with a dependency cycle or
  lowered and verified the same way.
"""

from __future__ import annotations

import random

import pytest
from helpers import SCHEDULES

from pipecc.driver.check import verify_program
from pipecc.driver.sweep import Schedule, Skip, check_size
from pipecc.ir.ops import Compute, Fused, Instr, Kind
from pipecc.ir.placement import Placement, loop_placement, vshape_placement
from pipecc.ir.program import Program
from pipecc.verify import ALL_MODELS, Options

ALL = Options(models=ALL_MODELS)
FILES = sorted(p.name for p in SCHEDULES.glob("*.sched"))


@pytest.mark.parametrize("name", FILES)
def test_bundled_schedule_verifies_under_every_model(name: str) -> None:
    schedule = Schedule(str(SCHEDULES / name))
    verified = 0
    for ranks in range(2, 9):
        for microbatches in range(1, 4 * ranks + 1):
            found = check_size(schedule, ranks, microbatches, {}, ALL)
            if isinstance(found, Skip):
                continue
            assert found.report.ok, "\n".join(str(v) for v in found.report.violations)
            verified += 1
    assert verified >= 20


# ---- the default lowering on random compute orders -------------------------------------------


def _placement(rng: random.Random, ranks: int) -> Placement:
    return (
        vshape_placement(ranks) if rng.random() < 0.3 else loop_placement(ranks, rng.randint(1, 2))
    )


def _random_order(
    rng: random.Random, placement: Placement, microbatches: int
) -> list[list[Compute]]:
    """Each rank's ops, in a random topological order of the whole step."""
    stages = placement.num_stages(0)
    split = {(s, m): rng.random() < 0.5 for s in range(stages) for m in range(microbatches)}
    done: set[tuple[str, int, int]] = set()
    todo = {("F", s, m) for s in range(stages) for m in range(microbatches)}
    todo |= {
        ("I" if split[(s, m)] else "B", s, m) for s in range(stages) for m in range(microbatches)
    }
    todo |= {("W", s, m) for (s, m), yes in split.items() if yes}
    order: list[list[Compute]] = [[] for _ in range(placement.num_ranks)]
    while todo:
        ready = sorted(op for op in todo if _ready(op, done, stages, split))
        op = rng.choice(ready)
        todo.remove(op)
        done.add(op)
        kind, s, m = op
        slot = placement.holder(0, s)
        order[slot.rank].append(Compute(Kind(kind), slot.chunk, 0, s, m))
    return order


def _ready(
    op: tuple[str, int, int],
    done: set[tuple[str, int, int]],
    stages: int,
    split: dict[tuple[int, int], bool],
) -> bool:
    kind, s, m = op
    if kind == "F":
        return s == 0 or ("F", s - 1, m) in done
    if kind == "W":
        return ("I", s, m) in done
    below = "I" if s + 1 < stages and split[(s + 1, m)] else "B"
    return ("F", s, m) in done and (s + 1 == stages or (below, s + 1, m) in done)


def _fuse(rng: random.Random, ops: list[Compute]) -> tuple[Instr, ...]:
    """Fuse some adjacent (F, B/I) pairs of different chunks into one F&B / F&I."""
    out: list[Instr] = []
    i = 0
    while i < len(ops):
        a = ops[i]
        b = ops[i + 1] if i + 1 < len(ops) else None
        if (
            b is not None
            and a.kind is Kind.F
            and b.kind in (Kind.B, Kind.I)
            and a.chunk != b.chunk
            and rng.random() < 0.5
        ):
            out.append(Fused(a, b))
            i += 2
        else:
            out.append(a)
            i += 1
    return tuple(out)


def _program(placement: Placement, microbatches: int, ranks: list[tuple[Instr, ...]]) -> Program:
    return Program(
        "random", "", placement.num_ranks, microbatches, (), "none", placement, tuple(ranks)
    )


def test_default_lowering_of_runnable_orders_passes_every_model() -> None:
    rng = random.Random(11)
    checked = fused = 0
    for _ in range(120):
        ranks = rng.randint(2, 4)
        placement = _placement(rng, ranks)
        microbatches = rng.randint(1, 5)
        order = _random_order(rng, placement, microbatches)
        program = _program(placement, microbatches, [_fuse(rng, ops) for ops in order])
        fused += sum(type(x) is Fused for row in program.ranks for x in row)
        report, _ = verify_program(program, ALL)
        codes = [v.code for v in report.violations]
        # a fusion may join two ops whose halves depend on each other across ranks: that
        # order is unrunnable and must be refused as such, never lowered into a deadlock
        assert report.ok or codes == ["unrunnable-order"], [str(v) for v in report.violations]
        checked += report.ok
    assert checked >= 60 and fused > 30


def test_default_lowering_of_shuffled_orders_is_safe_or_refused() -> None:
    rng = random.Random(12)
    outcomes = {"lowered and verified": 0, "refused with a cycle": 0}
    for _ in range(150):
        ranks = rng.randint(2, 3)
        placement = _placement(rng, ranks)
        microbatches = rng.randint(1, 4)
        order = _random_order(rng, placement, microbatches)
        for ops in order:  # a few random swaps per rank: often no longer runnable
            for _ in range(rng.randint(0, 3)):
                if len(ops) > 1:
                    i = rng.randrange(len(ops) - 1)
                    ops[i], ops[i + 1] = ops[i + 1], ops[i]
        program = _program(placement, microbatches, [tuple(ops) for ops in order])
        report, _ = verify_program(program, ALL)
        codes = {v.code for v in report.violations}
        if report.ok:
            outcomes["lowered and verified"] += 1
        else:
            # the only ways a shuffled order may fail: it cannot run at all, or the shuffle
            # broke a same-rank dependency (a W before its I, a backward before its F)
            assert codes <= {
                "unrunnable-order",
                "weight-before-input-grad",
                "backward-before-forward",
                "forward-before-input",
                "backward-before-gradient",
            }, codes
            outcomes["refused with a cycle"] += "unrunnable-order" in codes
    assert min(outcomes.values()) >= 20, outcomes
