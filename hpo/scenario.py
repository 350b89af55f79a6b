"""The scenario YAML: loaded, validated and frozen.

:func:`load_scenario` is the only way in. It reads the file as UTF-8 (whatever the locale)
and returns a :class:`Scenario` whose paths are absolute (resolved against the scenario
file's folder) or raises :class:`InputError` with one line naming the field path (or the
file and line) and what is wrong. Unknown keys, keys given twice in one mapping, and an alias
inside the node it names are errors. Plain values inside ``parameters`` are read as YAML 1.2
reads them, elsewhere as YAML 1.1 (:class:`UniqueKeyLoader`).
"""
from __future__ import annotations

import difflib
import itertools
import math
import os
import re
import shlex
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from hpo.errors import InputError
from hpo.files import utf8_text
from hpo.results import RESERVED_ATTRS, STEP_KEY

DESIGN_METHODS = ("monte_carlo", "csv", "grid", "sobol", "lhs")
MODEL_METHODS = ("tpe", "gp", "smac")
PRUNERS = ("none", "median", "successive_halving", "hyperband")
SEED_MAX = 2**31 - 1  # a seed plus a trial number or a worker's pid stays a legal NumPy seed (below 2**32)
Scalar = bool | int | float | str


def _not_a_switch(value: Any) -> Any:
    """``value`` unless it is true or false, which a number field refuses (pydantic reads them as 1 and 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{yaml_text(value)} is not a number")  # noqa: TRY004 (pydantic reports a ValueError)
    return value


Number = Annotated[float, BeforeValidator(_not_a_switch)]
"""A number: YAML's true and false are not 1 and 0 here (``timeout: true`` was a 1 s timeout)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Param(_Frozen):
    """One hyper-parameter: its type, range or choices, and optional condition. Every number
    in it is finite: a NaN equals no value, itself included, and an infinite range has no
    uniform draw."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    type: Literal["int", "float", "categorical", "constant", "bool"]
    low: Number | None = None
    high: Number | None = None
    log: bool = False
    step: Number | None = None
    choices: tuple[Scalar, ...] | None = None
    value: Scalar | None = None
    distribution: Literal["uniform", "normal"] = "uniform"
    mean: Number | None = None
    std: Number | None = None
    condition: dict[str, Scalar | list[Scalar]] | None = None
    flag: str | None = Field(default=None, pattern=r"^-{1,2}[A-Za-z0-9][\w.\-]*$")

    @model_validator(mode="before")
    @classmethod
    def _bool_is_categorical(cls, data: Any) -> Any:
        """``type: bool`` is a categorical parameter with the choices ``[false, true]``."""
        if isinstance(data, dict) and data.get("type") == "bool":
            if "choices" in data:
                raise ValueError("choices: a bool parameter's choices are false and true")
            data = {**data, "type": "categorical", "choices": [False, True]}
        return data

    @model_validator(mode="after")
    def _check(self) -> Param:
        numeric = self.type in ("int", "float")
        _only(self, "low/high/log/step/distribution", numeric,
              ("low", "high", "step", "mean", "std"), ("log", "distribution"))
        if numeric:
            _check_numeric(self)
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("choices: a categorical parameter needs a non-empty list")
            twins = [(a, b) for i, b in enumerate(self.choices) for a in self.choices[:i] if a == b]
            if twins:
                a, b = twins[0]
                if repr(a) == repr(b):
                    raise ValueError(f"choices: {_shown(a)} is listed twice, as YAML reads the values (1e-3 and 0.001, "
                                     "0x10 and 16, true and True are one value); keep one")
                raise ValueError(f"choices: {yaml_text(a)} and {yaml_text(b)} compare equal, so a trial's value "
                                 "cannot tell them apart; keep one")
        elif self.choices is not None:
            raise ValueError(f"choices: only a categorical parameter has choices, not {self.type}")
        if self.type == "constant" and self.value is None:
            raise ValueError("value: a constant parameter needs a value")
        if self.type != "constant" and self.value is not None:
            raise ValueError(f"value: only a constant parameter has a value, not {self.type}")
        return self

    @property
    def is_normal(self) -> bool:
        """Whether values are drawn from a clipped normal distribution (designs only)."""
        return self.distribution == "normal"


def yaml_text(value: Any) -> str:
    """``value`` as YAML writes it (``true``, ``1``, ``1.0``, ``'a'``)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def _only(param: Param, what: str, allowed: bool, fields: tuple[str, ...],
          flags: tuple[str, ...]) -> None:
    if allowed:
        return
    for name in fields:
        if getattr(param, name) is not None:
            raise ValueError(f"{name}: only int and float parameters take {name}")
    if param.log:
        raise ValueError("log: only int and float parameters can be log-scaled")
    if param.distribution != "uniform":
        raise ValueError("distribution: only int and float parameters take a distribution")


LARGEST_EXACT_INT = 2**53  # every whole number below it is a float exactly (YAML's and Optuna's numbers)


