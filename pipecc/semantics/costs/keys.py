"""The cost keys: one table, from which everything else that names a key is derived.

Each key is one row of `KEYS`: its name (the same on the command line, `--cost F=1,comm=0.1`,
and in a TOML file), where it may be given (`Scope`), how a conversion to a stage of another
size treats it (`Scale`, docs/simulate.md "The cost convention") and its value where not
given (`default`; `derived` says in words how one is derived from the others instead). The
parser, the conversion between cuts, the resolution of defaults, docs/simulate.md's table
and the runtime's cost-file writer (runtime/profiling, which imports this module and nothing
else of the compiler) all read this table; tests/semantics/test_cost_keys.py checks that each
of them knows every row. This module imports the standard library only.
"""

from __future__ import annotations

from enum import Enum
from types import MappingProxyType
from typing import NamedTuple


class Scope(Enum):
    """Where a key may be given."""

    STAGE = "stage"  # under [cost] (every stage) and [cost.stage.N] (one stage)
    GLOBAL = "global"  # under [cost] or on the command line only
    FILE = "file"  # under a file's [cost] only: the cut the costs were measured on


class Scale(Enum):
    """What converting the costs to a stage of another size (P/S shares) does to a key."""

    OP = "op"  # a compute instruction's duration: × shares, its first `dispatch` excepted
    WORK = "work"  # a per-stage action's duration (torch's UNSHARD, ...): × shares
    BYTES = "bytes"  # a size of a stage (for peak memory in bytes): × shares
    MESSAGE = "message"  # a message's latency or size: as given
    HOST = "host"  # host time per instruction, per step or per collective: as given
    NONE = "none"  # not a figure (a bandwidth, a name, groups, the measured cut)


class Key(NamedTuple):
    """One row of the table."""

    name: str
    scope: Scope
    scale: Scale
    default: float | None = None  # the value where not given (None: stays unset)
    derived: str = ""  # how a stage's value is derived where not given, in words

    @property
    def scaled(self) -> bool:
        """Whether the conversion to another cut multiplies it by the stage's shares."""
        return self.scale in (Scale.OP, Scale.WORK, Scale.BYTES)

    @property
    def filled(self) -> bool:
        """Whether a stage's resolved costs always hold a value for it."""
        return self.scope is Scope.STAGE and (self.default is not None or bool(self.derived))


STAGE, GLOBAL, FILE = Scope.STAGE, Scope.GLOBAL, Scope.FILE  # the table's abbreviations

KEYS: tuple[Key, ...] = (
    Key("F", STAGE, Scale.OP, derived="1 per share"),
    Key("B", STAGE, Scale.OP, derived="I + W, else 2 per share"),
    Key("I", STAGE, Scale.OP, derived="B - W, else B / 2"),
    Key("W", STAGE, Scale.OP, derived="B - I, else B / 2"),
    Key("FB", STAGE, Scale.OP),  # absent: F + B (CostModel.fused)
    Key("FI", STAGE, Scale.OP),  # absent: F + I
    Key("comm", STAGE, Scale.MESSAGE, 0.0),  # plus bytes / bandwidth
    Key("bytes", STAGE, Scale.MESSAGE),
    Key("out_bytes", STAGE, Scale.MESSAGE),
    Key("act_bytes", STAGE, Scale.BYTES),
    Key("act_bytes_w", STAGE, Scale.BYTES),
    Key("param_bytes", STAGE, Scale.BYTES),
    Key("grad_bytes", STAGE, Scale.BYTES),
    Key("grad_bytes_w", STAGE, Scale.BYTES),
    Key("optim_bytes", STAGE, Scale.BYTES),
    Key("sharded_param_bytes", STAGE, Scale.BYTES),
    Key("unsharded_param_bytes", STAGE, Scale.BYTES),
    Key("workspace_F", STAGE, Scale.BYTES),
    Key("workspace_B", STAGE, Scale.BYTES),
    Key("workspace_I", STAGE, Scale.BYTES),
    Key("workspace_W", STAGE, Scale.BYTES),
    Key("workspace_sum", STAGE, Scale.BYTES),
    Key("a2a", STAGE, Scale.MESSAGE),  # one expert-parallel all_to_all; absent: `collective`
    Key("moe_experts", STAGE, Scale.MESSAGE, 0.5),  # the experts' part of a MoE stage's ops
    Key("moe_layers", STAGE, Scale.MESSAGE),  # a stage's MoE layers (over --moe K)
    Key("UNSHARD", STAGE, Scale.WORK, 0.0),
    Key("RESHARD", STAGE, Scale.WORK, 0.0),
    Key("REDUCE_GRAD", STAGE, Scale.WORK, 0.0),
    Key("bandwidth", GLOBAL, Scale.NONE),
    Key("post", GLOBAL, Scale.HOST, 0.0),
    Key("wait", GLOBAL, Scale.HOST, 0.0),
    Key("sync", GLOBAL, Scale.HOST, 0.0),
    Key("collective", GLOBAL, Scale.HOST, 0.0),
    Key("dispatch", GLOBAL, Scale.HOST, 0.0),
    Key("shared", GLOBAL, Scale.NONE),
    Key("unit", GLOBAL, Scale.NONE),
    Key("placement", FILE, Scale.NONE),
    Key("ranks", FILE, Scale.NONE),
    Key("stages", FILE, Scale.NONE),
)
BY_NAME = MappingProxyType({key.name: key for key in KEYS})


def key(name: str) -> str:
    """`name`, checked against the table (for a writer that names one key: a key the table
    does not have fails where it is named, not in the reader of the file)."""
    if name not in BY_NAME:
        raise KeyError(f"no cost key {name!r} (pipecc/semantics/costs/keys.py)")
    return name


def _names(scale: Scale) -> tuple[str, ...]:
    return tuple(k.name for k in KEYS if k.scale is scale)


# every key of a [cost.stage.N] table (and a StageCost's fields), in the table's order
STAGE_KEYS = tuple(k.name for k in KEYS if k.scope is Scope.STAGE)
# every key [cost] and --cost know (the file keys only in a file)
GLOBAL_KEYS = tuple(k.name for k in KEYS)
OP_KEYS = _names(Scale.OP)  # compute durations: their first `dispatch` is not scaled
STAGE_OP_KEYS = _names(Scale.WORK)  # torch's per-stage actions: 0 unless given
BYTE_KEYS = _names(Scale.BYTES)  # the sizes of a stage for peak memory in bytes
WORK_KEYS = tuple(k.name for k in KEYS if k.scaled)  # scaled to the stage's part of the model
MESSAGE_KEYS = _names(Scale.MESSAGE)  # a message's: as given, not scaled
HOST_KEYS = _names(Scale.HOST)  # a HostCost's fields
CUT_KEYS = tuple(k.name for k in KEYS if k.scope is Scope.FILE)  # what a file was measured on
FILLED_KEYS = tuple(k.name for k in KEYS if k.filled)  # set in every resolved stage
