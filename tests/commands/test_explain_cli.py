"""`pipecc explain --op`: an instruction named by its index, by its printed name (`3:W0.0`)
or by the .sched notation (`3:W0[0]`), fused ops included; an unknown name lists close ops."""

from __future__ import annotations

import re

import pytest

from pipecc.commands.explain import _index
from pipecc.diagnostics import InputError
from pipecc.ir.ops import computations, is_compute
from tests.helpers import compile_bundled, run_cli


def _bracketed(label: str) -> str:
    """`F0.4&B1.1` as the .sched's bracket form `F0[4]&B1[1]`."""
    return re.sub(r"([FBIW][0-9]+)\.([0-9]+)", r"\1[\2]", label)


@pytest.mark.parametrize(
    ("name", "ranks", "mbs"),
    [("zb_h1", 4, 8), ("interleaved_1f1b", 4, 8), ("dualpipe", 4, 8), ("dualpipev", 4, 8)],
)
def test_every_compute_instruction_is_found_by_both_notations(
    name: str, ranks: int, mbs: int
) -> None:
    program = compile_bundled(name, ranks, mbs)
    found = 0
    for rank, instrs in enumerate(program.ranks):
        for index, instr in enumerate(instrs):
            if not is_compute(instr):
                continue
            label = instr.label()
            assert _index(program, rank, label) == index
            assert _index(program, rank, _bracketed(label)) == index
            for half in computations(instr):  # one half names its fused op
                assert _index(program, rank, half.label()) == index
            found += 1
    assert found >= ranks * mbs  # at least one instruction per rank and microbatch


def test_a_name_explains_what_its_index_explains(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = ["-P", "4", "-M", "8", "--cost", "F=1,B=2,I=1,W=1,comm=0.1"]
    program = compile_bundled("dualpipe", 4, 8)
    index = next(i for i, instr in enumerate(program.ranks[2]) if "&" in instr.label())
    label = program.ranks[2][index].label()
    by_index = run_cli(capsys, "explain", "dualpipe", *sizes, "--op", f"2:{index}")
    assert by_index[0] == 0 and label in by_index[1]
    for written in (label, _bracketed(label), label.replace("&", " & ")):
        assert run_cli(capsys, "explain", "dualpipe", *sizes, "--op", f"2:{written}") == by_index


def test_an_unknown_name_lists_the_close_ops_of_that_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(capsys, "explain", "zb_h1", "-P", "2", "-M", "4", "--op", "1:W0.9")
    assert (code, out) == (2, "")
    assert err == "error: --op 1:W0.9: rank 1 has no W0.9; close on rank 1: W0.3 W0.2 W0.1 W0.0\n"


def test_a_fused_name_that_is_not_there_names_where_its_halves_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run_cli(
        capsys, "explain", "dualpipe", "-P", "4", "-M", "8", "--op", "2:F0[5]&B1[1]"
    )
    assert code == 2
    assert err == (
        "error: --op 2:F0[5]&B1[1]: rank 2 has no F0.5&B1.1; close on rank 2: F0.5 F0.7&B1.1\n"
    )


def test_an_op_of_another_rank_says_where_it_is() -> None:
    program = compile_bundled("dualpipe", 4, 8)
    with pytest.raises(InputError) as caught:
        _index(program, 0, "F0.4")
    where = [
        f"rank {rank} [{index}]"
        for rank, instrs in enumerate(program.ranks)
        for index, instr in enumerate(instrs)
        if is_compute(instr) and instr.label() == "F0.4"
    ]
    assert len(where) == 2, "DualPipe P=4: F0.4 is chunk 0's on ranks 2 and 3"
    assert f"rank 0 has no F0.4 (F0.4 is on {', '.join(where)})" in caught.value.message


@pytest.mark.parametrize(
    ("written", "says"),
    [
        ("1:W0.x", "write W0[x] for an expression"),
        ("1:F0[1+1]", "an op's name gives its chunk and microbatch as numbers: F0.3 or F0[3]"),
        ("1:W", "an op's name gives its chunk and microbatch as numbers"),
        ("1:99", "rank 1 has instructions 0..24"),
        ("5:F0.0", "the program has ranks 0..1"),
    ],
)
def test_a_bad_op_is_an_input_error(
    capsys: pytest.CaptureFixture[str], written: str, says: str
) -> None:
    code, out, err = run_cli(capsys, "explain", "zb_h1", "-P", "2", "-M", "4", "--op", written)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: --op {written}: ") and says in err
    assert "Traceback" not in err
