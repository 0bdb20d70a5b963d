"""The simulator costs a mesh's collectives (docs/simulate.md): `collective` latency plus the
ring algorithm's traffic per rank over `bandwidth` (all_reduce 2(n-1)/n of the bytes,
all_gather and reduce_scatter (n-1)/n), the bytes being the param_bytes of the stages a
collective carries over its shards; checked against closed forms on 1F1B at P=2, M=1."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import run_cli

COST = "F=1,B=2,param_bytes=100,bandwidth=50,collective=0.5"


def _simulate(capsys: pytest.CaptureFixture[str], mesh: str, cost: str = COST) -> dict[str, Any]:
    code, out, err = run_cli(
        capsys, "simulate", "1f1b", "-P", "2", "-M", "1", "--mesh", mesh, "--cost", cost, "--json"
    )
    assert code == 0, err
    assert "replayed as the whole mesh" in err
    data: dict[str, Any] = json.loads(out)
    return data


def _ops(data: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    return [o for o in data["ops"] if o["rank"] == rank]


@pytest.mark.parametrize(
    ("mesh", "makespan"),
    [
        # F 0-1 on rank 0, 1-2 on rank 1, B 2-4 on rank 1, 4-6 on rank 0; then rank 0's
        # all_reduce over 2 replicas: 0.5 + 2·(1/2)·100/50 = 2.5
        ("dp_replicate=2", 8.5),
        # the gather first: 0.5 + (3/4)·100/50 = 2, so F 2-3, 3-4, B 4-6, 6-8; then rank 0's
        # reduce_scatter, 2 again
        ("dp_shard=4", 10.0),
        # no collective but the ones in the layers: the plain 1F1B step, (M + P - 1)·(F + B)
        ("tp=2", 6.0),
    ],
)
def test_collective_costs_have_closed_forms(
    capsys: pytest.CaptureFixture[str], mesh: str, makespan: float
) -> None:
    data = _simulate(capsys, mesh)
    assert data["makespan"] == pytest.approx(makespan)


def test_replicas_reduce_the_shards_of_sharded_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """With dp_shard=2 and dp_replicate=2, the replicas' all_reduce carries one shard, 50
    bytes: 0.5 + 2·(1/2)·50/50 = 1.5 after the reduce_scatter (0.5 + (1/2)·100/50 = 1.5)."""
    data = _simulate(capsys, "dp_shard=2,dp_replicate=2")
    ops = _ops(data, 0)
    waits = [o for o in ops if o["op"] == "wait"]
    rs = next(o for o in ops if o["op"].startswith("reduce_scatter"))
    ar = next(o for o in ops if o["op"].startswith("all_reduce"))
    assert ar["start"] == pytest.approx(rs["start"] + 1.5)
    assert waits[-1]["end"] == pytest.approx(ar["start"] + 1.5)


def test_without_bandwidth_a_collective_costs_its_latency(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = _simulate(capsys, "dp_replicate=2", "F=1,B=2,param_bytes=100,collective=0.5")
    assert data["makespan"] == pytest.approx(6.5)
