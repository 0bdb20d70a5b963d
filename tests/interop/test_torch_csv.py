"""torch action CSV export: the cells torch itself prints, and torch parses them back."""

from __future__ import annotations

import csv
import io

import pytest
from helpers import compile_bundled, compute_order

from pipecc.diagnostics import InputError
from pipecc.interop import torch_csv

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def test_compute_only_cells() -> None:
    text = torch_csv.dumps(compile_bundled("zb_h1", 2, 2))
    assert text == "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n"


def test_fused_cells_use_torch_overlap_syntax() -> None:
    rank0 = torch_csv.dumps(compile_bundled("dualpipev", 2, 4)).splitlines()[0].split(",")
    assert rank0[7:10] == ["(0F3;3B1)OVERLAP_F_B", "(3F2;0B0)OVERLAP_F_B", "3B2"]


@pytest.mark.parametrize(
    ("schedule", "ranks", "microbatches"),
    [("dualpipev", 3, 6), ("zbv", 2, 3), ("interleaved_zb", 2, 4)],
)
def test_torch_parses_what_we_write(schedule: str, ranks: int, microbatches: int) -> None:
    program = compile_bundled(schedule, ranks, microbatches)
    rows = list(csv.reader(io.StringIO(torch_csv.dumps(program))))
    parsed = [[schedules._Action.from_str(cell) for cell in row] for row in rows]
    order = [[_normalise(action) for action in row] for row in parsed]
    assert order == compute_order(program)


def _normalise(action):  # type: ignore[no-untyped-def]
    if action.sub_actions is not None:
        forward, backward = (_normalise(a) for a in action.sub_actions)
        return ("OVERLAP", forward, backward)
    return (action.computation_type.value, action.stage_index, action.microbatch_index)


def test_comms_cells_name_sending_and_receiving_stage() -> None:
    rows = list(
        csv.reader(io.StringIO(torch_csv.dumps(compile_bundled("1f1b", 2, 1), with_comms=True)))
    )
    assert rows == [
        ["0UNSHARD", "0F0", "0SEND_F0", "0RECV_B0", "0B0", "0REDUCE_GRAD", "0RESHARD"],
        ["1RECV_F0", "1UNSHARD", "1F0", "1B0", "1SEND_B0", "1REDUCE_GRAD", "1RESHARD"],
    ]


def test_two_pipes_cannot_be_written() -> None:
    with pytest.raises(InputError, match="cannot express placement 'bidirectional'"):
        torch_csv.dumps(compile_bundled("dualpipe", 2, 4))
