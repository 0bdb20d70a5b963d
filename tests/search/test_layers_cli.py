"""`pipecc search --layers`: the report, the written program, .sched and cut file, and bad
input (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipecc.cli import main
from pipecc.search.layers import load_cut, load_layers

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "gpt_layers.toml")


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_written_files_are_the_reported_result(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "best.json"
    cut_file, sched = tmp_path / "cut.toml", tmp_path / "best.sched"
    files = ["-o", str(out), "--sched", str(sched), "--partition", str(cut_file)]
    cap = ["--memory-budget", "2GiB"]
    code, text, _ = _run(capsys, "search", "-P", "2", "-M", "4", "--layers", EXAMPLE, *cap,
                         "--placement", "auto", "--json", *files)  # fmt: skip
    assert code == 0
    report = json.loads(text)
    assert {"makespan", "lower_bound", "peak", "cut", "uniform", "any_cut_bound"} <= set(report)
    assert max(report["peak"]) <= 2 * 2**30
    assert report["any_cut_bound"] <= report["makespan"]
    cut, names = load_cut(cut_file, load_layers(EXAMPLE).names)
    assert [s["layers"] for s in report["cut"]] == [
        list(names[cut.starts[s] : cut.starts[s] + n]) for s, n in enumerate(cut.counts())
    ]
    uniform = [u["makespan"] for u in report["uniform"] if u["makespan"] is not None]
    assert report["makespan"] <= min(uniform) + 1e-9
    assert main(["verify", str(out), "--comm", "all"]) == 0
    capsys.readouterr()
    costs = str(out.with_suffix(".costs.toml"))
    assert main(["simulate", str(out), "--cost-file", costs, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == pytest.approx(report["makespan"])
    assert main(["verify", str(sched), "-P", "2", "-M", "4", "--comm", "all"]) == 0


def test_the_table_names_the_cut_the_bounds_and_the_uniform_cuts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(capsys, "search", "-P", "2", "-M", "4", "--layers", EXAMPLE)
    assert code == 0
    for line in ("cut ", "stage 0", "step ", "lower bound", "(any cut)", "uniform cut",
                 "best uniform", "rank 1 |"):  # fmt: skip
        assert line in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cost", "F=1"], "--cost is for per-share costs"),
        (["--memory", "40GB"], "binary unit"),
        (["--objective", "span"], "--objective span is for per-share costs"),
        (["--memory", "1KiB"], "no cut fits --memory 1 KiB"),
    ],
)
def test_bad_layer_input(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, _, err = _run(capsys, "search", "-P", "2", "-M", "4", "--layers", EXAMPLE, *args)
    assert code == (1 if "no cut fits" in message else 2)
    assert message in err and "Traceback" not in err


def test_partition_needs_layers_and_a_cap_needs_sizes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = _run(capsys, "search", "-P", "2", "-M", "4", "--cost", "F=1,B=2",
                        "--memory", "2", "--partition", str(tmp_path / "c.toml"))  # fmt: skip
    assert code == 2 and "--partition writes the cut of a layer search" in err
    bare = tmp_path / "bare.toml"
    bare.write_text('[[layer]]\nname = "a"\nF = 1\nB = 2\n[[layer]]\nname = "b"\nF = 1\nB = 2\n')
    code, _, err = _run(capsys, "search", "-P", "2", "-M", "4", "--layers", str(bare),
                        "--memory", "1GiB")  # fmt: skip
    assert code == 2 and "gives no sizes" in err
    code, _, err = _run(capsys, "search", "-P", "4", "-M", "4", "--layers", str(bare))
    assert code == 1 and "2 layers cannot fill 4 stages" in err


def test_the_costs_file_names_the_cut_and_its_recomputation(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "best.json"
    files = ["-o", str(out), "--partition", str(tmp_path / "c.toml")]
    code, _, _ = _run(capsys, "search", "-P", "4", "-M", "8", "--layers", EXAMPLE,
                      "--memory", "400MiB", *files)  # fmt: skip
    assert code == 0
    cut, _ = load_cut(tmp_path / "c.toml")
    assert any(cut.recompute), "400 MiB needs recomputation (docs/search.md section 12)"
    text = out.with_suffix(".costs.toml").read_text()
    stages = ", ".join(str(s) for s, flag in enumerate(cut.recompute) if flag)
    assert f"# cut: {cut.describe()}" in text and f"# recomputed stages: {stages} " in text


def test_the_profiles_host_time_is_in_the_step_and_the_costs_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`post` and `wait` (a run's host time per send or receive and per wait) add to the
    reported step of the searched cut and of the uniform cuts, as `pipecc simulate` charges
    them; the written costs file carries them, so it reproduces the step."""
    text = Path(EXAMPLE).read_text()
    host = tmp_path / "host.toml"
    host.write_text(text.replace("comm = 0.05", "comm = 0.05\npost = 0.5\nwait = 0.25", 1))
    steps = []
    for layers in (EXAMPLE, str(host)):
        out = tmp_path / f"{Path(layers).stem}.json"
        code, found, _ = _run(capsys, "search", "-P", "2", "-M", "4", "--layers", layers,
                              "--placement", "loop", "--json", "-o", str(out))  # fmt: skip
        assert code == 0
        steps.append(json.loads(found))
        costs = str(out.with_suffix(".costs.toml"))
        assert main(["simulate", str(out), "--cost-file", costs, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["makespan"] == pytest.approx(
            steps[-1]["makespan"]
        )
    plain, charged = steps
    assert charged["makespan"] > plain["makespan"] + 1.0  # several posts on the critical path
    assert charged["uniform_best"]["makespan"] > plain["uniform_best"]["makespan"] + 1.0
    assert "post = 0.5" in (tmp_path / "host.costs.toml").read_text()


def test_the_written_program_names_the_stages_it_recomputes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Under a cap the plain cuts cannot use well the search recomputes; the program's JSON
    says which stages (its `recompute` field), as the cut file does."""
    out, cut_file = tmp_path / "best.json", tmp_path / "cut.toml"
    code, _, _ = _run(capsys, "search", "-P", "4", "-M", "8", "--layers", EXAMPLE, "--memory",
                      "400MiB", "--placement", "loop", "-o", str(out), "--partition",
                      str(cut_file))  # fmt: skip
    assert code == 0
    cut, _ = load_cut(cut_file)
    chosen = [s for s in range(cut.stages) if cut.recompute[s]]
    assert chosen, "the cap makes the search recompute"
    data = json.loads(out.read_text())
    assert data["recompute"] == [{"stage": s, "mode": "full"} for s in chosen]
    # the .sched says so too, and compile carries it into the program
    sched, compiled = tmp_path / "best.sched", tmp_path / "compiled.json"
    code, _, _ = _run(capsys, "search", "-P", "4", "-M", "8", "--layers", EXAMPLE, "--memory",
                      "400MiB", "--placement", "loop", "--sched", str(sched))  # fmt: skip
    assert code == 0
    assert f"recompute stage {', '.join(map(str, chosen))}" in sched.read_text()
    assert main(["compile", str(sched), "-P", "4", "-M", "8", "-o", str(compiled)]) == 0
    assert json.loads(compiled.read_text())["recompute"] == data["recompute"]
