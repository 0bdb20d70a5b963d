"""The cost model of the simulator (DESIGN §6): op durations, message latency, sizes.

    costs = parse_cost_flag("F=1,B=2,comm=0.1")     # or load_cost_file("costs.toml")
    stage = costs.for_program(program).stage(0)     # a FilledCost: F, B, I, W, comm, ...

One table of keys (`keys.py`: each key's name, where it may be given, how it scales, its
default) from which the rest is derived: `stage.py` one stage's costs (`StageCost`, resolved
into a `FilledCost`) and the host's (`HostCost`); `convert.py` the conversion between cuts;
`model.py` the `CostModel` and its queries; `parse.py` the flag and the TOML; `timing.py`
the replay engine's view. docs/simulate.md "The cost model" describes every key.

A new key is a row of `keys.KEYS`; the parser, the conversion, the defaults and the writers
follow from its scope and scale. A stage key is also a field of `StageCost` and a host key
one of `HostCost` (typed attributes), and every key a row of docs/simulate.md's table:
tests/semantics/test_cost_keys.py fails, naming it, where one is missing.
"""

from .convert import Cut, format_shared, ratio, scale_duration
from .keys import KEYS, Key, Scale, Scope
from .model import CostModel, ring_traffic
from .parse import load_cost_file, parse_cost_flag, parse_cost_text
from .stage import FilledCost, HostCost, StageCost
from .timing import CostTiming

__all__ = [
    "KEYS",
    "CostModel",
    "CostTiming",
    "Cut",
    "FilledCost",
    "HostCost",
    "Key",
    "Scale",
    "Scope",
    "StageCost",
    "format_shared",
    "load_cost_file",
    "parse_cost_flag",
    "parse_cost_text",
    "ratio",
    "ring_traffic",
    "scale_duration",
]
