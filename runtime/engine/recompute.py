"""Which stages recompute what in their backward (activation checkpointing): the spec.

A *mode* is `full` (the stage's whole forward runs again before its backward), `none`, or a
*selection* of submodules (selective recomputation, runtime/engine/selective.py): one or
more selectors joined by `+`, each

- `type=NAME`: the submodules that are instances of a class named NAME (its `__name__`, or
  `module.QualName`), e.g. `type=CausalSelfAttention`;
- `name=PATTERN`: the submodules whose qualified name in the stage module (as
  `named_modules()` gives it, e.g. `blocks.0.attn`), or a dotted tail of it, matches the
  shell-style PATTERN, e.g. `name=attn` (every `….attn`), `name=blocks.*.mlp`;
- a bare `WORD`: either of the two, e.g. `attn`.

Of the modules matched, only the outermost are recomputed (a match inside another is part of
it). A spec is a mode for every stage (`"full"`, `"attn+mlp"`), a mapping `{stage: mode}` (the
model file, the Python API), or the command line's `"0:full,1:type=Attention"` (stages left
out: none). A selector of a per-stage mode must match a module of that stage; one of a mode
for every stage must match in some stage (a stage without one recomputes nothing):
`check_selections`, which `pipecc run` applies to every stage before any process starts.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pipecc.diagnostics import InputError

MODES = ("full", "none")
Spec = str | Mapping[int, str] | None
KINDS = ("type", "name")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*$")
_PATTERN = re.compile(r"[A-Za-z0-9_.*?\[\]!]+$")
HELP = (
    "a mode is 'full', 'none' or a selection of submodules: 'type=CLASS', 'name=PATTERN' or a "
    "bare word (either), joined by '+', e.g. 'attn' or 'type=Attention+name=mlp'"
)


@dataclass(frozen=True)
class Selector:
    """One part of a selection: `kind` "type", "name" or "any" (a bare word)."""

    kind: str
    value: str

    def __str__(self) -> str:
        return self.value if self.kind == "any" else f"{self.kind}={self.value}"

    def matches(self, name: str, module: torch.nn.Module) -> bool:
        by_type = self.kind in ("type", "any") and _is_type(module, self.value)
        return by_type or (self.kind in ("name", "any") and _is_named(name, self.value))


@dataclass(frozen=True)
class Selection:
    """The submodules a stage recomputes selectively."""

    selectors: tuple[Selector, ...]

    def __str__(self) -> str:
        return "+".join(str(s) for s in self.selectors)

    def modules(self, root: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
        """The outermost submodules of `root` (itself included) that a selector matches."""
        chosen: list[str] = []
        found = []
        for name, module in root.named_modules():
            if any(_inside(name, outer) for outer in chosen):
                continue
            if any(s.matches(name, module) for s in self.selectors):
                chosen.append(name)
                found.append(module)
        return tuple(found)


Mode = str | Selection  # "full" or a selection ("none" is left out)


def parse_spec(text: str) -> Spec:
    """The command line's spec: one mode, or "stage:mode" pairs split by commas."""
    text = text.strip()
    if ":" not in text:
        parse_mode(text, "--recompute")
        return text
    found: dict[int, str] = {}
    for part in text.split(","):
        stage, _, mode = part.partition(":")
        if not stage.strip().isdigit():
            raise InputError(f"--recompute: {part!r} is not stage:mode (e.g. 0:full,1:attn)")
        parse_mode(mode.strip(), "--recompute")
        found[int(stage)] = mode.strip()
    return found


def parse_mode(mode: object, where: str) -> str | Selection:
    """ "full", "none" or the selection a mode names (InputError for anything else)."""
    if mode in MODES:
        assert isinstance(mode, str)
        return mode
    if not isinstance(mode, str) or not mode.strip():
        raise InputError(f"{where}: {mode!r} is not a recomputation mode; {HELP}")
    return Selection(tuple(_selector(part.strip(), where) for part in mode.split("+")))


