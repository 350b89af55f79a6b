"""Are a resumed study's search space and design still the ones its trials were run in?

Three kinds of change are refused. :func:`stored_change` names a change that the study
cannot store at all: Optuna keeps one distribution per parameter name across a study's
trials and refuses a trial whose distribution differs in kind (int, float, categorical),
in scale (log) or, for a categorical, in its choices (any change: added, removed or
reordered). Such a scenario needs a new study, whatever ``--allow-space-change`` says.

:func:`space_change` compares the parameters recorded on the study (``hpo.space.describe``)
with the scenario's and names the first change that would make the history mean something
else: a parameter removed, renamed or added, a type, scale, step, condition or constant
changed, a range narrowed, a choice removed. ``--allow-space-change`` accepts these.
Widening a numeric range is sound and allowed (but for a grid: below).

:func:`design_change` names a design point that a trial ran from and that the scenario now
says otherwise (an edited or inserted CSV row, a grid renumbered by a widened range): the
design would run points twice or never, so it is refused whatever ``--allow-space-change``
says.

:func:`resume_refusal` asks the three in that order, as a resumed study does.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from hpo import designs, space

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.trial import FrozenTrial

    from hpo.rows import TrialRow
    from hpo.scenario import Param, Scenario
    from hpo.space import Params

Described = Mapping[str, Mapping[str, Any]]
_FIXED_KEYS = ("type", "log", "step", "condition", "value", "distribution", "mean", "std")
_KINDS = {"IntDistribution": "int", "FloatDistribution": "float", "CategoricalDistribution": "categorical"}
_CSV_HOW = "rows already run must stay as they were: add new rows at the end, or start a new study with another name"
_GRID_HOW = ("so points would run twice or never; give the parameters the values the study ran with, or start a new "
             "study with another name")


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


INDEXED_DESIGNS = ("csv", "grid")
"""The designs whose trials :func:`design_change` compares with the points their numbers name now."""


def design_change(scenario: Scenario, rows: Iterable[TrialRow]) -> str | None:
    """A one-line description of the first design point (by ``design_index``) whose values
    the scenario now gives otherwise than a trial of ``rows`` ran it with, or None.

    A trial is tied to its point by ``design_index``: a CSV row's place among the file's
    rows (whatever ``search.trials``; rows may repeat a point), a grid point's place in the
    grid's natural order (:func:`hpo.designs.grid_points`). The values of the free
    parameters that both hold are compared, as their types say (floats to a relative 1e-9);
    which parameters are active follows from those values unless a condition changed, which
    :func:`space_change` judges. Random designs are points of a seeded unit cube, mapped
    through the space, and are not compared.
    """
    method = scenario.search.method
    if method not in INDEXED_DESIGNS:
        return None
    ran = sorted((row for row in rows if row.design_index is not None),
                 key=lambda row: (row.design_index, row.number))
    if not ran:
        return None
    params = scenario.parameters
    free = space.free_parameters(params)
    listed = designs.csv_rows(scenario) if method == "csv" else list(enumerate(designs.grid_points(scenario)))
    for row in ran:
        held = {name: row.params[name] for name in free if name in row.params}
        index = row.design_index
        assert index is not None
        line, now = listed[index] if index < len(listed) else (None, None)
        changed = [name for name, value in held.items()
                   if now is None or (name in now and not _same(params[name], now[name], value))]
        if not changed:
            continue
        ran_as = _show(held, free)
        if method == "csv":
            file = Path(scenario.search.csv or "").name
            if now is None:
                return (f"{file}: trial {row.number} ran {ran_as} from data row {index + 1}, but the file's rows "
                        f"now end at data row {len(listed)}; {_CSV_HOW}")
            return f"{file} line {line}: the row now says {_show(now, free)}, but trial {row.number} ran {ran_as} " \
                   f"from it; {_CSV_HOW}"
        if now is None:
            return (f"parameters: the grid changed: trial {row.number} ran {ran_as} as its point {index}, but its "
                    f"points now end at point {len(listed) - 1}, {_GRID_HOW}")
        return (f"parameters.{changed[0]}: the grid changed: its point {index} is now {_show(now, free)}, but trial "
                f"{row.number} ran {ran_as} as that point, {_GRID_HOW}")
    return None


def _show(point: Mapping[str, Any], names: list[str]) -> str:
    """``x=0.1 y=1 opt=sgd``: the point's values of ``names``, in that order, in full."""
    return " ".join(f"{name}={point[name]}" for name in names if name in point)


def _same(param: Param, now: Any, ran: Any) -> bool:
    """Whether ``now`` (the design's value) is ``ran`` (a trial's) as ``param``'s type compares them."""
    if param.type in ("int", "float") and _number(now) and _number(ran):
        if param.type == "int":
            return bool(now == ran)
        step_tolerance = 1e-6 * param.step if param.step else 0.0  # a CSV cell's snap onto its step
        return math.isclose(now, ran, rel_tol=1e-9, abs_tol=step_tolerance)
    return bool(now == ran) and isinstance(now, bool) == isinstance(ran, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def resume_refusal(scenario: Scenario, trials: Iterable[FrozenTrial], recorded: Callable[[], Described | None],
                   rows: Callable[[], list[TrialRow]], allow_space_change: bool = False) -> str | None:
    """Why the scenario may not resume a study whose trials are ``trials`` (in one line, naming
    the field and what to do), or None: a change the study cannot store (:func:`stored_change`)
    always, another unsound one (:func:`space_change` from the parameters ``recorded()`` on the
    study) unless ``allow_space_change``, a design point its trials (``rows()``) ran from and the
    scenario now gives otherwise (:func:`design_change`) always. ``recorded`` and ``rows`` are
    read only where needed."""
    stored: dict[str, BaseDistribution] = {}
    for trial in trials:
        for name, distribution in trial.distributions.items():
            stored.setdefault(name, distribution)
    problem = stored_change(stored, scenario.parameters)
    if problem is not None:
        return (f"{problem}: the study {scenario.name} stored its trials with the old distribution, which an Optuna "
                "study cannot change; use another name for a new study (--allow-space-change cannot override this)"
                f"{_read_otherwise(stored, scenario)}")
    before = recorded()
    change = None if before is None or allow_space_change else space_change(before, space.describe(scenario.parameters))
    if change is not None:
        return (f"{change}: the study {scenario.name} was run in another search space (resume with "
                "--allow-space-change to accept it, or use a new name)")
    return design_change(scenario, rows()) if scenario.search.method in INDEXED_DESIGNS else None


def _read_otherwise(stored: Mapping[str, BaseDistribution], scenario: Scenario) -> str:
    """``; ...`` where a categorical's choices differ from those its trials stored only as YAML
    1.1 and 1.2 read them (``[yes, no]`` was true and false before hpo read parameters as YAML
    1.2 does), with the choices to write to resume the study; else ''."""
    from optuna.distributions import CategoricalDistribution

    from hpo.scenario import yaml_text

    for name, distribution in stored.items():
        param = scenario.parameters.get(name)
        if not isinstance(distribution, CategoricalDistribution) or param is None \
                or param.choices is None or set(param.choices) == set(distribution.choices):
            continue
        as_before = {yaml.safe_load(choice) if isinstance(choice, str) else choice for choice in param.choices}
        if as_before == set(distribution.choices):
            return (f"; hpo now reads parameters as YAML 1.2 does ({name}'s choices {', '.join(map(str, param.choices))} "
                    f"are text): write {yaml_text(list(distribution.choices))} to resume the study")
    return ""
