"""Mutation tests: the replay engine and the verifier against an independent oracle.

Compiled programs of every bundled schedule, as compiled and with every op posted alone, are
mutated at random (swap two adjacent instructions, swap two sends, drop a recv, move a wait
later, duplicate a compute, move a send or recv anywhere, post a send or recv twice, post
every op alone); for each
mutant and each comm model, the engine's final state (cursors, posted and completed ops),
the verifier's verdict, and (timed) every start and completion time must equal what the
explicit-state oracle in oracle.py computes. Zero disagreements; the class breakdown is
printed (pytest -s).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from helpers import compile_bundled
from mutants import CLASSES, mutate, random_comm_program, ungrouped
from oracle import MODELS, Outcome, run, run_timed

from pipecc.ir.ops import Collective, Compute, Fused, Send
from pipecc.ir.program import Program
from pipecc.semantics import NO_OVERHEAD, CommModel, Overhead, Replay, replay, wire
from pipecc.verify import Options, Status, verify

SOURCES = [
    ("1f1b", 2, 3, {}),
    ("1f1b", 3, 5, {}),
    ("gpipe", 3, 2, {}),
    ("zb_h1", 3, 4, {}),
    ("zb_h2", 2, 3, {}),
    ("interleaved_1f1b", 2, 4, {"V": 2}),
    ("interleaved_zb", 2, 4, {}),
    ("looped_bfs", 2, 2, {}),
    ("zbv", 2, 3, {}),
    ("dualpipev", 2, 4, {}),
    ("dualpipe", 2, 4, {}),
    ("dualpipe", 4, 8, {}),
]
MUTANTS = 3200


def _programs() -> list[Program]:
    """Each source as compiled, and with every op posted alone (which makes the models
    differ: a send before a recv toward one peer is a cycle under nccl, not rendezvous)."""
    compiled = [compile_bundled(name, p, m, **d) for name, p, m, d in SOURCES]
    return compiled + [ungrouped(program) for program in compiled]


def _engine_state(run_: Replay) -> Outcome:
    w = run_.wiring
    cursors = [run_.cursors[r] - w.offsets[r] for r in range(w.num_ranks)]
    posted = {
        w.locate(g) for g, c in enumerate(w.code) if c in (1, 2, 4) and run_.start[g] is not None
    }
    completed = {w.locate(g) for g, t in enumerate(run_.done) if t is not None}
    matched = {
        w.locate(g): w.locate(p)
        for g, p in enumerate(w.partner)
        if p >= 0 and w.locate(g) in posted and w.locate(p) in posted
    }
    return Outcome(cursors, posted, completed, matched)


def _finished(program: Program, outcome: Outcome) -> bool:
    return (
        all(c == len(instrs) for c, instrs in zip(outcome.cursors, program.ranks, strict=True))
        and outcome.posted <= outcome.completed
    )


def _compare(program: Program, model: str) -> tuple[bool, bool]:
    """(engine == oracle, oracle says it finishes) for one program and model."""
    expected = run(program, model)
    got = _engine_state(replay(program, model=CommModel(model)))
    same = (
        got.cursors == expected.cursors
        and got.posted == expected.posted
        and got.completed == expected.completed
        and got.matched == expected.matched
    )
    return same, _finished(program, expected)


def _verdict_agrees(program: Program, finishes: dict[str, bool]) -> bool:
    """The verifier passes a model exactly when the oracle finishes under it (eager
    included: a program that needs its sends buffered passes there, and fails the report
    with a needs-buffering violation instead)."""
    report = verify(program, Options(models=tuple(CommModel(m) for m in MODELS)))
    for verdict in report.verdicts:
        if (verdict.status is Status.PASSES) != finishes[verdict.model.value]:
            return False
    return True


def test_bundled_programs_agree_with_the_oracle() -> None:
    for program in _programs():
        for model in MODELS:
            same, _ = _compare(program, model)
            assert same, (program.schedule, model)


def test_random_mutants_agree_with_the_oracle() -> None:
    rng = random.Random(20260529)
    programs = _programs()
    made: Counter[str] = Counter()
    stuck: Counter[tuple[str, str]] = Counter()
    disagreements: list[str] = []
    while sum(made.values()) < MUTANTS:
        cls = CLASSES[sum(made.values()) % len(CLASSES)]
        source = rng.choice(programs)
        mutant = mutate(source, cls, rng)
        if mutant is None:
            continue
        made[cls] += 1
        finishes = {}
        for model in MODELS:
            same, finishes[model] = _compare(mutant, model)
            if not same:
                disagreements.append(
                    f"{cls} of {source.schedule}: engine and oracle differ under {model}"
                )
            if not finishes[model]:
                stuck[(cls, model)] += 1
        if made[cls] % 4 == 0 and not _verdict_agrees(mutant, finishes):
            disagreements.append(f"{cls} of {source.schedule}: verifier verdict differs")
    print(
        f"\n{sum(made.values())} mutants × {len(MODELS)} models; disagreements with the "
        f"oracle: {len(disagreements)}"
    )
    for cls in CLASSES:
        runs = ", ".join(f"{m} {stuck[(cls, m)]}" for m in MODELS)
        print(f"  {cls:<18} {made[cls]:>5} mutants; do not finish under: {runs}")
    assert not disagreements, disagreements[:5]


def test_random_comm_programs_agree_with_the_oracle() -> None:
    """Random posting orders, groups and waits: the four models disagree with each other
    often here (stream order, buffering), and the engine must follow each one."""
    rng = random.Random(5)
    outcomes: Counter[tuple[bool, ...]] = Counter()
    for _ in range(1500):
        program = random_comm_program(rng)
        finishes = []
        for model in MODELS:
            same, ok = _compare(program, model)
            assert same, (program.ranks, model)
            finishes.append(ok)
        outcomes[tuple(finishes)] += 1
    print("\n1500 random comm programs; finishes under (nccl, nccl-single, rendezvous, eager):")
    for key, count in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {key}: {count}")
    # monotonicity (DESIGN §5): nccl-single ⇒ nccl ⇒ rendezvous ⇒ eager
    assert all(a <= b <= c <= d for (b, a, c, d) in outcomes)
    assert len(outcomes) >= 4  # the models do differ on these programs


def _timing(program: Program, rng: random.Random) -> tuple[dict, dict]:
    duration, latency = {}, {}
    for r, instrs in enumerate(program.ranks):
        for i, instr in enumerate(instrs):
            if type(instr) in (Compute, Fused):
                duration[(r, i)] = float(rng.randint(1, 5))
            elif type(instr) is Send:
                latency[(r, i)] = float(rng.randint(0, 3))
            elif type(instr) is Collective:  # each member's own: the engine reads its own
                latency[(r, i)] = float(rng.randint(0, 3))  # the first member's counts
    return duration, latency


class _Table:
    def __init__(self, duration: dict, latency: dict, overhead: dict[int, Overhead]) -> None:
        self.d, self.l, self.o = duration, latency, overhead

    def duration(self, rank: int, index: int, instr: object) -> float:
        return self.d[(rank, index)]

    def latency(self, rank: int, index: int, send: object) -> float:
        return self.l[(rank, index)]

    def collective(self, rank: int, index: int, op: object) -> float:
        return self.l[(rank, index)]

    def overhead(self, rank: int) -> Overhead:
        return self.o[rank]


def _overhead(program: Program, rng: random.Random | None) -> dict[int, Overhead]:
    """Host time per post and per Wait on each rank: none, or small random integers."""
    return {
        rank: Overhead(float(rng.randint(0, 2)), float(rng.randint(0, 2))) if rng else NO_OVERHEAD
        for rank in range(program.num_ranks)
    }


@pytest.mark.parametrize("host", [False, True], ids=["no-overhead", "overhead"])
@pytest.mark.parametrize("model", MODELS)
def test_timed_replay_agrees_with_a_discrete_event_simulation(model: str, host: bool) -> None:
    rng = random.Random(7)
    host_rng = random.Random(11) if host else None
    programs = _programs()
    checked = 0
    for k in range(200):
        program = rng.choice(programs)
        mutant = mutate(program, rng.choice(CLASSES), rng) if rng.random() < 0.5 else program
        if k % 4 == 0:
            mutant = random_comm_program(rng)
        if mutant is None:
            continue
        duration, latency = _timing(mutant, rng)
        overhead = _overhead(mutant, host_rng)
        expected = run_timed(mutant, model, duration, latency, dict(overhead))
        timing = _Table(duration, latency, overhead)
        got = replay(mutant, model=CommModel(model), timing=timing, wiring=wire(mutant))
        starts = {
            (r, i): got.start_time(r, i)
            for r, instrs in enumerate(mutant.ranks)
            for i in range(len(instrs))
            if got.start_time(r, i) is not None
        }
        dones = {
            (r, i): got.done_time(r, i)
            for r, instrs in enumerate(mutant.ranks)
            for i in range(len(instrs))
            if got.done_time(r, i) is not None
        }
        assert starts == expected.times, (mutant.schedule, model)
        assert dones == expected.done_at, (mutant.schedule, model)
        checked += 1
    assert checked > 100
