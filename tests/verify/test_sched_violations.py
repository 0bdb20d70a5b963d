"""A .sched file whose order deadlocks, or whose hand-placed messages mismatch, is a wrong
schedule (exit 1, the verifier's report with carets on the source), as the same program in
a .json or a .csv is; exit 2 stays for input pipecc cannot use (issue 32, part 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_cli

from pipecc.api import compile_source
from pipecc.diagnostics import LoweringViolation, ViolatedScheduleError
from pipecc.driver.compile import compile_order
from pipecc.interop import json_program
from pipecc.passes.insert_comms import insert_comms

DEADLOCK = "phase p { if rank == 0 { repeat M { F B } } else { repeat M { F } repeat M { B } } }\n"
DEADLOCK_CSV = "0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n"

CYCLE = (
    "error[unrunnable-order]: the compute order cannot run, under any placement of sends and "
    "receives: every op on this cycle waits for the next\n"
    "  rank 0 @1 B0.0 (stage 0 mb 0)  waits for  rank 1 @2 B0.0 (stage 1 mb 0)  (which makes "
    "the data it needs)\n"
    "  rank 1 @2 B0.0 (stage 1 mb 0)  waits for  rank 1 @1 F0.1 (stage 1 mb 1)  (the op before "
    "it on rank 1)\n"
    "  rank 1 @1 F0.1 (stage 1 mb 1)  waits for  rank 0 @2 F0.1 (stage 0 mb 1)  (which makes "
    "the data it needs)\n"
    "  rank 0 @2 F0.1 (stage 0 mb 1)  waits for  rank 0 @1 B0.0 (stage 0 mb 0)  (the op before "
    "it on rank 0)\n"
)
SCHED_CARETS = (
    "    1 | phase p { if rank == 0 { repeat M { F B } } else { repeat M { F } repeat M { B } } }\n"
    "      |                                       ^\n"
    "dl.sched:1:78: note: rank 1 is on the cycle here\n"
    "    1 | phase p { if rank == 0 { repeat M { F B } } else { repeat M { F } repeat M { B } } }\n"
    "      |                                                                              ^\n"
)

MISMATCH = """schedule mm
phase p {
  if rank == 0 { F F send act send act repeat M { B } }
  else { recv act recv act repeat M { F B } }
}
"""
MISMATCH_REPORT = (
    "mm.sched:3:22: error[mismatch]: rank 0 → rank 1: messages 1 and 2 are swapped: rank 0 "
    "sends act stage 1 mb 1 (@2 0SEND_F1, output of 0F1) then act stage 1 mb 0 (@3 0SEND_F0, "
    "output of 0F0), rank 1 receives act stage 1 mb 0 (@0 1RECV_F0) then act stage 1 mb 1 "
    "(@1 1RECV_F1); NCCL and gloo match untagged sends and receives in posting order, so "
    "rank 1 gets the wrong tensor (no error, no hang)\n"
    "    3 |   if rank == 0 { F F send act send act repeat M { B } }\n"
    "      |                      ^^^^^^^^\n"
    "mm.sched:4:10: note: rank 1 posts its 1st receive from rank 0 here: recv act stage 1 mb 0 "
    "from rank 0\n"
    "    4 |   else { recv act recv act repeat M { F B } }\n"
    "      |          ^^^^^^^^\n"
)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    Path("dl.sched").write_text(DEADLOCK)
    Path("dl.csv").write_text(DEADLOCK_CSV)
    order = compile_order("dl.sched", ranks=2, microbatches=2)
    Path("dl.json").write_text(json_program.dumps(order))
    Path("mm.sched").write_text(MISMATCH)
    return tmp_path


def _first_error(out: str) -> str:
    """The violation's message, from `error[...]` to the first source line."""
    head = out[out.index("error[") :]
    return head[: head.index("    1 |")]


def test_deadlocking_order_is_one_violation_in_sched_json_and_csv(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = {}
    for path, sizes in (("dl.sched", ("-P", "2", "-M", "2")), ("dl.json", ()), ("dl.csv", ())):
        code, out, err = run_cli(capsys, "verify", path, *sizes)
        assert (code, err) == (1, ""), path
        found[path] = _first_error(out)
    assert found == {"dl.sched": CYCLE, "dl.json": CYCLE, "dl.csv": CYCLE}
    code, out, _ = run_cli(capsys, "verify", "dl.sched", "-P", "2", "-M", "2")
    assert out == (
        f"dl.sched:1:39: {CYCLE}{SCHED_CARETS}\n"
        "dl.sched P=2 M=2: 1 violation(s) (unrunnable-order 1)\n"
        "peak activations per rank (stage units): 1 2\n"
    )


def test_compile_of_a_deadlocking_order_exits_1_naming_the_cycle(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "compile", "dl.sched", "-P", "2", "-M", "2")
    assert (code, out) == (1, "")
    assert err == (
        f"dl.sched:1:39: {CYCLE}{SCHED_CARETS}\n"
        "error: dl.sched P=2 M=2: the schedule is wrong: the verifier finds unrunnable-order 1 "
        "('pipecc verify' of it shows every check)\n"
    )


def test_mismatched_hand_placed_messages_are_a_violation(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "verify", "mm.sched", "-P", "2", "-M", "2")
    assert (code, err) == (1, "")
    assert out == (
        f"{MISMATCH_REPORT}\n"
        "mm.sched P=2 M=2: 1 violation(s) (mismatch 1); nccl-single passes\n"
        "peak activations per rank (stage units): 2 1\n"
    )
    code, out, err = run_cli(capsys, "compile", "mm.sched", "-P", "2", "-M", "2")
    assert (code, out) == (1, "")
    assert err == (
        f"{MISMATCH_REPORT}\n"
        "error: mm.sched P=2 M=2: the schedule is wrong: the verifier finds mismatch 1 "
        "('pipecc verify' of it shows every check)\n"
    )


def test_unusable_input_still_exits_2(files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    Path("bad.sched").write_text("phase p { repeat Mx { F B } }\n")
    code, out, err = run_cli(capsys, "verify", "bad.sched", "-P", "2", "-M", "2")
    assert code == 2
    assert out.startswith("bad.sched P=2 M=2: cannot use this input (compile): ")


def test_api_raises_the_violation(files: Path) -> None:
    with pytest.raises(ViolatedScheduleError) as caught:
        compile_source(MISMATCH, "mm.sched", ranks=2, microbatches=2)
    assert caught.value.exit_code == 1
    assert [v.code for v in caught.value.violations] == ["mismatch"]


def test_the_lowering_counts_messages_from_1(files: Path) -> None:
    order = compile_order("mm.sched", ranks=2, microbatches=2)
    with pytest.raises(LoweringViolation) as caught:
        insert_comms(order)
    assert caught.value.message == (
        "rank 0's send #1 to rank 1 carries act stage 1 mb 1 but rank 1's receive #1 from "
        "rank 0 expects act stage 1 mb 0: messages between two ranks match in posting order, "
        "so this would deliver the wrong tensor (check the order of the hand-placed sends and "
        "recvs)"
    )
