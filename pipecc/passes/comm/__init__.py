"""The parts of the comm lowering (`pipecc.passes.insert_comms`): the knobs and named
policies (`placement`), the ordering replay and the global message order (`order`), and the
emission of posts, groups and waits (`emission`)."""

from __future__ import annotations
