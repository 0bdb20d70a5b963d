"""passes/sum_shared.py: one all_reduce per set of ranks holding a parameter, at the end of
each holder, in one order; nothing for a program whose parameters each live on one rank."""

from __future__ import annotations

import pytest
from helpers import SCHEDULES, run_cli

from pipecc.api import compile_schedule
from pipecc.diagnostics import InputError
from pipecc.driver.compile import Lowering, place_again
from pipecc.interop import json_program
from pipecc.ir.ops import Collective, CollectiveKind
from pipecc.ir.placement import bidirectional_placement, loop_placement, vshape_placement
from pipecc.passes.insert_comms import strip_comms
from pipecc.passes.sum_shared import gradient_sums, sum_shared, summed_stages

AR = CollectiveKind.ALL_REDUCE


def _sum(ranks: tuple[int, ...], stages: str) -> Collective:
    return Collective(AR, ranks, f"grad-sum {stages}")


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_dualpipe_sums_each_mirrored_pair(ranks: int) -> None:
    """Stage s lives on ranks s and P-1-s: one sum per pair, naming both of its stages."""
    want = tuple(_sum((r, ranks - 1 - r), f"s{r}+s{ranks - 1 - r}") for r in range(ranks // 2))
    assert gradient_sums(bidirectional_placement(ranks)) == want


def test_a_tie_joins_the_groups_it_touches_transitively() -> None:
    """1F1B at P=4: 0+3 and 3+2 are one parameter group over ranks 0, 2, 3; 1 alone needs none."""
    placement = loop_placement(4, 1)
    assert gradient_sums(placement, ((0, 3), (2, 3))) == (_sum((0, 2, 3), "s0+s2+s3"),)
    assert gradient_sums(placement, ((0, 3), (1, 2))) == (
        _sum((0, 3), "s0+s3"),
        _sum((1, 2), "s1+s2"),
    )


def test_a_tie_on_one_rank_needs_no_sum() -> None:
    """The V shape puts the first and the last stage on rank 0."""
    assert gradient_sums(vshape_placement(2), ((0, 3),)) == ()
    assert gradient_sums(loop_placement(2, 2), ((0, 2),)) == ()  # interleaved: rank 0 twice


def test_dualpipe_and_a_tie_over_the_same_holders_share_one_sum() -> None:
    """At P=2 every stage is on both ranks: a tie adds nothing but its name."""
    assert gradient_sums(bidirectional_placement(2), ((0, 1),)) == (_sum((0, 1), "s0+s1"),)


@pytest.mark.parametrize("name", sorted(p.stem for p in SCHEDULES.glob("*.sched")))
def test_a_program_without_shared_stages_is_unchanged(name: str) -> None:
    program = compile_schedule(name, ranks=4, microbatches=8)
    if program.placement.num_pipes > 1:
        pytest.skip("two pipes: every stage lives twice")
    assert sum_shared(program) is program
    assert not any(type(i) is Collective for instrs in program.ranks for i in instrs)


def test_the_pass_is_idempotent_and_keeps_what_it_placed() -> None:
    program = compile_schedule("1f1b", ranks=4, microbatches=8)
    once = sum_shared(program, shared=((0, 3),))
    assert sum_shared(once) == once == sum_shared(once, shared=((0, 3),))
    assert summed_stages(once) == ((0, 3),)
    both = sum_shared(once, shared=((1, 2),))
    assert summed_stages(both) == ((0, 3), (1, 2))
    assert [i for i in both.ranks[1] if type(i) is Collective] == [_sum((1, 2), "s1+s2")]


def test_placing_the_comm_ops_again_keeps_the_sums() -> None:
    """A .json placed again with another policy keeps its sums (strip_comms drops them)."""
    program = sum_shared(compile_schedule("1f1b", ranks=4, microbatches=8), shared=((0, 3),))
    assert summed_stages(strip_comms(program)) == ()
    again = place_again(program, Lowering(policy="early-recv"))
    assert again.comm == "early-recv" and summed_stages(again) == ((0, 3),)
    assert again.ranks[0][-1] == _sum((0, 3), "s0+s3")


def test_a_stage_outside_the_program_is_refused() -> None:
    with pytest.raises(InputError, match=r"--shared 0\+9: stage 9 is not a stage of the program"):
        sum_shared(compile_schedule("1f1b", ranks=4, microbatches=4), shared=((0, 9),))


def test_compile_shared_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "compile", "1f1b", "-P", "4", "-M", "4", "--shared", "0+3")
    assert code == 0
    program = json_program.loads(out)
    assert [instrs[-1] for instrs in program.ranks if type(instrs[-1]) is Collective] == [
        _sum((0, 3), "s0+s3")
    ] * 2
    with pytest.raises(SystemExit) as exit_info:  # argparse's own exit, code 2
        run_cli(capsys, "compile", "1f1b", "-P", "4", "-M", "4", "--shared", "0+x")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shared: shared must be groups of stage numbers like 0+7" in err
    code, _, err = run_cli(
        capsys, "compile", "1f1b", "-P", "4", "-M", "4", "--shared", "0+3", "--format", "torch-csv"
    )
    assert code == 2
    assert err.startswith(
        "error: torch.distributed.pipelining's action format has no collective: rank 0 "
    )
