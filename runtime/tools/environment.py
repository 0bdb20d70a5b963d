"""The `PIPECC_*` environment variables `pipecc run` maps onto `RuntimeConfig` fields.

The runtime reads no environment variable below runtime/tools/: a setting is a field of
`RuntimeConfig` (runtime/config.py), and only the launcher of `pipecc run` takes it from the
environment, once, in the process that starts the ranks (a bad value is an input error
there, before any rank starts). docs/runtime.md lists the fields and the variables.

- `PIPECC_POST_THREAD`: "1" sets `gloo_poster_thread` (post from one poster thread on
  gloo), "0" (the default) posts in the calling thread.
- `PIPECC_GLOO_DIRECTIONS`: "0" clears `gloo_direction_groups` (one gloo group both ways),
  "1" (the default) makes a second group for the messages to a lower rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from pipecc.diagnostics import InputError

POST_THREAD = "PIPECC_POST_THREAD"
DIRECTIONS = "PIPECC_GLOO_DIRECTIONS"


class GlooPosting(NamedTuple):
    """`RuntimeConfig.gloo_poster_thread` and `gloo_direction_groups` (their defaults)."""

    poster_thread: bool = False
    direction_groups: bool = True


def gloo_posting(environ: Mapping[str, str]) -> GlooPosting:
    """The gloo posting fields that `environ` asks for (module docstring)."""
    return GlooPosting(
        poster_thread=_switch(environ, POST_THREAD, "post in the calling thread", "0"),
        direction_groups=_switch(environ, DIRECTIONS, "one group both ways", "1"),
    )


def _switch(environ: Mapping[str, str], name: str, off: str, default: str) -> bool:
    """An on/off variable: "1" or "0" (`off`), `default` when unset."""
    value = environ.get(name, default)
    if value not in ("0", "1"):
        raise InputError(f"{name}={value!r}: expected 0 ({off}) or 1")
    return value == "1"
