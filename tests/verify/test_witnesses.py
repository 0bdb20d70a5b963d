"""`--comm all`: one witness per distinct cycle, naming the models it occurs under, and each
model's verdict as its own replay decides it (pipecc.verify.deadlock)."""

from __future__ import annotations

import random
import re

import pytest
from helpers import ROOT, run_cli
from mutants import random_comm_program
from programs import DATA, codes, compiled, move, report

from pipecc.api import compile_schedule
from pipecc.driver.check import verify_file
from pipecc.ir.program import Program
from pipecc.semantics import CommModel, replay
from pipecc.verify import ALL_MODELS, Options, Report, Status
from pipecc.verify.deadlock import _witness

EXAMPLES = ROOT / "docs" / "examples" / "verify"
WITNESS_CODES = ("deadlock", "needs-buffering")
HEAD = re.compile(r"deadlock under ([a-z, -]+?): ")
HOP = re.compile(r"^    rank (\d+) @(\d+) ", re.M)


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _witnesses(result: Report) -> list[tuple[list[CommModel], set[tuple[int, int]]]]:
    """Each witness of the report: the models its head names, and its hops."""
    found = []
    for v in result.violations:
        if v.code in WITNESS_CODES:
            head = HEAD.search(v.message)
            assert head is not None, v.message
            models = [CommModel(name) for name in head.group(1).split(", ")]
            hops = {(int(r), int(i)) for r, i in HOP.findall(v.message)}
            found.append((models, hops))
    return found


def _blocked_state(program: Program, model: CommModel) -> tuple[object, ...]:
    """What makes two models' failures one cycle: the hops and every rank's stuck point."""
    run = replay(program, model=model)
    path, closed = _witness(run, {(s.rank, s.index): s for s in run.stuck})
    stuck_at = tuple(run.blocked_at(r) for r in range(program.num_ranks))
    return closed, frozenset(path), stuck_at


def _check_witnesses(program: Program) -> Report:
    """The class property: every model that hangs is named by exactly one witness; the
    models one witness names are stuck in the same state; two witnesses are different
    cycles; and a model passes exactly when its own replay finishes."""
    result = report(program, models=ALL_MODELS)
    witnesses = _witnesses(result)
    named = [m for models, _ in witnesses for m in models]
    assert len(named) == len(set(named)), [str(v) for v in result.violations]
    for verdict in result.verdicts:
        finished = replay(program, model=verdict.model).finished
        assert (verdict.status is Status.PASSES) == finished, verdict
        hangs = verdict.status in (Status.DEADLOCK, Status.NEEDS_BUFFERING)
        assert hangs == (verdict.model in named), verdict
    states = []
    for models, hops in witnesses:
        state = {_blocked_state(program, m) for m in models}
        assert len(state) == 1, (models, state)
        assert next(iter(state))[1] == hops
        states.append(state.pop())
    assert len(states) == len(set(states))
    return result


def test_sends_that_block_first_are_one_cycle_under_three_models(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = "docs/examples/verify/sends_block_first.sched"
    code, out, _ = run_cli(capsys, "verify", path, "-P", "2", "-M", "2", "--comm", "all")
    assert code == 1
    assert out.count("error[") == 1
    assert (
        "needs buffering: the program completes only when sends are buffered (eager); it "
        "hangs for large messages or across nodes. deadlock under nccl, nccl-single, "
        "rendezvous: ranks 0 → 1 → 0 wait for each other in a cycle" in out
    )
    # the weakest of the three models explains the cycle: it needs no stream order
    assert "(rendezvous: a send and its receive complete together, once both are posted)" in out
    assert "(nccl" not in out
    assert out.splitlines()[-2] == (
        f"{path} P=2 M=2: 1 violation(s) (needs-buffering 1); nccl needs buffering, "
        "nccl-single needs buffering, rendezvous needs buffering, eager passes"
    )
    assert len(out.splitlines()) == 20  # it was 74: four copies of the same cycle


def test_a_cycle_under_nccl_single_only(capsys: pytest.CaptureFixture[str]) -> None:
    path = "docs/examples/verify/single_stream_cycle.sched"
    code, out, _ = run_cli(capsys, "verify", path, "-P", "3", "-M", "2", "--comm", "all")
    assert code == 1
    assert out.count("error[") == 1
    assert "error[deadlock]: deadlock under nccl-single: ranks 2 → 1 → 0 → 2 wait" in out
    assert "queued behind @2, not complete (nccl-single: rank 0's ops run in posting order" in out
    assert out.splitlines()[-2] == (
        f"{path} P=3 M=2: 1 violation(s) (deadlock 1); nccl passes, nccl-single deadlock, "
        "rendezvous passes, eager passes"
    )


def test_stream_order_cycle_shared_by_nccl_and_nccl_single(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(capsys, "verify", str(DATA / "pytorch_172668.csv"), "--comm", "all")
    assert code == 1
    assert out.count("error[deadlock]: deadlock under nccl, nccl-single: ranks 0 → 1 → 0") == 1
    assert out.count("error[") == 1


def test_eager_alone_still_reports_needs_buffering() -> None:
    """Passing eager is never safe when a send must wait for its receive elsewhere: the
    verdict says eager passes (it does), the report fails with the rendezvous cycle."""
    outcome = verify_file(
        str(EXAMPLES / "sends_block_first.sched"),
        ranks=2,
        microbatches=2,
        options=Options(models=(CommModel.EAGER,)),
    )
    assert [(v.model, v.status) for v in outcome.report.verdicts] == [
        (CommModel.EAGER, Status.PASSES)
    ]
    assert codes(outcome.report) == ["needs-buffering"]
    assert "deadlock under rendezvous: ranks 0 → 1 → 0" in outcome.report.violations[0].message


@pytest.mark.parametrize(
    "path", ["sends_block_first.sched", "single_stream_cycle.sched", "pair_order_cycle.sched"]
)
def test_examples_have_the_witness_property(path: str) -> None:
    source = EXAMPLES / path if (EXAMPLES / path).exists() else DATA / path
    ranks = 3 if "single" in path else 2
    _check_witnesses(compile_schedule(source, ranks=ranks, microbatches=2))


def test_random_comm_programs_have_the_witness_property() -> None:
    """1500 random posting orders, groups and waits (the models disagree often there)."""
    rng = random.Random(22)
    merged = 0
    for _ in range(1500):
        result = _check_witnesses(random_comm_program(rng))
        merged += sum(len(models) > 1 for models, _ in _witnesses(result))
    assert merged > 100  # shared cycles are common: the merge is exercised


def test_moved_sends_of_bundled_programs_have_the_witness_property() -> None:
    rng = random.Random(3)
    program = compiled("zb_h1", 3, 4)
    for _ in range(60):
        rank = rng.randrange(program.num_ranks)
        index = rng.randrange(len(program.ranks[rank]))
        _check_witnesses(move(program, rank, index, rng.randrange(len(program.ranks[rank]))))
