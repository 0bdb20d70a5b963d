"""The verifier on a whole mesh (docs/parallelism.md): collectives issued in different orders
by the members of two sets deadlock, with the cycle as witness; so does a cycle through a
collective and a receive; members that disagree on a collective are a mismatch naming both; a
collective a member never reaches is an orphan; a collective ahead of a send on nccl-single's
one stream holds the send. Each message is compared whole with expected/mesh-<case>.txt
(regenerate with PIPECC_UPDATE_GOLDENS=1, then review the diff)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import compile_bundled, run_cli
from programs import codes, move, rendered, report, with_rank

from pipecc.driver.mesh import MeshOptions, place_mesh
from pipecc.interop import json_program
from pipecc.ir.ops import Collective, CollectiveKind, Instr, Msg, Recv, Send, Wait
from pipecc.ir.program import Program
from pipecc.passes.expand_mesh import expand_mesh
from pipecc.passes.splice import splice
from pipecc.passes.sum_shared import sum_shared
from pipecc.semantics import CommModel
from pipecc.verify import ALL_MODELS

EXPECTED = Path(__file__).resolve().parent / "expected"


def _golden(case: str, text: str) -> None:
    path = EXPECTED / f"mesh-{case}.txt"
    if os.environ.get("PIPECC_UPDATE_GOLDENS"):
        path.write_text(text + "\n", encoding="utf-8")
    assert text + "\n" == path.read_text(encoding="utf-8")


def _tied_replicas() -> Program:
    """1F1B, P=2, M=2, a tied embedding (stages 0 and 1), two data-parallel replicas, written
    out for the 4 ranks: pipeline 0 on ranks 0 and 2, pipeline 1 on ranks 1 and 3."""
    base = sum_shared(compile_bundled("1f1b", 2, 2), shared=((0, 1),))
    return expand_mesh(place_mesh(base, MeshOptions("dp_replicate=2")))


def _is_dp(x: Instr) -> bool:
    return type(x) is Collective and x.what.startswith("dp-grad")


def _blocking_at_end(program: Program, sum_first: set[int]) -> Program:
    """Each rank's data-parallel reduction made blocking and put after its gradient sum on
    the ranks of `sum_first`, before it on the others."""
    ranks = []
    for rank, instrs in enumerate(program.ranks):
        (dp,) = [x._replace(asynchronous=False) for x in instrs if _is_dp(x)]
        (tied,) = [x for x in instrs if type(x) is Collective and not _is_dp(x)]
        bare = splice(instrs, drop=lambda x: type(x) is Collective)
        ranks.append((*bare, *((tied, dp) if rank in sum_first else (dp, tied))))
    return Program(**{**_fields(program), "ranks": tuple(ranks)})


def _fields(program: Program) -> dict[str, object]:
    return {f: getattr(program, f) for f in Program.__dataclass_fields__}


def test_the_compiled_mesh_program_passes_every_model() -> None:
    assert report(_tied_replicas(), models=ALL_MODELS).ok
    assert report(_blocking_at_end(_tied_replicas(), sum_first=set()), models=ALL_MODELS).ok


def test_collectives_in_opposite_orders_deadlock_with_the_cycle() -> None:
    """Replicas 0 and 1 sum the tied embedding and reduce over the replicas in opposite orders
    on two ranks: ranks 0 → 1 → 3 → 2 → 0, each in a collective its next has not reached."""
    stuck = _blocking_at_end(_tied_replicas(), sum_first={1, 2})
    result = report(stuck, models=ALL_MODELS)
    assert codes(result) == ["deadlock"]
    _golden("collective-order", rendered(result.violations[0]))


def test_a_cycle_through_a_collective_and_a_receive_is_a_deadlock() -> None:
    """Rank 2 enters the tied sum before it sends rank 0 its last gradient; rank 0 needs that
    gradient before it reaches the sum."""
    program = _tied_replicas()
    last = len(program.ranks[2]) - 1
    at = next(i for i, x in enumerate(program.ranks[2]) if type(x) is Send and x.mb == 1)
    result = report(move(program, 2, last, at), models=ALL_MODELS)
    assert codes(result) == ["deadlock"]
    _golden("collective-recv", rendered(result.violations[0]))


def test_replicas_reducing_stages_in_another_order_are_a_mismatch() -> None:
    """Interleaved 1F1B holds stages 0 and 2 on rank 0: one replica reduces them in the other
    order, so the first reduction of one meets the first of the other with another stage."""
    base = compile_bundled("interleaved_1f1b", 2, 4)
    whole = expand_mesh(place_mesh(base, MeshOptions("dp_replicate=2")))
    instrs = whole.ranks[1]
    a, b = (i for i, x in enumerate(instrs) if _is_dp(x))
    swapped = list(instrs)
    swapped[a], swapped[b] = instrs[b], instrs[a]
    result = report(with_rank(whole, 1, tuple(swapped)))
    assert codes(result) == ["mismatch"]
    _golden("mismatch", rendered(result.violations[0]))


def test_a_collective_of_another_kind_is_a_mismatch() -> None:
    whole = _tied_replicas()
    at = next(i for i, x in enumerate(whole.ranks[3]) if _is_dp(x))
    instrs = list(whole.ranks[3])
    instrs[at] = instrs[at]._replace(kind=CollectiveKind.REDUCE_SCATTER)
    result = report(with_rank(whole, 3, tuple(instrs)))
    assert codes(result) == ["mismatch"]
    message = result.violations[0].message
    assert "all_reduce dp-grad s1 over ranks 2, 3 [async] on rank 2 (@10)" in message
    assert "reduce_scatter dp-grad s1 over ranks 2, 3 [async] on rank 3 (@10)" in message


def test_a_collective_a_member_never_reaches_is_an_orphan() -> None:
    whole = _tied_replicas()
    instrs = splice(whole.ranks[1], drop=_is_dp)
    result = report(with_rank(whole, 1, instrs), models=ALL_MODELS)
    assert codes(result)[0] == "orphan"
    _golden("orphan", rendered(result.violations[0]))


def _stream_case() -> Program:
    """Rank 0 posts its reduction, then sends to rank 2; rank 1 reaches the reduction only
    after rank 3 hears from rank 2, which waits for rank 0's message."""
    whole = _tied_replicas()
    dp0 = Collective(CollectiveKind.ALL_REDUCE, (0, 1), "dp-grad s0", True, (), (0,))
    dp1 = dp0._replace(ranks=(2, 3), what="dp-grad s1", asynchronous=False)
    ranks = (
        (dp0, Send(Msg.ACT, 2, 0, 1, 0), Wait((1,)), Wait((0,))),
        (Recv(Msg.ACT, 3, 1, 1, 2), Wait((0,)), dp0._replace(asynchronous=False)),
        (Recv(Msg.ACT, 0, 0, 1, 0), Wait((0,)), dp1),
        (dp1, Send(Msg.ACT, 1, 1, 1, 2), Wait((1,))),
    )
    return Program(**{**_fields(whole), "ranks": ranks})


def test_nccl_single_holds_a_send_behind_a_collective() -> None:
    program = _stream_case()
    for model in (CommModel.NCCL, CommModel.RENDEZVOUS):
        assert "deadlock" not in codes(report(program, models=(model,)))
    result = report(program, models=(CommModel.NCCL_SINGLE,))
    assert "deadlock" in codes(result)
    deadlock = next(v for v in result.violations if v.code == "deadlock")
    _golden("nccl-single", rendered(deadlock))


def test_verify_reads_a_whole_mesh_program(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stuck = _blocking_at_end(_tied_replicas(), sum_first={1, 2})
    path = tmp_path / "mesh.json"
    path.write_text(json_program.dumps(stuck))
    assert json.loads(path.read_text())["mesh"] == {"pp": 2, "dp_replicate": 2}
    code, out, _ = run_cli(capsys, "verify", str(path), "--comm", "all")
    assert code == 1
    assert "ranks 0 → 1 → 3 → 2 → 0 wait for each other in a cycle" in out
    path.write_text(json_program.dumps(_tied_replicas()))
    code, out, _ = run_cli(capsys, "verify", str(path), "--comm", "all")
    assert code == 0, out
    assert "on 4 ranks" in out
