"""Bad .sched input: one clear message with file:line:col and a caret, exit code 2.

Each test compares the whole rendered message, caret line included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipecc.cli import main


def _compile(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    text: str,
    *flags: str,
) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)
    Path("bad.sched").write_text(text)
    code = main(["compile", "bad.sched", *flags])
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err


CASES = {
    "syntax_missing_brace": (
        "schedule x\nphase a { repeat M { F B }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:2:27: error: unexpected end of file; expected an op (F0, B1, I1, W, ...), "
        "'}', 'for', 'group', 'if', 'let', 'recv', 'repeat', ... (is a '}' missing?)\n"
        "    2 | phase a { repeat M { F B }\n"
        "      |                           ^\n",
    ),
    "syntax_bad_statement": (
        "phase a { repeat M { min(1, 2) } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:22: error: unexpected 'min'; expected an op (F0, B1, I1, W, ...), '}', "
        "'for', 'group', 'if', 'let', 'recv', 'repeat', ... (a block holds ops (F0, B1, I1, W, "
        "F0&B1), repeat/for/if/let, and send/recv/wait)\n"
        "    1 | phase a { repeat M { min(1, 2) } }\n"
        "      |                      ^^^\n",
    ),
    "unknown_name": (
        "phase a { repeat Mx { F B } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:18: error: unknown name 'Mx'; did you mean 'M'?\n"
        "    1 | phase a { repeat Mx { F B } }\n"
        "      |                  ^^\n",
    ),
    "unknown_placement": (
        "placement loops\nphase a { repeat M { F B } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:1: error: unknown placement 'loops' (known: loop, vshape, bidirectional, or "
        "a table 'placement { chunk 0: stage ... }'); did you mean 'loop'?\n"
        "    1 | placement loops\n"
        "      | ^^^^^^^^^^^^^^^\n",
    ),
    "require_violated": (
        "require P % 2 == 0, M >= 2 * P\nphase a { repeat M { F B } }\n",
        ("-P", "4", "-M", "6"),
        "bad.sched:1:21: error: requires M >= 2 * P, got M=6, P=4\n"
        "    1 | require P % 2 == 0, M >= 2 * P\n"
        "      |                     ^^^^^^^^^^\n",
    ),
    "negative_repeat": (
        "phase a { repeat M - P { F B } }\n",
        ("-P", "4", "-M", "3"),
        "bad.sched:1:18: error: repeat count is -1, which is negative, on rank 0 (P=4, M=3)\n"
        "    1 | phase a { repeat M - P { F B } }\n"
        "      |                  ^^^^^\n",
    ),
    "inexact_division": (
        "let h = P / 2\nphase a { repeat M { F B } }\n",
        ("-P", "3", "-M", "2"),
        "bad.sched:1:9: error: '/' is exact division, but 3 / 2 leaves a remainder on rank 0 "
        "(P=3, M=2) (write '//' to round down)\n"
        "    1 | let h = P / 2\n"
        "      |         ^^^^^\n",
    ),
    "floor_division_by_zero": (
        "phase a { for k in 0 .. M { F(k // (rank - 1)) B } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:31: error: division by zero (0 // 0) on rank 1 (P=2, M=2)\n"
        "    1 | phase a { for k in 0 .. M { F(k // (rank - 1)) B } }\n"
        "      |                               ^^^^^^^^^^^^^^^\n",
    ),
    "modulo_by_zero": (
        "let v = 0\nphase a { for k in 0 .. M { F(k % v) B } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:2:31: error: division by zero (0 % 0) on rank 0 (P=2, M=2)\n"
        "    2 | phase a { for k in 0 .. M { F(k % v) B } }\n"
        "      |                               ^^^^^\n",
    ),
    "w_without_i": (
        "phase a { repeat M { F } W }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:26: error: W on rank 0 has no pending I to complete (a W computes the "
        "weight gradient of an earlier I)\n"
        "    1 | phase a { repeat M { F } W }\n"
        "      |                          ^\n",
    ),
    "i_without_w": (
        "phase a { repeat M { F I } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:24: error: I0.0 on rank 0 has no W: its weight gradient is never computed\n"
        "    1 | phase a { repeat M { F I } }\n"
        "      |                        ^\n",
    ),
    "missing_backward": (
        "phase a { repeat M { F } }\n",
        ("-P", "2", "-M", "2"),
        "error: rank 0 chunk 0 (stage 0 of pipe 0) has no backward (B or I) for microbatch 0\n",
    ),
    "too_many_forwards": (
        "phase a { repeat M { F B } F }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:28: error: F0 on rank 0 would take microbatch 2, but pipe 0 has only "
        "microbatches 0..1: too many forwards for chunk 0\n"
        "    1 | phase a { repeat M { F B } F }\n"
        "      |                            ^\n",
    ),
    "duplicate_explicit_microbatch": (
        "phase a { F[0] F[0] F[1] repeat M { B } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:16: error: F0.0 appears twice on rank 0 (stage 0 of pipe 0 has one F per "
        "microbatch)\n"
        "    1 | phase a { F[0] F[0] F[1] repeat M { B } }\n"
        "      |                ^^^^\n"
        "bad.sched:1:11: note: first here\n"
        "    1 | phase a { F[0] F[0] F[1] repeat M { B } }\n"
        "      |           ^^^^\n",
    ),
    "chunk_out_of_range": (
        "phase a { repeat M { F2 B } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:22: error: F2: rank 0 has no chunk 2 (placement loop gives it 1)\n"
        "    1 | phase a { repeat M { F2 B } }\n"
        "      |                      ^^\n",
    ),
    "backward_before_forward": (
        "phase a { repeat M { B F } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:22: error: B0.0 on rank 0 comes before its forward F0.0 (a backward needs "
        "the activations of its forward)\n"
        "    1 | phase a { repeat M { B F } }\n"
        "      |                      ^\n",
    ),
    "type_error": (
        "phase a { repeat M < 3 { F B } }\n",
        ("-P", "2", "-M", "2"),
        "bad.sched:1:18: error: expected an integer here, but this is a condition (true/false)\n"
        "    1 | phase a { repeat M < 3 { F B } }\n"
        "      |                  ^^^^^\n",
    ),
    "unknown_define": (
        "param V = 2\nplacement loop(V)\nphase a { for c in 0 .. V { repeat M { F(c) } }"
        " for c in 0 .. V { repeat M { B(V - 1 - c) } } }\n",
        ("-P", "2", "-M", "2", "-D", "v=3"),
        "error: -D v: the schedule has no parameter 'v' (its parameters: V); did you mean 'V'?\n",
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_error_message(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text, flags, expected = CASES[name]
    code, err = _compile(tmp_path, monkeypatch, capsys, text, *flags)
    assert err == expected
    assert code == 2


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("missing", "error: nothing.sched: no such file\n"),
        ("directory", "error: folder.sched: is a directory, not a file\n"),
        ("binary", "error: junk.sched: not a text file (it contains NUL bytes)\n"),
        ("latin1", "error: latin.sched: not UTF-8 text (byte 6 cannot be decoded)\n"),
    ],
)
def test_unreadable_input_is_one_line(
    setup: str,
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    name = {
        "missing": "nothing.sched",
        "directory": "folder.sched",
        "binary": "junk.sched",
        "latin1": "latin.sched",
    }[setup]
    if setup == "directory":
        Path(name).mkdir()
    elif setup == "binary":
        Path(name).write_bytes(b"\x00\x01\x02\xff junk")
    elif setup == "latin1":
        Path(name).write_bytes(b"phase \xe9 { }")
    assert main(["compile", name, "-P", "2", "-M", "2"]) == 2
    assert capsys.readouterr().err == expected


def test_sched_needs_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _compile(tmp_path, monkeypatch, capsys, "phase a { repeat M { F B } }\n")
    assert code == 2
    assert err == "error: bad.sched: a .sched file needs -P/--ranks and -M/--microbatches\n"


def test_bad_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", "x.sched", "-P", "zero"])
    assert exit_info.value.code == 2
    assert "expected a positive integer, got 'zero'" in capsys.readouterr().err
