"""The simulator on MoE programs (issue 33 part 5, docs/simulate.md): phases take their share
of the op (`moe_experts`), each all-to-all its `a2a`; per rank the all-to-all time left
exposed, overlapped against sequential, in closed form."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from helpers import compile_bundled, run_cli

from pipecc.driver.mesh import MeshOptions, MoeOptions, place_mesh, place_moe, whole_mesh
from pipecc.ir.mesh import Mesh
from pipecc.ir.ops import Compute, Fused, Kind
from pipecc.ir.program import Program
from pipecc.passes.expand_moe import expand_moe
from pipecc.semantics.costs import parse_cost_flag
from pipecc.simulate.timeline import simulate


def _one_rank(overlap: bool) -> Program:
    """F0.0, F0.1&B0.0, B0.1 on one pipeline rank of one MoE layer, over ep=2."""
    f = [Compute(Kind.F, 0, 0, 0, mb) for mb in range(2)]
    b = [Compute(Kind.B, 0, 0, 0, mb) for mb in range(2)]
    base = compile_bundled("1f1b", 1, 2)
    program = replace(base, ranks=((f[0], Fused(f[1], b[0]), b[1]),), mesh=Mesh(pp=1, ep=2))
    return whole_mesh(expand_moe(program, (1,), overlap=overlap))[0]


# F=2: pre0 0.5, experts0 1, post 0.5; B=4: post 1, experts0 2, pre0 1 (moe_experts 0.5)
@pytest.mark.parametrize(
    ("a2a", "overlapped", "sequential"),
    [
        # each a2a of the fused op shorter than the phase it hides behind (at least 0.5):
        # only the plain F0.0's and B0.1's four blocking ones are exposed
        (0.4, 4 * 0.4, 8 * 0.4),
        # B's combine-grad (0.7) outlasts F's pre0 (0.5) by 0.2; the others hide
        (0.7, 4 * 0.7 + 0.2, 8 * 0.7),
    ],
)
def test_exposed_all_to_all_time_in_closed_form(
    a2a: float, overlapped: float, sequential: float
) -> None:
    costs = parse_cost_flag(f"F=2,B=4,a2a={a2a}")
    on = simulate(_one_rank(True), costs)
    off = simulate(_one_rank(False), costs)
    assert [r.a2a_exposed for r in on.ranks] == [pytest.approx(overlapped)] * 2
    assert [r.a2a_exposed for r in off.ranks] == [pytest.approx(sequential)] * 2
    assert off.makespan == pytest.approx(12 + sequential)  # compute 2+2+4+4, every a2a waited
    assert on.makespan == pytest.approx(12 + overlapped)


def test_the_fused_ops_all_to_alls_are_hidden_entirely() -> None:
    """The fused op alone: every a2a shorter than its hiding phase leaves nothing exposed."""
    f, b = Compute(Kind.F, 0, 0, 0, 1), Compute(Kind.B, 0, 0, 0, 0)
    base = compile_bundled("1f1b", 1, 2)
    program = replace(base, ranks=((Fused(f, b),),), mesh=Mesh(pp=1, ep=2))
    costs = parse_cost_flag("F=2,B=4,a2a=0.5")
    on = simulate(whole_mesh(expand_moe(program, (1,)))[0], costs)
    off = simulate(whole_mesh(expand_moe(program, (1,), overlap=False))[0], costs)
    assert [r.a2a_exposed for r in on.ranks] == [0.0, 0.0]
    assert on.makespan == pytest.approx(6)
    assert [r.a2a_exposed for r in off.ranks] == [pytest.approx(2.0)] * 2


def test_simulate_prints_both_steps_and_the_exposed_time_per_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ("-P", "2", "-M", "8", "--mesh", "pp=2,ep=2", "--moe", "2")
    code, text, err = run_cli(capsys, "simulate", "dualpipev", *flags, "--cost", "F=2,B=4,a2a=0.2")
    assert code == 0, err
    lines = text.splitlines()
    at = lines.index("rank  exposed a2a overlapped  sequential")
    assert (
        lines[at - 1]
        == "moe: step overlapped 59.6, sequential 78 (--moe-overlap on is the one shown)"
    )
    # sequential: each of a pipeline rank's 128 all-to-alls waited in full, 128 × 0.2
    assert [line.split()[-1] for line in lines[at + 1 : at + 5]] == ["25.6"] * 4


def test_a_moe_program_as_given_shows_its_exposed_time(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "moe.json"
    flags = ("-P", "2", "-M", "2", "--mesh", "pp=2,ep=2", "--moe", "1", "--moe-overlap", "off")
    assert run_cli(capsys, "compile", "1f1b", *flags, "--expand", "-o", str(out))[0] == 0
    code, text, err = run_cli(capsys, "simulate", str(out), "--cost", "a2a=0.5")
    assert code == 0, err
    # 1F1B on P=2: each pipeline rank runs 2 forwards and 2 backwards, 2 all-to-alls each
    line = "exposed a2a (blocked on all-to-alls): rank 0 4, rank 1 4, rank 2 4, rank 3 4"
    assert line in text.splitlines()


def test_phases_keep_the_peak_bytes_of_their_ops() -> None:
    """A forward's activations count from its first phase, a backward frees them at its
    last: between, nothing changes, so the peak is the unsplit program's."""
    options = MeshOptions("pp=2,ep=2")
    plain = whole_mesh(place_mesh(compile_bundled("zbv", 2, 4), options))[0]
    moe = MeshOptions("pp=2,ep=2", moe=MoeOptions(2))
    split = whole_mesh(place_moe(place_mesh(compile_bundled("zbv", 2, 4), moe), moe))[0]
    costs = parse_cost_flag("act_bytes=10,act_bytes_w=4,param_bytes=100,grad_bytes=100")
    peaks = [[r.peak_bytes for r in simulate(p, costs).ranks] for p in (plain, split)]
    assert peaks[0] == peaks[1] and peaks[0][0] is not None
