"""Every check of `pipecc verify` fires on a program made to fail it, with its full message.

Each case edits a compiled program (or reads a file in data/) so that one check fails, and
compares the whole rendered violation (location, message, caret, notes) with
expected/<case>.txt. Regenerate after an intended change with
`PIPECC_UPDATE_GOLDENS=1 pytest tests/verify/test_verify_errors.py` and review the diff.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ROOT
from programs import (
    DATA,
    codes,
    compiled,
    drop,
    duplicate,
    first,
    move,
    put,
    rendered,
    report,
)

from pipecc.api import compile_schedule
from pipecc.diagnostics import ProgramError, Violation
from pipecc.driver.check import verify_file, verify_program
from pipecc.interop import torch_csv
from pipecc.ir.ops import Wait
from pipecc.ir.placement import loop_placement
from pipecc.ir.program import Program
from pipecc.semantics import CommModel
from pipecc.verify import ALL_MODELS, Options

EXPECTED = Path(__file__).resolve().parent / "expected"


def _csv(name: str) -> Program:
    path = DATA / name
    return torch_csv.loads(path.read_text(), str(path.relative_to(ROOT))).program


def _1f1b() -> Program:
    return compiled("1f1b", 2, 2)


def _zbv() -> Program:
    return compiled("zbv", 2, 2)


# case -> (program, code of the violation it must raise, verify options)
CASES: dict[str, tuple[Callable[[], Program], str, dict[str, object]]] = {
    # rank 0 and rank 1 both send before they receive (pytorch/pytorch#172668)
    "deadlock": (lambda: _csv("pytorch_172668.csv"), "deadlock", {}),
    "orphan": (lambda: drop(_zbv(), 1, 1), "orphan", {}),
    "mismatch": (lambda: drop(_zbv(), 1, 1), "mismatch", {}),
    "route": (lambda: put(_1f1b(), 0, 1, _1f1b().ranks[0][1]._replace(peer=0)), "route", {}),
    "unwaited": (lambda: drop(_1f1b(), 1, 10), "unwaited", {}),
    "double-wait": (lambda: duplicate(_1f1b(), 0, 8, 9), "double-wait", {}),
    "bad-wait": (lambda: put(_1f1b(), 0, 8, Wait((0,))), "bad-wait", {}),
    "buffer-reuse": (lambda: duplicate(_1f1b(), 1, 0, 1), "buffer-reuse", {}),
    "forward-before-input": (lambda: move(_zbv(), 1, 4, 2), "forward-before-input", {}),
    "backward-before-gradient": (lambda: move(_zbv(), 1, 15, 12), "backward-before-gradient", {}),
    "backward-before-forward": (lambda: move(_1f1b(), 1, 4, 2), "backward-before-forward", {}),
    "weight-before-input-grad": (lambda: move(_zbv(), 0, 10, 7), "weight-before-input-grad", {}),
    "send-before-compute": (lambda: move(_1f1b(), 0, 1, 0), "send-before-compute", {}),
    "recv-after-use": (lambda: move(_1f1b(), 1, 0, 3), "recv-after-use", {}),
    "missing-recv": (lambda: drop(_zbv(), 1, 1), "missing-recv", {}),
    "coverage": (lambda: drop(_1f1b(), 1, 4), "coverage", {}),
    "placement": (
        lambda: replace(compiled("zbv", 4, 8), placement=loop_placement(4, 2)),
        "placement",
        {},
    ),
    "memory": (lambda: compiled("zb_h2", 4, 8), "memory", {"max_activations": 6}),
}


def _check_golden(name: str, text: str) -> None:
    path = EXPECTED / f"{name}.txt"
    if os.environ.get("PIPECC_UPDATE_GOLDENS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    assert path.exists(), f"no golden file {path}; run with PIPECC_UPDATE_GOLDENS=1"
    assert text + "\n" == path.read_text()


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_check_fires_with_its_full_message(case: str) -> None:
    build, code, options = CASES[case]
    result = report(build(), **options)
    assert code in codes(result)
    violation = first(result, code)
    assert isinstance(violation, Violation) and isinstance(violation, ProgramError)
    assert violation.exit_code == 1
    _check_golden(case, rendered(violation))


def test_needs_buffering_witness() -> None:
    """Megatron-LM#5100: one phase sends first on every rank; it runs only with buffering."""
    outcome = verify_file(
        str((DATA / "megatron_5100.sched").relative_to(ROOT)),
        ranks=4,
        microbatches=8,
        options=Options(models=ALL_MODELS),
    )
    verdicts = {v.model: v.status.value for v in outcome.report.verdicts}
    assert verdicts == {
        CommModel.NCCL: "needs buffering",
        CommModel.NCCL_SINGLE: "needs buffering",
        CommModel.RENDEZVOUS: "needs buffering",
        CommModel.EAGER: "passes",  # it completes with buffered sends: that is the finding
    }
    assert codes(outcome.report) == ["needs-buffering"]  # one cycle, under three models
    _check_golden("needs-buffering", rendered(first(outcome.report, "needs-buffering")))


