"""pipecc: a compiler, verifier, simulator and runtime for pipeline-parallel schedules."""

from __future__ import annotations

__version__ = "0.1.0"
