"""The driver: turn any input (.sched, .json, .csv) into a Program (`load`, `compile`,
`files`), verify one (`check`) or a range of sizes (`sweep`). It sits above the front end,
the passes and the verifier, and decides when each runs."""

from __future__ import annotations
