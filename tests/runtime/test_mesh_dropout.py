"""Dropout on a mesh: each data-parallel replica numbers its microbatches over the global
batch (runtime/engine/rng.py), so its masks are those of the same rows in the single-process
run of the whole batch, and `--check` holds with dropout on (it failed, rel 1.12, when every
replica drew microbatch 0's masks for its own microbatch 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
PIPECC = str(Path(sys.executable).parent / "pipecc")


def test_replicas_draw_the_masks_of_their_rows_in_the_whole_batch() -> None:
    env = dict(os.environ, PIPECC_GPT_DROPOUT="0.3")
    result = subprocess.run(
        [PIPECC, "run", "dualpipev", "-M", "4", "--nproc", "2", "--mesh", "pp=1,dp_replicate=2",
         "--model", str(ROOT / "examples" / "gpt.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(tolerance 1e-05): ok" in result.stdout, result.stdout


def test_the_replica_index_is_row_major_over_the_data_dimensions() -> None:
    from pipecc.runtime.comm.mesh import replica_index

    class Mesh:  # the DeviceMesh calls replica_index makes
        mesh_dim_names = ("pp", "dp_replicate", "dp_shard", "tp")
        coords = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
        sizes = {"pp": 2, "dp_replicate": 2, "dp_shard": 3, "tp": 2}

        def __getitem__(self, dim: str) -> SimpleNamespace:
            return SimpleNamespace(size=lambda: self.sizes[dim])

        def get_local_rank(self, dim: str) -> int:
            return self.coords[dim]

    assert replica_index(None, "pp") == 0
    assert replica_index(Mesh(), "pp") == 1 * 3 + 2, "tp and pp coordinates do not count"
