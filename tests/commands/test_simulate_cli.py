"""`pipecc simulate`, `compare` and `explain` as a user runs them; the renderers."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers import run_cli

from pipecc.api import compile_schedule
from pipecc.cli import main


def test_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "simulate", "1f1b", "-P", "4", "-M", "8", "--cost", "F=1,B=2", "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert data["makespan"] == 33
    assert data["bubble_ratio"] == pytest.approx(1 - 4 * 24 / (4 * 33))
    rank = data["ranks"][0]
    assert set(rank) >= {"busy", "idle", "internal_idle", "peak_activations", "peak_at", "stalls"}
    assert rank["peak_activations"] == 4
    assert rank["stalls"][0] == {
        "index": 10,
        "since": 4.0,
        "length": 6.0,
        "released_by": 8,
        "message": "recv grad stage 0 mb 0 from rank 1",
    }
    ops = data["ops"]
    assert ops[0] == {"rank": 0, "index": 0, "op": "F0.0", "start": 0.0, "end": 1.0}
    # one entry per instruction of the program (211 for 1F1B at P=4, M=8), each once
    program = compile_schedule("1f1b", ranks=4, microbatches=8)
    assert len(ops) == program.num_instructions() == 211
    assert {(op["rank"], op["index"]) for op in ops} == {
        (rank, index) for rank, instrs in enumerate(program.ranks) for index in range(len(instrs))
    }


def test_text_output_has_summary_and_grid(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "simulate", "zb_h1", "-P", "4", "-M", "8", "--cost", "F=1,I=1,W=1"
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[1] == "makespan 27   bubble ratio 0.1111   span bubble ratio 0.1111 (rank 0)"
    assert lines[3].split()[:5] == ["0", "24", "3", "3", "4"]
    assert lines[7] == (
        "peak act: in stage units (one stage's activations for one microbatch; a stage of "
        "this program is 1 share of the model)"
    )
    grid = [line for line in lines if line.startswith("rank ") and "|" in line]
    assert len(grid) == 4  # 4 columns per op: too few for `F0.0|`, so the kind alone
    assert grid[3].startswith("rank 3 | ............F  |I  |F  |I  |")


def test_timeline_labels_are_the_languages_op_names(capsys: pytest.CaptureFixture[str]) -> None:
    # chunk and microbatch both (`F1.2`), never `F2`, which the language reads as chunk 2
    code, out, _ = run_cli(
        capsys, "simulate", "zbv", "-P", "2", "-M", "4", "--cost", "F=1,I=1,W=1", "--width", "200"
    )
    assert code == 0
    grid = [line for line in out.splitlines() if line.startswith("rank ") and "|" in line]
    assert grid == [
        "rank 0 | F0.0 |F0.1 |F0.2 |F1.0 |I1.0 |W1.0 |F1.1 |I1.1 |W1.1 |F0.3 |I0.0 |W0.0 |"
        "F1.2 |I1.2 |W1.2 |I0.1 |W0.1 |F1.3 |I1.3 |W1.3 |I0.2 |W0.2 |I0.3 |W0.3 |",
        "rank 1 | ......F0.0 |F1.0 |F0.1 |F1.1 |I1.0 |W1.0 |F0.2 |I0.0 |W0.0 |F1.2 |I1.1 |W1.1 |"
        "F0.3 |I0.1 |W0.1 |F1.3 |I1.2 |W1.2 |I0.2 |I1.3 |I0.3 |W0.2 |W1.3 |W0.3 |",
    ]


def test_svg_is_well_formed_with_a_box_per_computation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    svg = tmp_path / "out.svg"
    code, _, _ = run_cli(
        capsys,
        "simulate",
        "dualpipe",
        "-P",
        "4",
        "-M",
        "8",
        "--cost",
        "F=1,B=2,I=1,W=1,FB=2.6,comm=0.1",
        "--svg",
        str(svg),
        "--arrows",
    )
    assert code == 0
    root = ET.parse(svg).getroot()
    boxes = [g for g in root.iter("{http://www.w3.org/2000/svg}g")]
    # one box per computation: 8 microbatches × 2 stages per rank × (F + backward) + W's
    assert len(boxes) > 4 * 8 * 2
    lines = list(root.iter("{http://www.w3.org/2000/svg}line"))
    assert len(lines) > 40  # message arrows and axis ticks


def test_perfetto_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.json"
    code, _, _ = run_cli(capsys, "simulate", "1f1b", "-P", "2", "-M", "2", "--trace", str(trace))
    assert code == 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    starts = [e for e in events if e["ph"] == "s"]
    ends = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(ends) == 4  # 2 activations and 2 gradients
    assert {e["id"] for e in starts} == {e["id"] for e in ends}


def test_png_without_matplotlib_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        code, _, err = run_cli(
            capsys, "simulate", "1f1b", "-P", "2", "-M", "2", "--png", str(tmp_path / "x.png")
        )
        assert code == 2
        assert "PNG output needs matplotlib" in err
    else:
        code, _, _ = run_cli(
            capsys, "simulate", "1f1b", "-P", "2", "-M", "2", "--png", str(tmp_path / "x.png")
        )
        assert code == 0 and (tmp_path / "x.png").stat().st_size > 0


def test_cost_file_and_flag_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text('[cost]\nF = 2.0\nB = 4.0\nunit = "ms"\n[cost.stage.0]\nF = 3.0\n')
    code, out, _ = run_cli(
        capsys,
        "simulate",
        "1f1b",
        "-P",
        "2",
        "-M",
        "1",
        "--cost-file",
        str(costs),
        "--cost",
        "B=2",
        "--json",
    )
    assert code == 0
    # stage 0: F=3, B=2; stage 1: F=2, B=2 → 3 + 2 + 2 + 2
    assert json.loads(out)["makespan"] == 9


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--cost", "F=1,Q=2"), "error: --cost: unknown cost key 'Q'"),
        (("--cost", "F=-1"), "error: --cost: F must be a finite number ≥ 0, got -1.0"),
        (("--cost", "F"), "error: --cost: expected KEY=VALUE, got 'F'"),
        (("--cost-file", "missing.toml"), "error: missing.toml: no such file"),
    ],
)
def test_bad_costs_exit_2(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "simulate", "1f1b", "-P", "2", "-M", "2", *argv)
    assert code == 2
    assert err.startswith(message)


def test_compare_sorts_and_skips(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        "compare",
        "1f1b",
        "zb_h1",
        "zb_h2",
        "dualpipe",
        "-P",
        "4",
        "-M",
        "6",
        "--cost",
        "F=1,B=2,I=1,W=1",
    )
    assert code == 0
    rows = out.splitlines()[2:]
    assert [row.split()[0] for row in rows] == ["zb_h1", "1f1b", "dualpipe", "zb_h2"]
    assert rows[-2:] == [
        "dualpipe           skipped: requires M >= 2 * P, got M=6, P=4",
        "zb_h2              skipped: requires M >= 2 * P - 1, got M=6, P=4",
    ]


def test_explain_walks_back_to_time_zero(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys,
        "explain",
        "dualpipe",
        "-P",
        "8",
        "-M",
        "20",
        "--cost",
        "F=1,B=3,I=2,W=1",
        "--op",
        "4:39",
        "--json",
    )
    assert code == 0
    links = json.loads(out)
    assert links[0]["reason"].startswith("B1.0: needs the data of [33] recv grad pipe 0 stage 4")
    assert links[0]["time"] == 14
    assert links[-1]["time"] == 0 and "the first instruction of rank" in links[-1]["reason"]
    times = [link["time"] for link in links]
    assert times == sorted(times, reverse=True)


def test_explain_rejects_unknown_instruction(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "explain", "1f1b", "-P", "2", "-M", "2", "--op", "5:0")
    assert code == 2
    assert err == "error: --op 5:0: the program has ranks 0..1\n"


def test_compare_skips_only_unmet_requirements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.sched"
    broken.write_text("schedule broken\nphase a { repeat M { F } }\n")  # no backward at all
    code, out, err = run_cli(capsys, "compare", "1f1b", str(broken), "-P", "2", "-M", "2")
    assert (code, out) == (2, "")
    assert err == (
        "error: rank 0 chunk 0 (stage 0 of pipe 0) has no backward (B or I) for microbatch 0\n"
    )


def test_a_zero_width_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's own exit, as for every bad flag
        main(["simulate", "1f1b", "-P", "2", "-M", "2", "--width", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith(
        "pipecc simulate: error: argument --width: expected a positive integer, got 0\n"
    )