def test_unrunnable_compute_order_names_its_cycle() -> None:
    result = verify_file(str((DATA / "unrunnable.csv").relative_to(ROOT))).report
    assert codes(result) == ["unrunnable-order"]
    _check_golden("unrunnable-order", rendered(result.violations[0]))


def test_witness_lists_every_hop_of_the_cycle() -> None:
    """The pytorch#172668 cycle: each rank sends before it receives from the other."""
    text = rendered(first(report(_csv("pytorch_172668.csv")), "deadlock"))
    hops = [line.split()[:4] for line in text.splitlines() if line.startswith("    rank")]
    assert hops[:4] == [
        ["rank", "0", "@4", "recv"],
        ["rank", "0", "@3", "send"],
        ["rank", "1", "@4", "recv"],
        ["rank", "1", "@3", "send"],
    ]
    assert "▶ @5 wait 4" in text


def test_a_correct_program_has_no_violation() -> None:
    result = report(compiled("dualpipe", 4, 8), models=ALL_MODELS)
    assert result.ok and not result.violations
    assert [p.peak for p in result.peaks] == [5, 5, 5, 5]


def test_violations_beyond_the_limit_are_counted() -> None:
    program = replace(compiled("zbv", 4, 8), placement=loop_placement(4, 2))
    result = report(program, limit=2)
    assert codes(result) == ["placement", "placement"]
    assert dict(result.dropped) == {"placement": 94}  # 96 misplaced ops, 2 shown


def _late_forward_input(program: Program, rank: int, recv: int, fused: int) -> Program:
    """`program` with rank's Recv at index `recv` moved to just after the fused op at `fused`."""
    instrs = list(program.ranks[rank])
    order = [i for i in range(len(instrs)) if i != recv]
    order.insert(order.index(fused) + 1, recv)
    new_of = {old: new for new, old in enumerate(order)}
    moved = [
        x._replace(ops=tuple(sorted(new_of[o] for o in x.ops))) if type(x) is Wait else x
        for x in (instrs[old] for old in order)
    ]
    ranks = list(program.ranks)
    ranks[rank] = tuple(moved)
    return replace(program, ranks=tuple(ranks))


@pytest.mark.parametrize("binding", ["unique", "general"])
def test_late_input_of_a_fused_forward_is_a_recv_after_use(
    binding: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DualPipe P=4 M=8, rank 0: F1.6&B0.0 at 21 takes the activation received at 18 and the
    # gradient received at 19; receiving the activation after the fused op is the error,
    # whichever way the wiring binds each op to its receives
    from pipecc.semantics import wiring

    if binding == "general":  # the binding used when a rank receives some message twice
        monkeypatch.setattr(
            wiring._Builder,
            "_bind_unique",
            lambda self, rank, base, instrs, computes, received: self._bind_computes(
                rank, base, instrs, computes
            ),
        )
    program = compile_schedule("dualpipe", ranks=4, microbatches=8)
    assert str(program.ranks[0][18]).startswith("Recv(what=<Msg.ACT")
    report = verify_program(_late_forward_input(program, 0, 18, 21), Options())[0]
    assert "recv-after-use" in {v.code for v in report.violations}
