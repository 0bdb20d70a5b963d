"""What a replay shows: the gaps before each op (dependency-bound or placement-bound, `gaps`)
and the chain of causes behind an op's start (`critical_path`). Used by the verifier, the
simulator, `pipecc explain` and the `--align` pass; imports only the IR and the semantics."""

from __future__ import annotations
