"""`--mesh`, `--fsdp`, `--max-active-stages`, `--prefetch` on compile, verify and simulate
(docs/parallelism.md): one resolution, the same program in each; bad flags exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli

from pipecc.interop import json_program


def test_compile_writes_the_pipelines_program_with_its_mesh(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "mesh.json"
    flags = (
        "-P",
        "2",
        "-M",
        "4",
        "--mesh",
        "dp_shard=2,dp_replicate=2",
        "--max-active-stages",
        "1",
    )
    code, _, err = run_cli(capsys, "compile", "zbv", *flags, "-o", str(out))
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["ranks"] == 2 and data["mesh"] == {"pp": 2, "dp_replicate": 2, "dp_shard": 2}
    ops = [e["op"] for e in data["programs"][0]]
    assert ops.count("UNSHARD") > 2  # two stages, one resident: fetched again
    assert ops.count("REDUCE_GRAD") == 2 and ops.count("collective") == 2
    # verify and simulate replay the same program as the whole mesh, from the .json too
    code, text, _ = run_cli(capsys, "verify", str(out), "--comm", "all")
    assert code == 0 and "on 8 ranks" in text
    code, text, _ = run_cli(capsys, "verify", "zbv", *flags, "--comm", "all")
    assert code == 0 and "on 8 ranks" in text
    program = json_program.loads(out.read_text())
    assert program.mesh is not None and program.mesh.world == 8


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--mesh", "dp=2"), "expected DIM=SIZE with DIM one of pp, dp_replicate"),
        (("--mesh", "tp=0"), "tp must be a positive integer"),
        (("--mesh", "pp=4,tp=2"), "pp=4 but the program has P=2 ranks"),
        (("--max-active-stages", "2"), "give --fsdp or a mesh with dp_shard > 1"),
        (("--fsdp", "--prefetch", "-1"), "expected an integer ≥ 0"),
    ],
)
def test_bad_mesh_flags_exit_2(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    try:
        code, _, err = run_cli(capsys, "compile", "1f1b", "-P", "2", "-M", "2", *flags)
    except SystemExit as exc:  # argparse's own exit, as for every bad flag
        code, err = int(str(exc.code)), capsys.readouterr().err
    assert code == 2
    assert message in err


def test_run_refuses_a_program_for_several_pipelines(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "mesh.json"
    run_cli(
        capsys, "compile", "1f1b", "-P", "2", "-M", "2", "--mesh", "dp_replicate=2", "-o", str(out)
    )
    pytest.importorskip("torch")
    model = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
    code, _, err = run_cli(capsys, "run", str(out), "--nproc", "2", "--model", model)
    assert code == 2
    assert "the program is for the mesh pp=2,dp_replicate=2" in err