def _check_numeric(p: Param) -> None:
    if p.low is None or p.high is None:
        raise ValueError(f"{'low' if p.low is None else 'high'}: an {p.type} parameter needs low and high")
    if p.low > p.high:
        raise ValueError(f"low: {p.low:g} is above high {p.high:g}")
    if p.type == "int":
        for name in ("low", "high", "step"):
            value = getattr(p, name)
            if value is not None and float(value) != int(value):
                raise ValueError(f"{name}: an int parameter needs a whole number, got {value:g}")
            if value is not None and abs(value) >= LARGEST_EXACT_INT:
                raise ValueError(f"{name}: whole numbers from 2**53 on are not held exactly (YAML and the study "
                                 f"read them as floats); keep it within ±{LARGEST_EXACT_INT - 1}")
    if p.log and p.low <= 0:
        raise ValueError(f"low: a log-scaled parameter needs low > 0, got {p.low:g}")
    if p.step is not None:
        if p.step <= 0:
            raise ValueError(f"step: must be positive, got {p.step:g}")
        if p.log:
            raise ValueError("step: a log-scaled parameter cannot have a step")
        if p.high > p.low and Decimal(str(p.step)) > Decimal(str(p.high)) - Decimal(str(p.low)):  # as written:
            raise ValueError(f"step: {p.step:g} is wider than the range [{p.low:g}, {p.high:g}]")  # 0.3 - 0.2 < 0.1
        highs = _highs_on_step(p.low, p.high, p.step)
        if highs is not None:
            raise ValueError(f"step: {p.step:g} does not divide the range [{p.low:g}, {p.high:g}] "
                             f"(high {highs[0]:.12g} or {highs[1]:.12g} would)")
    if p.is_normal:
        if p.mean is None or p.std is None:
            raise ValueError(f"{'mean' if p.mean is None else 'std'}: distribution normal needs mean and std")
        if p.std <= 0:
            raise ValueError(f"std: must be positive, got {p.std:g}")
        if p.log:
            raise ValueError("log: a normal distribution cannot be log-scaled")
    elif p.mean is not None or p.std is not None:
        raise ValueError(f"{'mean' if p.mean is not None else 'std'}: only distribution normal takes mean and std")


def _highs_on_step(low: float, high: float, step: float) -> tuple[float, float] | None:
    """The highs on either side of ``high`` that whole steps from ``low`` reach, or None when
    ``high`` is one. Decimal arithmetic on the numbers as written, as Optuna's own test (which
    otherwise warns and moves ``high`` down)."""
    d_low, d_high, d_step = (Decimal(str(value)) for value in (low, high, step))
    below = d_low + (d_high - d_low) // d_step * d_step
    return None if below == d_high else (float(below), float(below + d_step))


class Search(_Frozen):
    """How trials are proposed, how many the study holds in total, and how trials are pruned.

    ``max_step`` is the last step a trial reports (its epochs, reported once each): Hyperband's
    maximum resource, which sets its brackets (see :func:`hpo.samplers.make_pruner`).
    """

    method: Literal["monte_carlo", "csv", "grid", "sobol", "lhs", "tpe", "gp", "smac"] = "monte_carlo"
    trials: StrictInt | None = Field(default=None, ge=1)
    seed: StrictInt = Field(default=1, ge=0, le=SEED_MAX)
    csv: Path | None = None
    retry_failed: StrictInt = Field(default=0, ge=0)
    pruner: Literal["none", "median", "successive_halving", "hyperband"] = "none"
    max_step: StrictInt | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> Search:
        if self.max_step is not None and self.pruner != "hyperband":
            raise ValueError(f"max_step: only pruner hyperband reads max_step, but pruner is {self.pruner}")
        if self.method == "csv" and self.csv is None:
            raise ValueError("csv: method csv needs the path of the design CSV")
        if self.method != "csv" and self.csv is not None:
            raise ValueError(f"csv: only method csv reads a CSV, but method is {self.method}")
        if self.trials is None and self.method not in ("csv", "grid"):
            raise ValueError(f"trials: method {self.method} needs the total number of trials")
        return self


class Objective(_Frozen):
    """The metric the optimizer sees, its direction, the held-out metrics it never sees, and how to read them.

    ``patterns`` read metrics from a script's own output: a regular expression with one group
    per metric (the objective or a held-out one), the last match wins. After a match of
    ``step_pattern`` (one group: the step, a whole number), each objective value, a match of
    its pattern or a built-in format's line without ``step``, is also an intermediate value
    at that step. ``post_process`` is a command run in the trial folder after the script; its
    output is parsed too (see :mod:`hpo.results`).
    """

    metric: str = "val_error"
    direction: Literal["minimize", "maximize"] = "minimize"
    held_out: tuple[str, ...] = ()
    patterns: dict[str, str] = Field(default_factory=dict)
    step_pattern: str | None = None
    post_process: tuple[str, ...] | None = None

    @field_validator("metric")
    @classmethod
    def _metric_named(cls, metric: str) -> str:
        if not metric.strip():
            raise ValueError("the objective needs the name of a metric, not an empty one")
        _not_reserved(metric)
        return metric

    @field_validator("held_out")
    @classmethod
    def _held_out_named(cls, held_out: tuple[str, ...]) -> tuple[str, ...]:
        for name in held_out:
            if not name.strip():
                raise ValueError("a held-out metric needs a name, not an empty one")
            _not_reserved(name)
        repeated = sorted({name for name in held_out if held_out.count(name) > 1})
        if repeated:
            raise ValueError(f"{repeated[0]} is listed twice")
        return held_out

    @field_validator("patterns")
    @classmethod
    def _patterns_compile(cls, patterns: dict[str, str]) -> dict[str, str]:
        for name, pattern in patterns.items():
            problem = _one_group_problem(pattern)
            if problem:
                raise ValueError(f"{name}: {problem}")
        return patterns

    @field_validator("step_pattern")
    @classmethod
    def _step_pattern_compiles(cls, pattern: str | None) -> str | None:
        problem = _one_group_problem(pattern) if pattern is not None else None
        if problem:
            raise ValueError(problem)
        return pattern

    @field_validator("post_process", mode="before")
    @classmethod
    def _split_post_process(cls, value: Any) -> Any:
        return _shell_split(value)

    @model_validator(mode="after")
    def _check(self) -> Objective:
        if self.metric in self.held_out:
            raise ValueError(f"held_out: {self.metric} is the objective metric; it cannot be held out")
        known = (self.metric, *self.held_out)
        for name in self.patterns:
            if name not in known:
                raise ValueError(f"patterns: {name!r} is neither the objective metric ({self.metric}) nor a held-out "
                                 f"metric ({', '.join(self.held_out) or 'none'})")
        return self


