"""What pipecc prints as an op's name (`F0.3`, `F0.4&B1.1`) parses back in a .sched file and
means that op; the forms next to it that do not parse get a hint, with file:line:col."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipecc.api import compile_schedule
from pipecc.cli import main
from pipecc.diagnostics import ParseError, ScheduleError
from pipecc.driver.load import load
from pipecc.frontend import ast
from pipecc.frontend.parser import parse
from pipecc.ir.ops import Compute, Fused, Phase, is_compute
from pipecc.ir.program import Program
from tests.helpers import ROOT, compile_bundled, compute_order, run_cli

# Bundled schedules over every placement, split and fused backwards, V > 1, two pipes.
SIZES = [
    ("1f1b", 4, 8, {}),
    ("zb_h1", 2, 4, {}),
    ("interleaved_1f1b", 4, 8, {"V": 2}),
    ("looped_bfs", 2, 4, {"V": 3}),
    ("zbv", 4, 8, {}),
    ("dualpipev", 4, 8, {}),
    ("dualpipe", 4, 8, {}),
]

# An op's name anywhere in printed output: a letter, a chunk, a dot, a microbatch.
_PRINTED = re.compile(r"(?<![A-Za-z0-9_.])[FBIW][0-9]+\.[0-9]+(?:&[FBIW][0-9]+\.[0-9]+)?")


def _grid_sched(text_grid: str) -> str:
    """A .sched file that writes each rank's row of `pipecc compile --format text` as is."""
    header, *rows = text_grid.splitlines()
    placement = header.split("placement ", 1)[1].split("  ")[0]
    lines = ["schedule roundtrip", f"placement {placement}", "phase all {"]
    for row in rows:
        rank, cells = row.split("|", 1)
        lines.append(f"  if rank == {rank.split()[1]} {{ {cells.strip()} }}")
    lines.append("}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("name", "ranks", "mbs", "defines"), SIZES, ids=[s[0] for s in SIZES])
def test_the_text_grid_compiles_back_to_the_same_program(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    ranks: int,
    mbs: int,
    defines: dict[str, int],
) -> None:
    flags = [f"-D{k}={v}" for k, v in defines.items()]
    sizes = ["-P", str(ranks), "-M", str(mbs), *flags]
    code, grid, _ = run_cli(capsys, "compile", name, *sizes, "--format", "text")
    assert code == 0
    path = tmp_path / "roundtrip.sched"
    path.write_text(_grid_sched(grid))
    again = compile_schedule(path, ranks=ranks, microbatches=mbs)
    original = compile_bundled(name, ranks, mbs, **defines)
    assert compute_order(again) == compute_order(original)
    assert again.placement == original.placement


def _printed_outputs(capsys: pytest.CaptureFixture[str], name: str, sizes: list[str]) -> str:
    """What the commands print for one schedule: listing, explain, a verify witness."""
    outputs = []
    for argv in (
        ["compile", name, *sizes, "--format", "listing"],
        ["explain", name, *sizes, "--op", "1:9"],
        ["verify", name, *sizes, "--max-activations", "1", "--limit", "4"],
        ["verify", name, *sizes, "--comm", "rendezvous", "--cost", "F=1,B=2,I=1,W=1"],
    ):
        main(argv)
        out, err = capsys.readouterr()
        outputs.append(out + err)
    return "\n".join(outputs)


def _parsed_op(name: str) -> list[tuple[str, int, int]]:
    decls = parse(f"phase p {{ {name} }}").decls
    phase = decls[0]
    assert isinstance(phase, ast.Phase)
    stmt = phase.body[0]
    assert isinstance(stmt, ast.OpStmt)
    out = []
    for op in stmt.ops:
        assert isinstance(op.chunk, ast.Num) and isinstance(op.mb, ast.Num)
        out.append((op.kind.value, int(op.chunk.value), int(op.mb.value)))
    return out


def _ops_of(program: Program) -> dict[str, list[tuple[str, int, int]]]:
    """Each computation's and each fused op's name, with what it names."""
    names = {}
    for instrs in program.ranks:
        for instr in instrs:
            if isinstance(instr, Phase):  # a MoE phase is named by its op (`F0.2:pre0`)
                names[instr.op.label()] = [(instr.op.kind.value, instr.op.chunk, instr.op.mb)]
            elif isinstance(instr, Compute | Fused) and is_compute(instr):
                parts = [instr] if isinstance(instr, Compute) else list(instr[:2])
                names[instr.label()] = [(op.kind.value, op.chunk, op.mb) for op in parts]
                names.update((op.label(), [(op.kind.value, op.chunk, op.mb)]) for op in parts)
    return names


@pytest.mark.parametrize("name", ["zb_h1", "interleaved_1f1b", "dualpipe"])
def test_every_name_printed_by_the_commands_parses_as_its_op(
    capsys: pytest.CaptureFixture[str], name: str
) -> None:
    sizes = ["-P", "4", "-M", "8"]
    text = _printed_outputs(capsys, name, sizes)
    ops = _ops_of(compile_bundled(name, 4, 8))
    printed = set(_PRINTED.findall(text))
    assert len(printed) > 10
    assert printed <= set(ops)
    for label in printed:
        assert _parsed_op(label) == ops[label], label


WITNESSES = sorted((ROOT / "docs" / "examples" / "verify").glob("*.[jc]s*"))


@pytest.mark.parametrize("path", WITNESSES, ids=[p.name for p in WITNESSES])
def test_every_name_in_a_verifier_witness_parses_as_its_op(
    capsys: pytest.CaptureFixture[str], path: Path
) -> None:
    main(["verify", str(path), "--comm", "all"])
    out, err = capsys.readouterr()
    program, _ = load(str(path), lowering=None)
    ops = _ops_of(program)
    for label in set(_PRINTED.findall(out + err)):
        assert label in ops and _parsed_op(label) == ops[label], label


@pytest.mark.parametrize(
    ("dotted", "bracketed"),
    [
        ("F0.3 F1.0 B1.0 B0.3", "F0[3] F1[0] B1[0] B0[3]"),
        ("F1.1&B1.0", "F1[1]&B1[0]"),
        ("F0.2 & I12.10", "F0[2]&I12[10]"),
        ("W0.0 W", "W0[0] W"),
    ],
)
def test_a_dotted_name_is_its_bracketed_form(dotted: str, bracketed: str) -> None:
    def ops(text: str) -> list[tuple[object, ...]]:
        phase = parse(f"phase p {{ {text} }}").decls[0]
        assert isinstance(phase, ast.Phase)
        return [
            (op.kind, getattr(op.chunk, "value", None), getattr(op.mb, "value", None))
            for stmt in phase.body
            if isinstance(stmt, ast.OpStmt)
            for op in stmt.ops
        ]

    assert ops(dotted) == ops(bracketed)


def test_a_dotted_name_in_a_loop_is_the_same_microbatch_each_time(tmp_path: Path) -> None:
    path = tmp_path / "twice.sched"
    path.write_text("schedule twice\nphase p { repeat 2 { F0.1 } B0.1 }\n")
    with pytest.raises(ScheduleError) as caught:
        compile_schedule(path, ranks=1, microbatches=2)
    assert str(caught.value).splitlines()[:3] == [
        f"{path}:2:22: error: F0.1 appears twice on rank 0 (stage 0 of pipe 0 has one F per "
        "microbatch)",
        "    2 | phase p { repeat 2 { F0.1 } B0.1 }",
        "      |                      ^^^^",
    ]


def test_an_out_of_range_dotted_microbatch_is_reported_at_the_op(tmp_path: Path) -> None:
    path = tmp_path / "range.sched"
    path.write_text("schedule r\nphase p { F0.0 F0.17 B0.0 B0.1 }\n")
    with pytest.raises(ScheduleError) as caught:
        compile_schedule(path, ranks=1, microbatches=2)
    assert str(caught.value).splitlines() == [
        f"{path}:2:16: error: F0[17] on rank 0: microbatch 17 is not in pipe 0's range 0..1",
        "    2 | phase p { F0.0 F0.17 B0.0 B0.1 }",
        "      |                ^^^^^",
    ]


ERRORS = {
    "F0.i": "after the dot only an integer microbatch (F0.3); write F0[i] for an expression",
    "B1.(M - 1)": "after the dot only an integer microbatch (B1.3); write B1[...] for an "
    "expression",
    "F.3": "a dotted op name has its chunk: F0.3, or F[3] on a rank with one chunk",
    "W.2": "a dotted op name has its chunk: W0.2",
    "I(c).3": "a computed chunk takes its microbatch in brackets: I(c)[3]",
    "B(c % 2).i": "a computed chunk takes its microbatch in brackets: B(c % 2)[i]",
    "let x = F0.3": "F0.3 is an op: it stands in a block, not in an expression",
    "F0 .3": "an op name is written without spaces: F0.3",
    "F0.3.1": "an op name has one dot: F0.3",
}


@pytest.mark.parametrize("written", list(ERRORS))
def test_a_near_miss_gets_a_hint_at_its_dot(written: str) -> None:
    text = f"let c = 0\nphase p {{\n  {written}\n}}\n"
    with pytest.raises(ParseError) as caught:
        parse(text, "near.sched")
    column = 3 + written.index(".")
    message = str(caught.value)
    first, snippet, caret = message.splitlines()
    assert first.startswith(f"near.sched:3:{column}: error: unexpected character '.'; expected ")
    assert first.endswith(f"({ERRORS[written]})")
    assert snippet == f"    3 |   {written}"
    assert caret == "      |   " + " " * written.index(".") + "^"


def test_a_dotted_name_with_brackets_names_a_microbatch_twice() -> None:
    with pytest.raises(ParseError) as caught:
        parse("phase p { F0.3[2] }", "twice.sched")
    assert str(caught.value) == (
        "twice.sched:1:11: error: 'F0.3' already names chunk 0 and microbatch 3; write "
        "F0[expr] for a computed microbatch\n"
        "    1 | phase p { F0.3[2] }\n"
        "      |           ^^^^^^^"
    )


def test_the_bundled_schedules_still_parse() -> None:
    for path in sorted((ROOT / "schedules").glob("*.sched")):
        parse(path.read_text(), str(path))
