"""Is a resumed study's search space still the one its trials were run in?

Two kinds of change are refused. :func:`stored_change` names a change that the study
cannot store at all: Optuna keeps one distribution per parameter name across a study's
trials and refuses a trial whose distribution differs in kind (int, float, categorical),
in scale (log) or, for a categorical, in its choices (any change: added, removed or
reordered). Such a scenario needs a new study, whatever ``--allow-space-change`` says.

:func:`space_change` compares the parameters recorded on the study (``hpo.space.describe``)
with the scenario's and names the first change that would make the history mean something
else: a parameter removed, renamed or added, a type, scale, step, condition or constant
changed, a range narrowed, a choice removed. ``--allow-space-change`` accepts these.
Widening a numeric range is sound and allowed.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpo import space

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

    from hpo.space import Params

Described = Mapping[str, Mapping[str, Any]]
_FIXED_KEYS = ("type", "log", "step", "condition", "value", "distribution", "mean", "std")
_KINDS = {"IntDistribution": "int", "FloatDistribution": "float", "CategoricalDistribution": "categorical"}


def stored_change(stored: Mapping[str, BaseDistribution], params: Params) -> str | None:
    """A one-line description of the first parameter of ``params`` whose distribution the
    study cannot store beside ``stored`` (the distributions its trials hold, by name), or None.
    Constants are never stored, and a parameter no trial holds can take any distribution."""
    from optuna.distributions import CategoricalDistribution, check_distribution_compatibility

    for name, new in space.distributions(params).items():
        old = stored.get(name)
        if params[name].type == "constant" or old is None:
            continue
        try:
            check_distribution_compatibility(old, new)
        except ValueError:
            if type(old) is not type(new):
                what = f"type changed from {_kind(old)!r} to {_kind(new)!r}"
            elif isinstance(old, CategoricalDistribution) and isinstance(new, CategoricalDistribution):
                what = f"choices changed from {list(old.choices)!r} to {list(new.choices)!r}"
            else:
                what = f"log changed from {getattr(old, 'log', None)!r} to {getattr(new, 'log', None)!r}"
            return f"parameters.{name}: {what}"
    return None


def _kind(distribution: BaseDistribution) -> str:
    return _KINDS.get(type(distribution).__name__, type(distribution).__name__)


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
        return f"choice {removed[0]!r} was removed"
    return None
