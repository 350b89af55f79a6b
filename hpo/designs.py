"""Designs of experiments: the whole list of points, computed before any trial runs.

:func:`design_points` returns every point of a design method (``monte_carlo``, ``sobol``,
``lhs``, ``grid``, ``csv``) as parameter dicts, or None for model-based methods, which
propose points one at a time. The engine enqueues the points in the study, so whichever
worker asks next takes the next point. Random designs are seeded and prefix-stable
(Monte Carlo and Sobol): raising ``search.trials`` later extends the same sequence; a Latin
hypercube is drawn for its number of points, so raised, its points beyond the old number come
from a larger one (the README says so). A grid's
points run in a seeded random order (as Optuna's GridSampler visits them), so
``search.trials`` below the grid's size is a random subset spread over the grid, not one
corner of it, and raising it later (or leaving it out) extends the same sequence. Each
trial records the number of the point it runs (``design_index``: :func:`design_numbers`);
a study whose CSV row or grid point under a number its trials ran changed since is refused
on resume (:func:`hpo.spacecheck.design_change`), so rows are added at the end only.
"""
from __future__ import annotations

import csv
import io
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hpo import space
from hpo.errors import InputError
from hpo.files import utf8_text
from hpo.scenario import DESIGN_METHODS, Param, Scenario

Point = dict[str, Any]


def _unit_points(method: str, count: int, dims: int, seed: int) -> np.ndarray:
    if dims == 0:
        return np.zeros((count, 0))
    if method == "monte_carlo":
        return np.random.default_rng(seed).random((count, dims))
    from scipy.stats import qmc

    if method == "sobol":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return qmc.Sobol(dims, scramble=True, seed=seed).random(count)
    return qmc.LatinHypercube(dims, seed=seed).random(count)


GRID_POINTS_LIMIT = 1_000_000
"""The most points a grid design may have: a larger one is refused, not listed (which takes
minutes and gigabytes), whatever ``search.trials``."""


def grid_points(scenario: Scenario) -> list[Point]:
    """The Cartesian product of every parameter's grid values, conditions applied, in the
    product's order (the last parameter varies fastest): a parameter whose condition does not
    hold adds no points of its own. InputError past :data:`GRID_POINTS_LIMIT` points."""
    params = scenario.parameters
    sizes = {name: space.grid_size(name, p) for name, p in params.items()}
    if _grid_count(params, sizes) > GRID_POINTS_LIMIT:
        raise _grid_too_large(sizes)
    points: list[Point] = [{}]
    for name, p in params.items():
        points = [grown for point in points for grown in (
            ({**point, name: value} for value in space.grid_values(name, p)) if space.is_active(p, point) else [point])]
    return points


def _grid_count(params: Mapping[str, Param], sizes: Mapping[str, int]) -> int:
    """How many points the grid has, counted without listing them (past
    :data:`GRID_POINTS_LIMIT` it stops counting): the values of the parameters that conditions
    name are followed, the others only counted."""
    parents = {parent for p in params.values() for parent in (p.condition or {})}
    branches: dict[tuple[tuple[str, Any], ...], int] = {(): 1}  # the parents' values so far: how many points
    for name, p in params.items():
        grown: dict[tuple[tuple[str, Any], ...], int] = {}
        for branch, count in branches.items():
            if not space.is_active(p, dict(branch)):
                grown[branch] = grown.get(branch, 0) + count
            elif name in parents:
                for value in space.grid_values(name, p):
                    key = (*branch, (name, value))
                    grown[key] = grown.get(key, 0) + count
            else:
                grown[branch] = grown.get(branch, 0) + count * sizes[name]
        branches = grown
        if sum(branches.values()) > GRID_POINTS_LIMIT:
            break
    return sum(branches.values())


def _grid_too_large(sizes: dict[str, int]) -> InputError:
    """The refusal of a grid past :data:`GRID_POINTS_LIMIT`, naming the fewest parameters,
    largest first, whose numbers of values multiply past it."""
    named: list[str] = []
    for name in sorted(sizes, key=sizes.__getitem__, reverse=True):
        named.append(name)
        if math.prod(sizes[n] for n in named) > GRID_POINTS_LIMIT:
            break
    field = f"parameters.{named[0]}" if len(named) == 1 else "parameters"
    over = " × ".join(f"{name} ({sizes[name]:,} values)" for name in named)
    fix = "give it a larger step or fewer choices" if len(named) == 1 else "give them larger steps or fewer choices"
    return InputError(f"{field}: a grid over {over} has more than the {GRID_POINTS_LIMIT:,} points a grid design "
                      f"may have; {fix}, or use method monte_carlo, sobol or lhs")


def csv_points(scenario: Scenario) -> list[Point]:
    """The points of the design CSV's rows, in order (:func:`csv_rows`)."""
    return [point for _, point in csv_rows(scenario)]


