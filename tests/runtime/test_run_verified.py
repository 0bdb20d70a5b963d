"""`pipecc run` runs what it proved: it verifies the exact program it is about to execute under
its backend's comm model, says so in one line (a field in --json), and refuses a program
that fails (exit 1, verify's report) before any process starts; `--unverified` runs it
anyway, and then the run hangs into the runtime's timeout at the instruction the witness
names. One multi-process run (the hang); the rest stop before processes start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import compile_bundled, run_cli
from test_run_cli import MLP, pipecc

from pipecc.api import Lowering, compile_schedule
from pipecc.cli import build_parser
from pipecc.commands import run as run_command
from pipecc.diagnostics import ProgramError
from pipecc.interop import json_program

# both ranks wait for a send before posting the receive the other's send needs: each of
# them hand-placed, so no policy may replace them
DEADLOCK = """\
schedule dl
phase p {
  if rank == 0 { repeat M { F send act wait } repeat M { recv grad wait B } }
  else { repeat M { recv act wait F B send grad wait } }
}
"""
RUN = ("--nproc", "2", "-M", "2", "--model", MLP)


@pytest.fixture
def deadlock(tmp_path: Path) -> str:
    path = tmp_path / "dl.sched"
    path.write_text(DEADLOCK)
    return str(path)


def test_a_program_that_fails_verification_is_refused_with_verifys_report(
    deadlock: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """On gloo pipecc used to place early receives over the hand-placed ops, and the run
    passed --check; now it keeps them, verifies under rendezvous, and refuses."""
    code, out, err = run_cli(capsys, "run", deadlock, *RUN, "--check")
    assert code == 1, err
    assert out == "", "nothing ran"
    code, report, _ = run_cli(capsys, "verify", deadlock, "-P", "2", "-M", "2", "--backend", "gloo")
    assert code == 1
    assert "error[needs-buffering]" in report and "deadlock under rendezvous" in report
    assert err.startswith(report), "the same text verify prints"
    assert err.rstrip("\n").endswith(
        f"error: {deadlock} P=2 M=2: refused: it fails verification under rendezvous (gloo), "
        "as reported above; --unverified runs it anyway"
    ), err


def test_a_sched_whose_order_cannot_run_is_refused_with_the_cycle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the same violation `pipecc verify` reports (exit 1), and nothing runs, --unverified too
    path = tmp_path / "order.sched"
    path.write_text(
        "phase p { if rank == 0 { repeat M { F B } } else { repeat M { F } repeat M { B } } }\n"
    )
    _, report, _ = run_cli(capsys, "verify", str(path), "-P", "2", "-M", "2")
    for flags in ((), ("--unverified",)):
        code, out, err = run_cli(capsys, "run", str(path), *RUN, *flags)
        assert (code, out) == (1, "")
        assert err == (
            f"{report}\nerror: {path} P=2 M=2: refused: it has no correct program to run, as "
            "reported above\n"
        )


def test_a_program_placed_for_gloo_is_refused_on_nccl(tmp_path: Path) -> None:
    """The resolution on nccl (as a run with a GPU per rank makes it) of an early-recv .json:
    a note saying what it was placed for, the verification under nccl refusing it."""
    early = tmp_path / "early.json"
    program = compile_schedule("1f1b", ranks=2, microbatches=2, lowering=Lowering("early-recv"))
    early.write_text(json_program.dumps(program))
    args = build_parser().parse_args(["run", str(early), "--model", MLP])
    with pytest.raises(ProgramError, match=r"fails verification under nccl-single \(nccl\)"):
        run_command.program_to_run(args, lambda ranks: "nccl")
    verified = run_command.program_to_run(args, lambda ranks: "gloo")
    assert verified.ok and verified.resolved.choice.value == "program"
    assert verified.line() == (
        f"program: {early}, comm ops as in the input (early-recv), verified under rendezvous "
        "(gloo): ok"
    )


def test_a_default_program_on_gloo_gets_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    compiled = tmp_path / "zb_h1.json"
    compiled.write_text(json_program.dumps(compile_bundled("zb_h1", 2, 4)))
    args = build_parser().parse_args(["run", str(compiled), "--model", MLP])
    run_command.program_to_run(args, lambda ranks: "gloo")
    err = capsys.readouterr().err
    assert err == (
        f"note: {compiled} is placed by the default comm policy, nccl's; a compute-only input "
        "gets early-recv on gloo (--comm-policy early-recv places it for gloo)\n"
    )
    run_command.program_to_run(args, lambda ranks: "nccl")
    assert capsys.readouterr().err == "", "placed for nccl, run on nccl"


def test_unverified_runs_it_and_hangs_at_the_witness(deadlock: str) -> None:
    result = pipecc("run", deadlock, *RUN, "--unverified", "--timeout", "5")
    assert result.returncode == 1, result.stderr
    first = result.stdout.splitlines()[0]
    assert first == (
        f"program: {deadlock} P=2 M=2, 16 hand-placed comm ops kept, verified under "
        "rendezvous (gloo): FAILED, run anyway (--unverified)"
    ), result.stdout
    # the witness: rank 0 at @5 (wait 4, its send of mb 1), rank 1 at @5 (its send of grad 0)
    assert "stuck: rank 0 at @5 wait 4; rank 1 at @5 wait 4" in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert any("did not complete within 5 s" in line for line in lines), result.stderr
    # the rank that timed out first stops the other: its wait times out or fails with it
    for rank, what in ((0, "send act pipe 0 stage 1 mb 1"), (1, "send grad pipe 0 stage 0 mb 0")):
        at = r"step 0: instruction 5 \(wait 4\)"
        said = rf"^(error|note): rank {rank}, {at}: {what} .*\(instruction 4\)"
        assert any(re.search(said, line) for line in lines), result.stderr
