"""The DSL's constructs, each checked on the compute order it produces."""

from __future__ import annotations

import pytest
from helpers import compute_order

from pipecc.api import compile_source
from pipecc.diagnostics import ScheduleError
from pipecc.ir.ops import Fused, Kind


def _order(text: str, ranks: int = 2, microbatches: int = 2, **defines: int) -> list[list[str]]:
    program = compile_source(
        text, "t.sched", ranks=ranks, microbatches=microbatches, defines=defines
    )
    return [[_label(op) for op in row] for row in compute_order(program)]


def _label(op: tuple) -> str:  # type: ignore[type-arg]
    if op[0] == "OVERLAP":
        return f"{_label(op[1])}&{_label(op[2])}"
    kind, stage, mb = op
    return f"{kind}{stage}.{mb}"


def test_loops_if_and_let() -> None:
    text = """
    let warm = P - 1 - rank            # per-rank values
    phase warmup { repeat warm { F } }
    phase steady {
      for i in 0 .. M - warm {
        if i % 2 == 0 { F B } elif i == 1 { F B } else { F B }
      }
    }
    phase cooldown { repeat warm { B } }
    """
    assert _order(text, ranks=2, microbatches=3) == [
        ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "B0.2"],
        ["F1.0", "B1.0", "F1.1", "B1.1", "F1.2", "B1.2"],
    ]


def test_arithmetic_and_conditional_expressions() -> None:
    text = """
    let a = max(1, 2, 3) - min(4, 5) + abs(0 - 2)      # 3 - 4 + 2 = 1
    let b = (7 // 2) * 10 + 7 % 3 - 6 / 3              # 30 + 1 - 2 = 29
    let c = if a == 1 and not (b != 29) or false then M else 0
    phase p { repeat c { F } repeat c { B } }
    """
    assert _order(text, ranks=1, microbatches=2) == [["F0.0", "F0.1", "B0.0", "B0.1"]]


def test_explicit_microbatches_and_reverse_order() -> None:
    text = "phase p { repeat M { F } for i in 0 .. M { B[M - 1 - i] } }"
    assert _order(text, ranks=1, microbatches=3) == [
        ["F0.0", "F0.1", "F0.2", "B0.2", "B0.1", "B0.0"]
    ]


def test_plain_w_is_rank_fifo_and_chunk_w_is_chunk_fifo() -> None:
    text = """
    placement vshape
    phase p {
      repeat M { F0 F1 }
      repeat M { I1 I0 }
      W1 W W W
    }
    """
    program = compile_source(text, "t.sched", ranks=1, microbatches=2)
    weights = [(op.chunk, op.mb) for op in program.ranks[0] if getattr(op, "kind", None) is Kind.W]
    # W1 takes chunk 1's oldest I (1, 0); plain W then takes the rank's oldest left: (0, 0),
    # then (1, 1), then (0, 1).
    assert weights == [(1, 0), (0, 0), (1, 1), (0, 1)]


def test_computed_chunk_and_parameters() -> None:
    text = """
    param V = 2
    placement loop(V)
    phase p {
      for k in 0 .. V * M { F(k // M) }
      for k in 0 .. V * M { B(V - 1 - k // M) }
    }
    """
    order = _order(text, ranks=2, microbatches=2, V=3)
    assert order[0][:6] == ["F0.0", "F0.1", "F2.0", "F2.1", "F4.0", "F4.1"]
    assert order[1][6:] == ["B5.0", "B5.1", "B3.0", "B3.1", "B1.0", "B1.1"]


def test_fused_ops_are_one_instruction() -> None:
    text = "placement vshape\nphase p { F0 F1 F0 F1&B1 B1 B0 B0 }"
    program = compile_source(text, "t.sched", ranks=1, microbatches=2)
    fused = [op for op in program.ranks[0] if isinstance(op, Fused)]
    assert len(fused) == 1
    assert fused[0].label() == "F1.1&B1.0"


def test_pad_drops_surplus_microbatches() -> None:
    text = """
    let N = max(M, 3)
    pad microbatches to N
    phase p { repeat N { F } repeat N { I } repeat N { W } }
    """
    assert _order(text, ranks=1, microbatches=2) == [
        ["F0.0", "F0.1", "I0.0", "I0.1", "W0.0", "W0.1"]
    ]


def test_placement_table() -> None:
    text = """
    placement {
      chunk 0: stage rank
      chunk 1: pipe 0, stage 2 * P - 1 - rank
    }
    phase p { repeat M { F0 } repeat M { F1 } repeat M { B1 } repeat M { B0 } }
    """
    program = compile_source(text, "t.sched", ranks=2, microbatches=1)
    assert [(s.rank, s.chunk, s.pipe, s.stage) for s in program.placement.slots] == [
        (0, 0, 0, 0),
        (0, 1, 0, 3),
        (1, 0, 0, 1),
        (1, 1, 0, 2),
    ]


def test_placement_table_must_be_a_bijection() -> None:
    text = "placement { chunk 0: stage 0 }\nphase p { F B }"
    with pytest.raises(ScheduleError, match="stage 0 of pipe 0 is placed twice"):
        compile_source(text, "t.sched", ranks=2, microbatches=1)


def test_bidirectional_microbatch_ranges() -> None:
    text = (
        "placement bidirectional\nphase p { repeat M / 2 { F0 } repeat M / 2 { F1 } "
        "repeat M / 2 { B1 } repeat M / 2 { B0 } }"
    )
    program = compile_source(text, "t.sched", ranks=2, microbatches=4)
    rank1 = [op.label() for op in program.ranks[1] if hasattr(op, "kind")]
    # rank 1 lies in the first half of pipe 1 (microbatches 2, 3): that is its chunk 0
    assert rank1[:4] == ["F0.2", "F0.3", "F1.0", "F1.1"]


def test_let_cannot_redefine() -> None:
    with pytest.raises(ScheduleError, match="'P' is already defined"):
        compile_source("let P = 3\nphase p { F B }", "t.sched", ranks=1, microbatches=1)


def test_op_letters_are_reserved() -> None:
    with pytest.raises(ScheduleError, match="'W' is an op and cannot name a value"):
        compile_source("param W = 3\nphase p { F B }", "t.sched", ranks=1, microbatches=1)