def csv_rows(scenario: Scenario) -> list[tuple[int, Point]]:
    """Rows of the design CSV: the line each starts on and its point; every cell is
    validated before anything runs. A row's place in this list is its ``design_index``.

    The file is read as UTF-8, with or without a byte order mark (Excel's "CSV UTF-8"),
    whatever the locale; other encodings are refused. Blank lines are skipped. The header
    must name every free parameter (constants may be left out) and nothing else. A
    conditional parameter's cell must be empty when its condition does not hold.
    """
    path = Path(scenario.search.csv or "")
    if path.is_dir():
        raise InputError(f"search.csv: {path} is a folder; name the design CSV in it")
    if not path.is_file():
        raise InputError(f"search.csv: design file {path} not found")
    rows = _read_rows(path.name, utf8_text(path, save_as="CSV UTF-8"))
    if not rows:
        raise InputError(f"{path.name}: the design CSV is empty")
    header = [cell.strip() for cell in rows[0][1]]
    params = scenario.parameters
    unknown = [name for name in header if name not in params]
    if unknown:
        raise InputError(f"{path.name}: column {unknown[0]} is not a parameter of the scenario")
    repeated = [name for index, name in enumerate(header) if name in header[:index]]
    if repeated:
        raise InputError(f"{path.name}: column {repeated[0]} appears twice in the header")
    missing = [name for name in space.free_parameters(params) if name not in header]
    if missing:
        raise InputError(f"{path.name}: no column for parameter {missing[0]}")
    if len(rows) == 1:
        raise InputError(f"{path.name}: the design CSV has a header but no rows")
    points = []
    for line, row in rows[1:]:
        if len(row) != len(header):
            raise InputError(f"{path.name} line {line}: {_plural(len(row), 'value')} for "
                             f"{_plural(len(header), 'column')}")
        cells = dict(zip(header, row))
        values: Point = {}
        for name, p in params.items():
            if not space.is_active(p, values):
                given = cells.get(name, "").strip()
                if given:
                    raise InputError(f"{path.name} line {line}, column {name}: {given} given, but "
                                     f"{_inactive(name, p, values)}; leave the cell empty")
                continue
            text = cells.get(name, str(p.value) if p.type == "constant" else "")
            try:
                values[name] = space.coerce(name, p, text)
            except ValueError as exc:
                raise InputError(f"{path.name} line {line}, column {name}: {exc}") from None
        points.append((line, values))
    return points


def _read_rows(name: str, text: str) -> list[tuple[int, list[str]]]:
    """The CSV's rows that hold anything, each with the line it starts on."""
    reader = csv.reader(io.StringIO(text, newline=""))
    rows = []
    line = 1
    try:
        for row in reader:
            if any(cell.strip() for cell in row):
                rows.append((line, row))
            line = reader.line_num + 1
    except csv.Error as exc:
        raise InputError(f"{name} line {reader.line_num}: {exc}") from None
    return rows


def _inactive(name: str, p: Param, values: Point) -> str:
    """``mom is active only when opt is sgd (this row has opt=adam)``."""
    wanted = " and ".join(f"{parent} is {' or '.join(map(str, allowed if isinstance(allowed, list) else [allowed]))}"
                          for parent, allowed in (p.condition or {}).items())
    has = ", ".join(f"{parent}={values[parent]}" if parent in values else f"no {parent}" for parent in p.condition or {})
    return f"{name} is active only when {wanted} (this row has {has})"


def grid_order(scenario: Scenario) -> list[Point]:
    """The grid's points (:func:`grid_points`) in the order they run: a permutation seeded
    by ``search.seed`` alone, so every ``search.trials`` takes a prefix of one sequence."""
    points = grid_points(scenario)
    return [points[index] for index in _grid_permutation(scenario, len(points))]


def _grid_permutation(scenario: Scenario, size: int) -> list[int]:
    return [int(index) for index in np.random.default_rng(scenario.search.seed).permutation(size)]


def design_numbers(scenario: Scenario) -> list[int] | None:
    """The number (``design_index``) under which each point of :func:`design_points` is
    recorded: its place in the design; for a grid, its place in the grid's natural order
    (:func:`grid_points`), which names one point whatever the seed (and as studies begun
    before grids ran shuffled numbered it). None if model-based."""
    points = design_points(scenario)
    if points is None:
        return None
    if scenario.search.method != "grid":
        return list(range(len(points)))
    return _grid_permutation(scenario, len(grid_points(scenario)))[:len(points)]


def design_points(scenario: Scenario) -> list[Point] | None:
    """All points of the scenario's design, ``search.trials`` of them; None if model-based.

    A CSV design takes its first rows, a grid the first points of :func:`grid_order`.
    """
    method = scenario.search.method
    if method not in DESIGN_METHODS:
        return None
    wanted = scenario.search.trials
    if method in ("csv", "grid"):
        points = csv_points(scenario) if method == "csv" else grid_order(scenario)
        if wanted is not None and wanted > len(points):
            raise InputError(f"search.trials: {wanted} trials exceed the {_plural(len(points), 'point')} "
                             f"of the {method} design")
        return points[:wanted] if wanted else points
    assert wanted is not None
    free = space.free_parameters(scenario.parameters)
    units = _unit_points(method, wanted, len(free), scenario.search.seed)
    return [space.from_unit(scenario.parameters, row) for row in units]


def _plural(number: int, noun: str) -> str:
    """``1 point``, ``2 points``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def total_trials(scenario: Scenario) -> int:
    """The study's budget: ``search.trials``, or the number of CSV/grid points."""
    if scenario.search.trials is not None:
        return scenario.search.trials
    points = design_points(scenario)
    assert points is not None
    return len(points)