def _selector(part: str, where: str) -> Selector:
    kind, equals, value = part.partition("=")
    if not equals:
        if _WORD.match(part) and part not in MODES:
            return Selector("any", part)
        raise InputError(f"{where}: {part!r} is not a module selector; {HELP}")
    if kind.strip() not in KINDS or not _PATTERN.match(value.strip()):
        raise InputError(f"{where}: {part!r} is not a module selector; {HELP}")
    return Selector(kind.strip(), value.strip())


def modes(spec: Spec, stages: int) -> dict[int, Mode]:
    """Each stage's mode, of a program with `stages` stages (stages recomputing nothing are
    left out)."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        mode = parse_mode(spec, "recompute")
        return {} if mode == "none" else dict.fromkeys(range(stages), mode)
    chosen: dict[int, Mode] = {}
    for stage, text in spec.items():
        if not isinstance(stage, int) or not 0 <= stage < stages:
            raise InputError(f"recompute: stage {stage!r} is not one of 0..{stages - 1}")
        mode = parse_mode(text, f"recompute of stage {stage}")
        if mode != "none":
            chosen[stage] = mode
    return chosen


def recomputed(spec: Spec, stages: int) -> frozenset[int]:
    """The stages that recompute in full, of a program with `stages` stages (the spec is
    checked: InputError for a bad mode or stage)."""
    return frozenset(s for s, m in modes(spec, stages).items() if m == "full")


def selections(spec: Spec, stages: int) -> dict[int, Selection]:
    """The stages that recompute selectively, with their selections."""
    return {s: m for s, m in modes(spec, stages).items() if isinstance(m, Selection)}


def check_selections(
    spec: Spec, stages: int, modules: Mapping[int, torch.nn.Module], *, whole: bool
) -> None:
    """InputError naming a selector that matches nothing: in its stage (a per-stage mode, for
    the stages in `modules`), or, with `whole` (`modules` holds every stage), in any stage (a
    mode for every stage)."""
    chosen = selections(spec, stages)
    if not chosen:
        return
    if isinstance(spec, str):
        if whole:
            selection = next(iter(chosen.values()))
            _none_matched(selection, modules.values(), "recompute")
        return
    for stage, selection in chosen.items():
        if stage in modules:
            _none_matched(selection, [modules[stage]], f"recompute of stage {stage}")


def _none_matched(selection: Selection, roots: Iterable[torch.nn.Module], where: str) -> None:
    roots = list(roots)
    named = [(n, m) for root in roots for n, m in root.named_modules()]
    missing = [s for s in selection.selectors if not any(s.matches(n, m) for n, m in named)]
    if missing:
        names = ", ".join(repr(str(s)) for s in missing)
        kinds = sorted({type(m).__name__ for r in roots for m in r.modules()})
        raise InputError(
            f"{where}: {names} matches no submodule of the stage"
            f"{'s' if len(roots) > 1 else ''} (module types there: {', '.join(kinds[:12])}"
            f"{', ...' if len(kinds) > 12 else ''}); {HELP}"
        )


def _is_type(module: torch.nn.Module, value: str) -> bool:
    for cls in type(module).__mro__:
        if value in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def _is_named(name: str, pattern: str) -> bool:
    parts = name.split(".") if name else []
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name.startswith(outer + ".")


def selected_modules(
    spec: Spec, stages: int, chunks: Mapping[int, Any]
) -> dict[int, tuple[torch.nn.Module, ...]]:
    """By chunk (`chunks`: runtime/plan/binding.py's, each with `slot.stage` and `module`):
    the submodules its stage recomputes selectively. A per-stage selector that matches no
    submodule of its stage is an InputError (`check_selections`)."""
    chosen = selections(spec, stages)
    held = {c.slot.stage: c.module for c in chunks.values()}
    check_selections(spec, stages, held, whole=False)
    return {
        index: chosen[c.slot.stage].modules(c.module)
        for index, c in chunks.items()
        if c.slot.stage in chosen
    }
