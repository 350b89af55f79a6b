"""Is a resumed study's search space still the one its trials were run in?

The parameters a study was made with are recorded on it (``hpo.space.describe``). On
resume, :func:`space_change` compares them with the scenario's and names the first change
that would make the history mean something else: a parameter removed, renamed or added, a
type, scale, step, condition or constant changed, a range narrowed, a choice removed. Two
changes are sound and allowed, because every finished trial stays a legal point of the new
space and keeps its meaning: widening a numeric range, and adding a categorical choice.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Described = Mapping[str, Mapping[str, Any]]
_FIXED_KEYS = ("type", "log", "step", "condition", "value", "distribution", "mean", "std")


def space_change(old: Described, new: Described) -> str | None:
    """A one-line description of the first unsound change from ``old`` to ``new``, or None."""
    for name in old:
        if name not in new:
            added = [n for n in new if n not in old]
            hint = f" (renamed to {added[0]}?)" if len(added) == 1 else ""
            return f"parameters.{name}: the study's trials have this parameter, the scenario no longer{hint}"
    for name in new:
        if name not in old:
            return f"parameters.{name}: a new parameter; the study's trials were run without it"
    for name, before in old.items():
        problem = _param_change(before, new[name])
        if problem:
            return f"parameters.{name}: {problem}"
    return None


def _param_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> str | None:
    for key in _FIXED_KEYS:
        if before.get(key) != after.get(key):
            return f"{key} changed from {before.get(key)!r} to {after.get(key)!r}"
    if "low" in before and (after.get("low", 0) > before["low"] or after.get("high", 0) < before["high"]):
        return (f"the range [{before['low']:g}, {before['high']:g}] was narrowed to "
                f"[{after.get('low'):g}, {after.get('high'):g}] (widening is allowed)")
    removed = [c for c in before.get("choices", ()) if c not in after.get("choices", ())]
    if removed:
        return f"choice {removed[0]!r} was removed (adding choices is allowed)"
    return None
