"""Reproducible randomness: every forward of (stage, microbatch) under a derived RNG state.

Before each forward of stage s on microbatch mb in step t, the default generator of the
stage's device (and the CPU's) is seeded with a 63-bit number derived from (seed, t, s, mb)
by a splitmix64 chain. Which rank runs the forward, in which order, on which pipe, does not
matter: every schedule, and the single-process reference that seeds the same way
(runtime/tools/reference.py), draws the same dropout masks. Distinct (stage, microbatch) pairs
draw from unrelated streams, so ranks seeded alike do not draw correlated masks. The
generators' states before the step are restored after it, so the caller's random stream is
not disturbed. Measured cost per forward: docs/runtime.md ("Reproducible dropout").

On a mesh, microbatches are numbered over the global batch: the replica at data-parallel
index d (dp_replicate, dp_shard, row-major) of a program of M microbatches runs global
microbatches d·M .. d·M + M − 1 (`first`), as the contiguous share `pipecc run --mesh` gives
it; so replicas draw unrelated masks, and each the masks of the same rows in a
single-process run of the global batch cut into D·M microbatches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """One splitmix64 step."""
    value = (value + 0x9E3779B97F4A7C15) & MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK
    return value ^ (value >> 31)


def derive_seed(seed: int, step: int, stage: int, mb: int) -> int:
    """The seed of one forward: a hash of (seed, step, stage, microbatch), below 2^63."""
    value = 0
    for part in (seed, step, stage, mb):
        value = _mix(value ^ (part & MASK))
    return value >> 1


def cuda_index(device: torch.device) -> int:
    """A CUDA device's index: `cuda` without one is the current device (each rank's own,
    as torch resolves it), not device 0."""
    return device.index if device.index is not None else torch.cuda.current_device()


class ForwardRng:
    """Seeds the generators of `device` (and the CPU's) for each forward; off when not
    `enabled`."""

    def __init__(self, device: torch.device, seed: int, *, enabled: bool, first: int = 0) -> None:
        self.enabled = enabled
        self.first = first  # the global index of this process's microbatch 0 (docstring)
        self.seed_value = seed
        self.cuda = device.type == "cuda"
        self.index = cuda_index(device) if self.cuda else 0

    def seed(self, step: int, stage: int, mb: int) -> None:
        if not self.enabled:
            return
        value = derive_seed(self.seed_value, step, stage, self.first + mb)
        torch.default_generator.manual_seed(value)
        if self.cuda:
            torch.cuda.default_generators[self.index].manual_seed(value)

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """Restore the generators' states after the step (nothing to do when off)."""
        if not self.enabled:
            yield
            return
        devices = [self.index] if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            yield

    def snapshot(self) -> Any:
        """The generators' states a forward starts from, when they are not derived (a
        recomputed forward runs again from it); None when derived."""
        if self.enabled:
            return None
        cuda = torch.cuda.get_rng_state(self.index) if self.cuda else None
        return torch.get_rng_state(), cuda

    @contextlib.contextmanager
    def replaying(self, step: int, stage: int, mb: int, state: Any) -> Iterator[None]:
        """The RNG state of the forward of (step, stage, mb) again, for a recomputation,
        leaving the generators as they were after the block."""
        devices = [self.index] if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            if state is None:
                self.seed(step, stage, mb)
            else:
                torch.set_rng_state(state[0])
                if state[1] is not None:
                    torch.cuda.set_rng_state(state[1], self.index)
            yield