RESULTS_LEADING, RESULTS_TRAILING = ("number", "state"), ("duration_s", "folder", "reason", "repeat_of", "note")
"""The fixed columns of the results CSV (``hpo export``), before and after the parameters' and
the metrics' own, which have a column each under their own names."""
RESULTS_COLUMNS = RESULTS_LEADING + RESULTS_TRAILING
"""Every fixed column: no parameter or metric may take one of these names."""


def _column_problem(name: str, what: str) -> str | None:
    """Why ``name`` cannot name a column of the results CSV (``what`` it names: a parameter or
    a metric), or None."""
    if name in RESULTS_COLUMNS:
        return f"{name!r} is a column of the results CSV ({', '.join(RESULTS_COLUMNS)}); rename the {what}"
    return None


def _not_reserved(name: str) -> None:
    """Raise ValueError where a metric's name is one that hpo itself records or writes."""
    if name == STEP_KEY:
        raise ValueError(f"{STEP_KEY} marks a metric line as an intermediate report; give the metric another name")
    if name in RESERVED_ATTRS:
        raise ValueError(f"{name} is a name hpo records on every trial ({', '.join(sorted(RESERVED_ATTRS))}); "
                         f"give the metric another name")
    problem = _column_problem(name, "metric")
    if problem:
        raise ValueError(problem)


def _one_group_problem(pattern: str) -> str | None:
    """What is wrong with a metric pattern (not a regular expression, not exactly one group), or None."""
    try:
        groups = re.compile(pattern).groups
    except re.error as exc:
        return f"not a regular expression ({exc})"
    if groups != 1:
        return (f"needs exactly one group, the (...) around the number, found {groups}; "
                f"write other parentheses as (?:...)")
    return None


def _shell_split(value: Any) -> Any:
    """Split a command string like a shell would, a word that starts with ``~/`` (or is
    ``~``) expanded to the home folder as a shell does; refuse an empty command. A list is the
    argument list as it is."""
    if isinstance(value, str):
        try:
            value = [os.path.expanduser(word) if word == "~" or word.startswith("~/") else word
                     for word in shlex.split(value)]
        except ValueError as exc:
            raise ValueError(f"cannot split the command: {exc}") from None
    if isinstance(value, (list, tuple)) and not value:
        raise ValueError("the command is empty")
    return value


GpuCount = int | float | Literal["auto"]
MAX_SHARE = 16
MAX_PROCESSES = 1024
"""The most processes (GPUs) one trial may ask for: more is a typo, not a job for one machine."""


def gpu_share(value: float) -> int | None:
    """``k`` when ``value`` is within 2 % of a fraction ``1/k`` with k = 2..16, else None."""
    if not 0 < value < 1:
        return None
    k = round(1 / value)
    return k if 2 <= k <= MAX_SHARE and abs(value - 1 / k) <= 0.02 / k else None


_SCHEDULER_ADDRESS = re.compile(r"(?:(?:tcp|tls|ucx|ws|wss)://)?(?:\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}")


WALLTIMES = {
    "slurm": (r"\d+(?::\d{1,2}){0,2}|\d+-\d{1,2}(?::\d{1,2}){0,2}", "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"),
    "pbs": (r"\d+(?::\d{1,2}){0,2}", "HH:MM:SS, MM:SS or seconds"),
    "sge": (r"\d+(?::\d{1,2}){0,2}", "HH:MM:SS, MM:SS or seconds"),
    "lsf": (r"\d+(?::\d{1,2})?", "HH:MM or minutes"),
}
"""The time limits each batch system takes (``resources.cluster.walltime``), and how to write
them; HTCondor jobs have none (:func:`hpo.jobqueue.job_options` refuses one)."""


