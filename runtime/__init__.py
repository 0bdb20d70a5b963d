"""pipecc.runtime: executes compiled programs under torchrun (needs the `[runtime]` extra).

This package is the top-level `runtime/` folder of the repository, installed as
`pipecc.runtime`. It imports `pipecc.ir` and torch; nothing in `pipecc` imports it at module
level, so the compiler, verifier and simulator install without torch.
"""

from __future__ import annotations