class Cluster(_Frozen):
    """Where trials run when they leave this machine (``resources.cluster``): a Dask scheduler
    at ``address``, or Dask workers that dask-jobqueue starts as batch jobs of ``kind``.

    The batch keys are dask-jobqueue's names where it has them: ``jobs`` is the most jobs at
    once (hpo scales them to the work left), ``cores``, ``memory``, ``walltime``, ``queue``
    and ``account`` describe one job, ``gpus`` the GPUs it asks for (its worker offers them
    as the Dask resource ``GPU``), ``job_extra`` are extra scheduler directives, ``setup``
    shell lines run before the worker starts (activate the environment) and ``interface``
    the network interface (e.g. ``ib0``) of the workers and of the scheduler ``hpo run``
    starts; ``disk`` the scratch disk an HTCondor job asks for (HTCondor only, and required).
    """

    address: str | None = None
    kind: Literal["slurm", "pbs", "sge", "lsf", "htcondor"] | None = None
    jobs: int = Field(default=1, ge=1)
    cores: int | None = Field(default=None, ge=1)
    memory: str | None = None
    gpus: int = Field(default=0, ge=0)
    walltime: str | None = None
    queue: str | None = None
    account: str | None = None
    job_extra: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    interface: str | None = None
    disk: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), list(cls.model_fields), n=1)
                    hint = f"did you mean {close[0]}?" if close else f"allowed: {', '.join(cls.model_fields)}"
                    raise ValueError(f"{key}: unknown key ({hint})")
        return data

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and not _SCHEDULER_ADDRESS.fullmatch(value):
            raise ValueError(f"expected a Dask scheduler address such as tcp://10.0.0.5:8786 "
                             f"([tcp|tls|ucx|ws|wss://]HOST:PORT), got {value!r}")
        return value

    @field_validator("walltime", mode="before")
    @classmethod
    def _walltime_text(cls, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # a ValueError, which pydantic reports
            raise ValueError(f"got the number {yaml_text(value)}; quote the walltime, e.g. '02:00:00' "  # noqa: TRY004
                             "(YAML reads 2:00:00 unquoted as the number 7200)")
        return value

    @field_validator("memory", "disk")
    @classmethod
    def _amount(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"\d+(\.\d+)?\s*([KMGTP]i?B?|B)?", value.strip()):
            raise ValueError(f"expected an amount such as 16GB or 64 GiB, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check(self) -> Cluster:
        if self.address is not None and self.kind is not None:
            raise ValueError("address and kind exclude each other: give address for a running Dask scheduler, "
                             "or kind (and the jobs' keys) for batch jobs that hpo starts")
        if (self.address is None) == (self.kind is None):
            raise ValueError("expected a Dask scheduler address (tcp://host:8786) or a mapping with kind: "
                             "slurm, pbs, sge, lsf or htcondor")
        if self.kind is not None:
            for key in ("cores", "memory"):
                if getattr(self, key) is None:
                    raise ValueError(f"{key}: required for batch jobs (kind {self.kind})")
            if (self.kind == "htcondor") != (self.disk is not None):
                raise ValueError("disk: required for HTCondor jobs" if self.disk is None
                                 else f"disk: only HTCondor jobs ask for disk, not {self.kind} jobs")
            forms = WALLTIMES.get(self.kind)
            if self.walltime is not None and forms is not None and not re.fullmatch(forms[0], self.walltime.strip()):
                raise ValueError(f"walltime: expected a {self.kind} time limit ({forms[1]}), got {self.walltime!r}")
        else:
            given = sorted(self.model_fields_set - {"address"})
            if given:
                raise ValueError(f"{given[0]}: describes batch jobs (with kind), not a Dask cluster at an address")
        return self


class Resources(_Frozen):
    """Task slots on this machine, what each trial owns, and the limits of a trial.

    ``gpus_per_trial`` is a whole number of GPUs, a fraction ``1/k`` (k trials share a
    GPU, one process each) or ``auto`` (one GPU per process, as many processes as
    ``processes_per_trial`` asks for and the machine has GPUs); either asks for at most
    :data:`MAX_PROCESSES`. ``torchrun: false`` starts one process per trial, whatever its
    GPUs. ``parallel: auto`` runs as many trials at once as the GPUs (or, without GPUs, the
    CPU cores) allow.

    ``cluster`` runs the trials on a Dask cluster instead (see :class:`Cluster`; a string is
    its address); ``parallel`` then counts the trials at once on the whole cluster (unset
    or ``auto``: as many as its workers take).
    """

    parallel: StrictInt | Literal["auto"] = 1
    gpus_per_trial: GpuCount = "auto"
    processes_per_trial: StrictInt | None = Field(default=None, ge=1)
    gpus: tuple[Annotated[StrictInt, Field(ge=0)], ...] | None = None
    torchrun: bool | Literal["auto"] = "auto"
    timeout: Number | None = Field(default=None, gt=0)
    heartbeat: Number = Field(default=10.0, gt=0)
    store_retry: Number = Field(default=300.0, ge=0)
    cluster: Cluster | None = None

    @field_validator("cluster", mode="before")
    @classmethod
    def _cluster_address(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"address": value}
        if value is not None and not isinstance(value, (dict, Cluster)):
            raise ValueError(f"expected a Dask scheduler address or a mapping with kind: slurm, ..., got {value!r}")
        return value

    @field_validator("gpus")
    @classmethod
    def _unique_gpus(cls, gpus: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if gpus is not None and len(set(gpus)) != len(gpus):
            raise ValueError("GPU ids must be unique")
        return gpus

    @field_validator("processes_per_trial")
    @classmethod
    def _processes_per_trial(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_PROCESSES:
            raise ValueError(f"{value} processes per trial; a trial runs at most {MAX_PROCESSES}")
        return value

    @field_validator("parallel", mode="before")
    @classmethod
    def _parallel(cls, value: Any) -> Any:
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"expected a whole number of trials at once (1 or more) or auto, got {yaml_text(value)}")
        return value

    @field_validator("torchrun", mode="before")
    @classmethod
    def _torchrun(cls, value: Any) -> Any:
        if value != "auto" and not isinstance(value, bool):
            raise ValueError(f"expected auto, true or false, got {yaml_text(value)}")
        return value

    @field_validator("gpus_per_trial", mode="before")
    @classmethod
    def _gpus_per_trial(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # a ValueError, which pydantic reports
            raise ValueError(f"expected a number of GPUs, a fraction 1/k or auto, got {value!r}")  # noqa: TRY004
        if float(value).is_integer() and value >= 1:
            if value > MAX_PROCESSES:
                raise ValueError(f"{value:g} GPUs (processes) per trial; a trial runs at most {MAX_PROCESSES}")
            return int(value)
        if gpu_share(float(value)) is None:
            raise ValueError(f"{value:g} is neither a whole number of GPUs nor a fraction 1/k with k = 2..16 "
                             "(0.5, 0.333, 0.25, 0.2, ... 0.0625) nor auto")
        return float(value)

    @model_validator(mode="after")
    def _check(self) -> Resources:
        share = self.share
        if share > 1 and self.torchrun is True:
            raise ValueError(f"gpus_per_trial: {self.gpus_per_trial:g} shares a GPU between trials, one process "
                             "each; torchrun: true would put several NCCL ranks on one GPU")
        if share > 1 and (self.processes_per_trial or 1) > 1:
            raise ValueError(f"processes_per_trial: a trial on a share of a GPU runs one process, "
                             f"not {self.processes_per_trial}")
        if isinstance(self.gpus_per_trial, int) and self.processes_per_trial not in (None, self.gpus_per_trial):
            raise ValueError(f"processes_per_trial: {self.processes_per_trial} differs from gpus_per_trial "
                             f"{self.gpus_per_trial} (one process per GPU); use gpus_per_trial: auto")
        return self

    @property
    def share(self) -> int:
        """How many trials share one GPU (``k`` of a fraction ``1/k``; 1 otherwise)."""
        value = self.gpus_per_trial
        return gpu_share(value) or 1 if isinstance(value, float) else 1

    @property
    def gpus_and_processes(self) -> tuple[int, int]:
        """GPUs and processes of one trial where there are GPUs enough: a share of a GPU is one
        (shared) GPU and one process, a whole number N is N of each, ``auto`` one GPU for each
        of ``processes_per_trial`` processes. Under ``torchrun: false`` a trial is one process
        (nothing starts more), whatever its GPUs. Without GPUs, the processes are CPU processes."""
        if self.share > 1:
            return 1, 1
        value = self.gpus_per_trial
        count = value if isinstance(value, int) else self.processes_per_trial or 1
        return count, 1 if self.torchrun is False else count


class Scenario(_Frozen):
    """A validated scenario. Paths are absolute; ``path`` is the scenario file itself."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    template: tuple[Path, ...] = ()
    syntax: Literal["jinja", "dollar"] = "jinja"
    command: tuple[str, ...]
    flags: bool = False
    flag_style: Literal["--name", "--name=value", "-name"] = "--name"
    seed_flag: str | None = Field(default=None, pattern=r"^-{1,2}[A-Za-z0-9][\w.\-]*$")
    data_dir: Path | None = None
    env: dict[str, str] = Field(default_factory=dict)
    parameters: dict[str, Param]
    search: Search
    objective: Objective = Objective()
    resources: Resources = Resources()
    workdir: Path | None = None
    storage: str | None = None
    path: Path

    @field_validator("template", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        return _shell_split(value)

    @field_validator("env", mode="before")
    @classmethod
    def _numbers_as_text(cls, value: Any) -> Any:
        """``env: {OMP_NUM_THREADS: 4}`` means the text ``4``; true/false stay an error."""
        if not isinstance(value, dict):
            return value
        return {key: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                for key, v in value.items()}

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        from hpo.launch import distributed  # hpo.launch imports this module

        if not self.parameters:
            raise ValueError("parameters: the scenario defines no parameter")
        names = list(self.parameters)
        for name in names:
            problem = _name_problem(name)
            if problem:
                raise ValueError(f"parameters.{name}: {problem}" if name else f"parameters: {problem}")
        reserved = {"trial_number", "trial_dir", "data_dir", "seed", "trial_seed"} & set(names)
        if reserved:
            raise ValueError(f"parameters.{min(reserved)}: the name is reserved for the template context")
        for key, value in self.env.items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ValueError(f"env: {key!r} is not an environment variable name and value "
                                 "(a name is not empty and holds no '=', neither holds a NUL)")
            if key in SET_BY_HPO:
                raise ValueError(f"env.{key}: hpo sets it for each trial{SET_BY_HPO[key]}")
            if key in READ_BY_HPO:
                raise ValueError(f"env.{key}: hpo reads it from its own environment, not from a trial's; "
                                 f"set it where hpo runs ({key}=... hpo run ...)")
            if distributed(key):
                raise ValueError(f"env.{key}: torchrun sets it for each trial process; one value for every trial "
                                 "would give each process a wrong place in a distributed job")
        launcher = _launcher(self.command)
        if launcher is not None and self.resources.torchrun is not False:
            raise ValueError(f"command: it starts {launcher} itself, and hpo starts each trial's processes (under "
                             "torchrun where a trial has several): give the script (python train.py) and set "
                             "resources.processes_per_trial, or set resources.torchrun: false to launch it yourself")
        _check_columns(self)
        _check_flags(self)
        for index, (name, param) in enumerate(self.parameters.items()):
            _check_condition(name, param, names[:index], self.parameters)
            if param.is_normal and self.search.method not in ("monte_carlo", "sobol", "lhs"):
                raise ValueError(f"parameters.{name}.distribution: normal is only for the designs "
                                 f"monte_carlo, sobol and lhs, not {self.search.method}")
        return self

    @property
    def folder(self) -> Path:
        """The folder of the scenario file; relative paths in it are resolved against it."""
        return self.path.parent

    def flag_of(self, name: str) -> str | None:
        """The flag that passes parameter ``name`` to the command: its own ``flag``, else, with
        ``flags: true``, its name in ``flag_style``; None if it is not passed as a flag."""
        param = self.parameters.get(name)
        if param is None or not (self.flags or param.flag):
            return None
        return param.flag or f"{'-' if self.flag_style == '-name' else '--'}{name}"

    def default_workdir(self) -> Path:
        """Where trial folders and the default store go: ``workdir`` or ``runs/<name>``."""
        return self.workdir or self.folder / "runs" / self.name


SET_BY_HPO = {"CUDA_VISIBLE_DEVICES": " from its slot's GPUs (resources.gpus chooses which GPUs hpo uses)",
              "HPO_TRIAL_TOKEN": "", "HPO_TRIAL_NUMBER": "", "HPO_TRIAL_DIR": "", "HPO_SLOT": ""}
"""Environment variables of a trial that hpo sets (a scenario's ``env`` may not), and why."""
READ_BY_HPO = ("HPO_GPUS", "HPO_DEBUG", "HPO_FAULTS")
"""Environment variables that hpo reads from its own environment: a scenario's ``env``, which
only trials see, may not set them."""


def _name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a parameter (it is a flag's name, a column of the results CSV and
    a template's variable), or None."""
    if not name:
        return "a parameter's name is empty (its flag would be --, its column of the results CSV blank); name it"
    if any(char.isspace() for char in name):
        return f"{name!r} holds whitespace, which would split its flag and its template variable; rename the parameter"
    if "=" in name:
        return f"{name!r} holds '=', which would end its flag's name (--{name}); rename the parameter"
    if name.startswith("-"):
        return f"{name!r} starts with '-', which its flag adds itself (--name); rename the parameter"
    return None


_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _launcher(command: tuple[str, ...]) -> str | None:
    """The distributed launcher that ``command`` starts (``torchrun``, ``python -m
    torch.distributed.run``), or None."""
    program = Path(command[0]).name
    if program == "torchrun":
        return "torchrun"
    if program.startswith("python"):
        module = next((arg for flag, arg in itertools.pairwise(command[1:]) if flag == "-m"), None)
        if module in _LAUNCHER_MODULES:
            return f"python -m {module}"
    return None


def _check_columns(scenario: Scenario) -> None:
    """Raise ValueError where a parameter's column of the results CSV would repeat the name of
    another column: a fixed one (:data:`RESULTS_COLUMNS`), the objective metric's or a held-out
    metric's (the metrics' own names are checked by :class:`Objective`)."""
    objective = scenario.objective
    metrics = {name: "a held-out metric" for name in objective.held_out} | {objective.metric: "the objective metric"}
    for name in scenario.parameters:
        problem = _column_problem(name, "parameter")
        if problem:
            raise ValueError(f"parameters.{name}: {problem}")
        if name in metrics:
            raise ValueError(f"parameters.{name}: {name!r} is also {metrics[name]}, and the results CSV has one "
                             "column per name; rename the parameter or the metric")


def _check_flags(scenario: Scenario) -> None:
    """Raise ValueError where two parameters, or a parameter and ``seed_flag``, would pass the
    same flag to one trial (parameters whose conditions exclude each other may share one)."""
    owners: dict[str, list[str]] = {}
    for name, param in scenario.parameters.items():
        flag = scenario.flag_of(name)
        if flag is not None:
            for other in owners.get(flag, []):
                if not _exclusive(param, scenario.parameters[other]):
                    raise ValueError(f"parameters.{name}: its flag {flag} is also the flag of {other}; "
                                     "a trial would get both")
            owners.setdefault(flag, []).append(name)
    if scenario.seed_flag in owners:
        raise ValueError(f"seed_flag: {scenario.seed_flag} is also the flag of {owners[scenario.seed_flag][0]}")


def _exclusive(a: Param, b: Param) -> bool:
    """Whether the conditions of ``a`` and ``b`` never hold together (one parent, no common value)."""
    def wanted(param: Param, parent: str) -> set[Any]:
        return set(_listed((param.condition or {})[parent]))
    shared = set(a.condition or {}) & set(b.condition or {})
    return any(not wanted(a, parent) & wanted(b, parent) for parent in shared)


def _check_condition(name: str, param: Param, earlier: list[str], params: dict[str, Param]) -> None:
    """Each parent of ``name``'s condition is an earlier categorical, each value wanted is one
    of its choices (``true`` is not the choice ``1``), and the condition can hold: not an empty
    list, nor values of a parameter that its parents' own conditions rule out."""
    for parent, wanted in (param.condition or {}).items():
        if parent not in earlier:
            raise ValueError(f"parameters.{name}.condition: {parent} must be a parameter defined before {name}")
        choices = params[parent].choices
        if choices is None:
            raise ValueError(f"parameters.{name}.condition: {parent} is not categorical")
        if wanted == []:
            raise ValueError(f"parameters.{name}.condition.{parent}: an empty list holds for no value of {parent}, "
                             f"so {name} would never be searched")
        for value in _listed(wanted):
            if _choice_key(value) not in {_choice_key(choice) for choice in choices}:
                raise ValueError(f"parameters.{name}.condition: {_shown(value)} is not a choice of {parent} "
                                 f"({yaml_text(list(choices))}){_bool_hint(value, choices)}")
    if _needs(name, params) is None:
        raise ValueError(f"parameters.{name}.condition: it can never hold: its parents' own conditions want other "
                         f"values of the parameters it names, so {name} would never be searched")


def _listed(wanted: Any) -> list[Any]:
    """The values a condition wants of one parameter: a list, or one value."""
    return wanted if isinstance(wanted, list) else [wanted]


def _choice_key(value: Any) -> tuple[bool, Any]:
    """A value as a condition compares it with a choice: ``true`` and ``1`` apart."""
    return isinstance(value, bool), value


def _needs(name: str, params: dict[str, Param]) -> dict[str, set[tuple[bool, Any]]] | None:
    """The values each parameter must take for ``name`` to be searched: its condition's and,
    through its parents, theirs; None where no value can do (two want disjoint values)."""
    needs: dict[str, set[tuple[bool, Any]]] = {}
    for parent, wanted in (params[name].condition or {}).items():
        inherited = _needs(parent, params)
        if inherited is None:
            return None
        for key, allowed in [(parent, {_choice_key(value) for value in _listed(wanted)}), *inherited.items()]:
            needs[key] = needs[key] & allowed if key in needs else allowed
            if not needs[key]:
                return None
    return needs


def _bool_hint(value: Any, choices: tuple[Any, ...]) -> str:
    """Why a condition's string such as ``'on'`` or ``'true'`` misses the choices true and false,
    or ``''``."""
    if isinstance(value, str) and any(isinstance(choice, bool) for choice in choices):
        return "; the choices true and false are not text: write true or false unquoted"
    return ""


_PATH_KEYS = ("template", "data_dir", "workdir")


def _resolve_paths(raw: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``raw`` with its paths absolute: ``~`` expanded, relative ones against ``folder``;
    InputError for an empty path."""
    def resolved(key: str, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if not value.strip():
            raise InputError(f"{key}: the path is empty")
        return str((folder / Path(value).expanduser()).resolve())

    out = dict(raw)
    for key in (key for key in _PATH_KEYS if key in out):
        value = out[key]
        out[key] = [resolved(key, v) for v in value] if isinstance(value, list) else resolved(key, value)
    search = out.get("search")
    if isinstance(search, dict) and "csv" in search:
        out["search"] = {**search, "csv": resolved("search.csv", search["csv"])}
    return out


def allowed_keys(model: type[BaseModel] | None) -> list[str]:
    """The keys ``model`` (a part of the scenario; None: none) may be given in a scenario file."""
    return [k for k in model.model_fields if k != "path"] if model else []


def _owner(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose field ``loc`` names (a parameter's spec is a :class:`Param`), or None."""
    parent = loc[:-1]
    return Param if len(parent) == 2 and parent[0] == "parameters" else _model_at(loc)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Scenario
    for part in loc[:-1]:
        if model is None:
            return None
        if model is Scenario and part == "parameters":
            model = None
            continue
        field = model.model_fields.get(str(part)) if model else None
        annotation = field.annotation if field else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model


_SCALAR_MEMBERS = ("bool", "int", "float", "str", "list[union[bool,int,float,str]]")
_MAPPING_TYPES = ("dict_type", "model_type")
_EXPECTED_LISTS = {
    "template": "a path or a list of paths",
    "command": "a command line or a list of its arguments",
    "post_process": "a command line or a list of its arguments",
    "held_out": "a list of metric names",
    "choices": "a list of values",
    "gpus": "a list of GPU ids",
    "job_extra": "a list of scheduler directives",
    "setup": "a list of shell lines",
}
"""What each list-valued key of a scenario takes, as a user writes it (YAML has no tuples)."""


def _shown(value: Any) -> str:
    """``value`` for a message: a string quoted, anything else as YAML writes it."""
    return repr(value) if isinstance(value, str) else yaml_text(value)


def _not_text(value: Any) -> str:
    """Why ``value``, an ``env`` value that YAML did not read as text (nor as a number), is refused."""
    if isinstance(value, (list, dict)):
        return f"env values are text, not a {'list' if isinstance(value, list) else 'mapping'} ({yaml_text(value)})"
    if isinstance(value, bool):
        return (f"{yaml_text(value)} is not text (YAML reads true/false, yes/no and on/off unquoted as true/false); "
                f"quote it, e.g. '{yaml_text(value)}'")
    if value is None:
        return "null is not text (YAML reads ~, null and nothing unquoted as null); quote it, or write ''"
    return f"{yaml_text(value)} is not text (YAML reads it unquoted as a {type(value).__name__}); quote it"


_FLAG_WORDS = "a flag: - or -- and a letter or digit, then letters, digits, _ . or - (no spaces), e.g. --lr"
_PATTERN_WORDS = {"flag": _FLAG_WORDS, "seed_flag": _FLAG_WORDS,
                  "name": "a study name: a letter or digit, then letters, digits, _ . or - (no spaces or slashes)"}


def _format_error(error: dict[str, Any]) -> str:
    loc = tuple(error["loc"])
    message: str = error["msg"]
    scalar = bool(loc) and loc[0] == "parameters" and loc[-1] in _SCALAR_MEMBERS  # a choice, constant or condition
    if scalar:  # name the value, not the union's member types
        loc = tuple(part for part in loc if part not in _SCALAR_MEMBERS)
    if scalar or error["type"] == "finite_number":
        value = error["input"]
        if isinstance(value, float) and not math.isfinite(value):
            message = f"{yaml_text(value)} is not a finite number"
        else:
            kinds = "a number, a string, true/false or a list of them" if "condition" in loc else \
                "a number, a string or true/false"
            message = f"{yaml_text(value)} is not {kinds}"
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
        head, sep, rest = message.partition(": ")
        if sep and head.isidentifier() and " " not in head:
            loc, message = loc + (head,), rest
    if loc and loc[-1] == "[key]":  # a mapping key that YAML read as a bool, a number or null
        words = "true/false" if loc[0] == "parameters" else "yes/no, on/off, true/false"
        loc, message = loc[:-2], (f"the name {yaml_text(error['input'])} is not a string: YAML reads {words}, "
                                  "null and numbers unquoted as such; quote the name")
    if len(loc) == 2 and loc[0] == "env" and error["type"] == "string_type":
        message = _not_text(error["input"])
    if error["type"] == "extra_forbidden":
        allowed = allowed_keys(_owner(loc))
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else f" (allowed: {', '.join(allowed)})"
        message = f"unknown key{hint}"
    elif error["type"] == "missing":
        message = "required key is missing"
    elif error["type"] == "tuple_type":
        message = f"expected {_EXPECTED_LISTS.get(str(loc[-1]), 'a list')}, got {_shown(error['input'])}"
    elif error["type"] in _MAPPING_TYPES:
        message = f"expected a mapping of keys, got {_shown(error['input'])}"
    elif error["type"] == "string_pattern_mismatch":
        message = f"{_shown(error['input'])} is not {_PATTERN_WORDS.get(str(loc[-1]), 'of the allowed form')}"
    path = ".".join(str(part) for part in loc if not (isinstance(part, str) and part.startswith("function-")))
    return f"{path}: {message}" if path else message


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping key given twice; ``problem`` is ``<dotted path>: defined twice (lines A and B)``
    (``(line A)`` for two on one line)."""


class AliasLoopError(yaml.composer.ComposerError):
    """An alias inside the node its anchor names (``a: &a [*a]``): a loop no scenario can hold;
    ``problem_mark`` is the alias."""


_CORE_INT_TAG = "tag:hpo:core-int"  # YAML 1.2's int: 010 is ten, 0o17 octal; YAML 1.1's 010 is eight
_CORE_SCHEMA = tuple((tag, re.compile(pattern)) for tag, pattern in (
    ("tag:yaml.org,2002:null", r"~|null|Null|NULL|"),
    ("tag:yaml.org,2002:bool", r"true|True|TRUE|false|False|FALSE"),
    (_CORE_INT_TAG, r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+"),
    ("tag:yaml.org,2002:float", (r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                 r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")),
    ("tag:yaml.org,2002:merge", r"<<"),  # not YAML 1.2's, but a merge works there as everywhere
))
"""How YAML 1.2's core schema reads a plain scalar: the first tag whose pattern matches it, else a string."""


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key given twice in one mapping, at any depth, with a
    :class:`DuplicateKeyError` (YAML forbids it; PyYAML would keep the last one silently), and
    an alias inside the node it names with an :class:`AliasLoopError`. Keys that a merge
    (``<<: *base``) brings in may still be overridden.

    Plain scalars inside the top-level ``parameters`` are read as YAML 1.2's core schema reads
    them (``1e-3`` and ``010`` are numbers, 0.001 and 10; ``yes``, ``on`` and ``1_000`` are
    text; only true/false in any case are booleans); elsewhere as PyYAML reads YAML 1.1 (a
    command's ``--wd 1e-3`` or an ``env`` value stays as written)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._paths: dict[yaml.Node, str] = {}
        self._depth = 0
        self._core = False
        self._open: list[str | None] = []

    def compose_node(self, parent: yaml.Node | None, index: yaml.Node | None) -> yaml.Node:
        """The node of the next event; the anchors of the nodes being composed are open, and
        an alias to one of them is an AliasLoopError."""
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self._open:
            raise AliasLoopError(problem=f"the alias *{event.anchor} refers to itself (it lies inside the node "
                                         f"&{event.anchor} names)", problem_mark=event.start_mark)
        core = self._core
        self._core = core or (self._depth == 1 and isinstance(index, yaml.ScalarNode) and index.value == "parameters")
        self._depth += 1
        self._open.append(event.anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._open.pop()
            self._depth -= 1
            self._core = core

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> str:
        """The tag of a node without one: inside ``parameters``, a plain scalar's by :data:`_CORE_SCHEMA`."""
        if self._core and kind is yaml.ScalarNode and implicit[0]:
            return next((tag for tag, pattern in _CORE_SCHEMA if pattern.fullmatch(value)), "tag:yaml.org,2002:str")
        return super().resolve(kind, value, implicit)

    def _child(self, node: yaml.Node, key: str) -> str:
        """The dotted path of ``key`` (a key or an index) in the mapping or list ``node``."""
        parent = self._paths.get(node)
        return f"{parent}.{key}" if parent else key

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """The mapping of ``node``; DuplicateKeyError where two of its own keys are equal."""
        lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            path = self._child(node, key_node.value if isinstance(key_node, yaml.ScalarNode) else yaml_text(key))
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key, which the base class refuses
                continue
            if first is not None:
                where = f"line {line}" if first == line else f"lines {first} and {line}"
                raise DuplicateKeyError(problem=f"{path}: defined twice ({where})", problem_mark=key_node.start_mark)
            lines[key] = line
            self._paths[value_node] = path
        return super().construct_mapping(node, deep=deep)

    def construct_sequence(self, node: yaml.SequenceNode, deep: bool = False) -> list[Any]:
        """The list of ``node``; its items' paths end in their index."""
        for index, item in enumerate(node.value):
            self._paths[item] = self._child(node, str(index))
        return super().construct_sequence(node, deep=deep)


def _construct_core_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    base = {"0o": 8, "0x": 16}.get(text[:2], 10)
    return int(text if base == 10 else text[2:], base)


UniqueKeyLoader.add_constructor(_CORE_INT_TAG, _construct_core_int)


def _example_in(folder: Path) -> str:
    """``, e.g. FOLDER/x.yaml`` for the first YAML file of ``folder``, or ``''``."""
    try:
        first = min((entry for entry in folder.iterdir() if entry.suffix in (".yaml", ".yml") and entry.is_file()),
                    default=None)
    except OSError:
        return ""
    return f", e.g. {first}" if first else ""


def load_scenario(path: str | Path) -> Scenario:
    """Read, validate and freeze the scenario at ``path`` (see the module docstring)."""
    file = Path(path)
    if file.is_dir():
        raise InputError(f"{path} is a folder; name the scenario file in it{_example_in(file)}")
    if not file.is_file():
        raise InputError(f"{path}: scenario file not found")
    try:
        raw = yaml.load(utf8_text(file), Loader=UniqueKeyLoader)
    except DuplicateKeyError as exc:
        raise InputError(f"{file.name}: {exc.problem}") from None
    except AliasLoopError as exc:
        raise InputError(f"{file.name} line {exc.problem_mark.line + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InputError(f"{file.name}{where}: not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{file.name}: a scenario is a YAML mapping of keys, got {type(raw).__name__}")
    if "path" in raw:
        raise InputError(f"{file.name}: path: unknown key")
    try:
        return Scenario(**_resolve_paths(raw, file.resolve().parent), path=file.resolve())
    except InputError as exc:
        raise InputError(f"{file.name}: {exc}") from None
    except ValidationError as exc:
        errors = exc.errors()  # an unknown key first: a typo in it explains a key that is missing
        first = next((error for error in errors if error["type"] == "extra_forbidden"), errors[0])
        raise InputError(f"{file.name}: {_format_error(first)}") from None
    except TypeError as exc:
        raise InputError(f"{file.name}: {exc}") from None
