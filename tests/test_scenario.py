"""Loading, validating and freezing the scenario YAML."""
from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest
from conftest import cli_env

from hpo import space
from hpo.errors import InputError
from hpo.launch import flag_args, plan_slots, uses_torchrun
from hpo.scenario import Objective, Resources, Search, load_scenario

WriteScenario = Callable[..., Path]
RunCli = Callable[..., "subprocess.CompletedProcess[str]"]


def _refusal(path: Path) -> str:
    """The one line that loading the scenario at ``path`` refuses it with."""
    with pytest.raises(InputError) as info:
        load_scenario(path)
    return str(info.value)


def test_valid_scenario_loads(scenario_path: Path) -> None:
    scenario = load_scenario(scenario_path)
    assert scenario.name == "demo"
    assert scenario.command == ("python", "train.py")
    assert list(scenario.parameters) == ["x", "opt"]
    assert scenario.parameters["x"].type == "float"
    assert scenario.parameters["opt"].choices == ("a", "b")
    assert scenario.search.method == "monte_carlo"
    assert scenario.search.trials == 2
    assert scenario.objective.held_out == ("test_error",)
    assert scenario.path == scenario_path.resolve()


def test_scenario_is_frozen(scenario_path: Path) -> None:
    scenario = load_scenario(scenario_path)
    with pytest.raises(pydantic.ValidationError):
        scenario.name = "other"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        scenario.search.trials = 9  # type: ignore[misc]


def test_paths_resolve_against_the_scenario_folder(tmp_path: Path, write_scenario: WriteScenario,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "project" / "scenarios"
    path = write_scenario(folder, template=["train.py.j2", "../extra/helper.py"], data_dir="../data",
                          workdir="out", search={"method": "csv", "csv": "design.csv", "trials": None})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    scenario = load_scenario(path)
    project = (tmp_path / "project").resolve()
    assert scenario.template == (project / "scenarios" / "train.py.j2", project / "extra" / "helper.py")
    assert scenario.data_dir == project / "data"
    assert scenario.workdir == project / "scenarios" / "out"
    assert scenario.search.csv == project / "scenarios" / "design.csv"
    assert scenario.folder == project / "scenarios"
    assert scenario.default_workdir() == project / "scenarios" / "out"


def test_relative_scenario_path_resolves_from_cwd(tmp_path: Path, write_scenario: WriteScenario,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    write_scenario(tmp_path / "sc")
    monkeypatch.chdir(tmp_path)
    scenario = load_scenario("sc/scenario.yaml")
    assert scenario.path == (tmp_path / "sc" / "scenario.yaml").resolve()
    assert scenario.template == ((tmp_path / "sc" / "train.py.j2").resolve(),)


def test_defaults(tmp_path: Path, write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path, drop=("objective", "resources", "search.seed"))
    scenario = load_scenario(path)
    assert scenario.syntax == "jinja"
    assert scenario.flags is False
    assert scenario.data_dir is None and scenario.workdir is None and scenario.storage is None
    assert scenario.env == {}
    assert scenario.search.seed == 1
    assert scenario.search.retry_failed == 0
    assert scenario.search.pruner == "none" and scenario.search.max_step is None
    assert scenario.objective == Objective(metric="val_error", direction="minimize", held_out=())
    assert scenario.resources == Resources(parallel=1, gpus_per_trial="auto", processes_per_trial=None, gpus=None,
                                           torchrun="auto", timeout=None, heartbeat=10.0, store_retry=300.0)
    assert scenario.default_workdir() == tmp_path.resolve() / "runs" / "demo"
    param = scenario.parameters["x"]
    assert (param.log, param.step, param.distribution, param.condition) == (False, None, "uniform", None)


@pytest.mark.parametrize("method", ["csv", "grid"])
def test_trials_optional_for_csv_and_grid(method: str) -> None:
    search = Search(method=method, csv=Path("/d.csv") if method == "csv" else None)
    assert search.trials is None


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        ("python train.py", ("python", "train.py")),
        ("python 'my script.py' --tag \"a b\"", ("python", "my script.py", "--tag", "a b")),
        (["python", "a b.py"], ("python", "a b.py")),
        ("./run.sh", ("./run.sh",)),
        ("python ~/x/train.py --out ~ --tag a~b", ("python", str(Path.home() / "x" / "train.py"), "--out",
                                                    str(Path.home()), "--tag", "a~b")),
        (["python", "~/as-given.py"], ("python", "~/as-given.py")),
    ],
)
def test_command_is_split_like_a_shell(tmp_path: Path, write_scenario: WriteScenario, command: Any,
                                       argv: tuple[str, ...]) -> None:
    assert load_scenario(write_scenario(tmp_path, command=command)).command == argv


@pytest.mark.parametrize(
    ("gpus_per_trial", "torchrun", "expected"),
    [(1, "auto", False), (2, "auto", True), (1, True, True), (4, False, False), (0.5, "auto", False)],
)
def test_uses_torchrun(gpus_per_trial: Any, torchrun: Any, expected: bool) -> None:
    resources = Resources(gpus_per_trial=gpus_per_trial, torchrun=torchrun)
    slot, *_ = plan_slots(resources, (0, 1, 2, 3), cpu_count=4)
    assert uses_torchrun(resources, slot) is expected


@pytest.mark.parametrize(("resources", "expected"), [
    ({"gpus_per_trial": 2}, (2, 2)),
    ({"gpus_per_trial": 2, "torchrun": False}, (2, 1)),
    ({"processes_per_trial": 3, "torchrun": False}, (3, 1)),
    ({"processes_per_trial": 3, "torchrun": True}, (3, 3)),
    ({"gpus_per_trial": 0.5, "torchrun": False}, (1, 1)),
])
def test_without_torchrun_a_trial_is_one_process(resources: dict[str, Any], expected: tuple[int, int]) -> None:
    assert Resources(**resources).gpus_and_processes == expected


def test_a_bound_on_processes_per_trial_leaves_room_for_more_ranks_than_cores() -> None:
    assert Resources(processes_per_trial=1024).processes_per_trial == 1024
    assert Resources(gpus_per_trial=64).gpus_and_processes == (64, 64)


def test_conditions_and_constants_load(tmp_path: Path, write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path, parameters={
        "momentum": {"type": "float", "low": 0.0, "high": 0.9, "condition": {"opt": "a"}},
        "beta": {"type": "float", "low": 0.0, "high": 0.9, "condition": {"opt": ["a", "b"]}},
        "epochs": {"type": "constant", "value": 3},
    })
    params = load_scenario(path).parameters
    assert params["momentum"].condition == {"opt": "a"}
    assert params["beta"].condition == {"opt": ["a", "b"]}
    assert params["epochs"].value == 3


def test_a_number_written_1e_3_is_a_number(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """YAML 1.1 reads 1e-3 (no dot) as a string: a learning-rate choice was '1e-3' in some
    trials and 0.01 in others, and [1e-3, 0.001] were two choices."""
    text = write_scenario(tmp_path).read_text()
    path = tmp_path / "scenario.yaml"
    path.write_text(text.replace("parameters:\n", "parameters:\n  lr: {type: categorical, choices: [1e-3, 0.01, 1.0e-4]}\n"
                                                   "  k: {type: constant, value: -2E+5}\n"))
    params = load_scenario(path).parameters
    assert params["lr"].choices == (0.001, 0.01, 0.0001) and params["k"].value == -200000.0
    path.write_text(text.replace("parameters:\n", "parameters:\n  lr: {type: categorical, choices: [1e-3, 0.001]}\n"))
    with pytest.raises(InputError, match="parameters.lr.choices"):
        load_scenario(path)


def _p(name: str, **spec: Any) -> dict[str, Any]:
    """Overrides that set (or merge into) parameter ``name``."""
    return {"parameters": {name: spec}}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"nmae": "x"}, "nmae: unknown key (did you mean name?)"),
        ({"search": {"trails": 3}}, "search.trails: unknown key (did you mean trials?)"),
        (_p("x", hihg=2), "parameters.x.hihg: unknown key (did you mean high?)"),
        (_p("x", low=2.0), "parameters.x.low: 2 is above high 1"),
        (_p("x", log=True), "parameters.x.low: a log-scaled parameter needs low > 0"),
        (_p("x", step=-1), "parameters.x.step: must be positive"),
        (_p("x", log=True, low=0.1, step=0.1), "parameters.x.step: a log-scaled"),
        (_p("x", low=0, high=1, step=0.3),
         "parameters.x.step: 0.3 does not divide the range [0, 1] (high 0.9 or 1.2 would)"),
        (_p("x", low=0.1, high=0.75, step=0.1),
         "parameters.x.step: 0.1 does not divide the range [0.1, 0.75] (high 0.7 or 0.8 would)"),
        (_p("n", type="int", low=16, high=256, step=100),
         "parameters.n.step: 100 does not divide the range [16, 256] (high 216 or 316 would)"),
        (_p("n", type="int", low=0.5, high=3), "parameters.n.low: an int parameter needs a whole"),
        (_p("n", type="int", low=9007199254740993, high=9007199254740995),
         "parameters.n.low: whole numbers from 2**53 on are not held exactly"),
        (_p("n", type="int", low=1), "parameters.n.high: an int parameter needs low and high"),
        (_p("c", type="categorical", choices=["a", "a"]), "parameters.c.choices: 'a' is listed twice"),
        (_p("c", type="categorical", choices=["a"], low=0), "parameters.c.low: only int and float"),
        (_p("c", type="constant"), "parameters.c.value: a constant parameter needs a value"),
        (_p("x", value=3), "parameters.x.value: only a constant parameter has a value"),
        (_p("x", distribution="normal", mean=0.5), "parameters.x.std: distribution normal needs"),
        (_p("x", distribution="normal", mean=0.5, std=0), "parameters.x.std: must be positive"),
        (_p("x", mean=0.5), "parameters.x.mean: only distribution normal takes"),
        (_p("x", low=float("nan")), "parameters.x.low: .nan is not a finite number"),
        (_p("x", low=True, high=2), "parameters.x.low: true is not a number"),
        ({"resources": {"timeout": True}}, "resources.timeout: true is not a number"),  # was a 1 s timeout
        ({"resources": {"heartbeat": False}}, "resources.heartbeat: false is not a number"),
        ({"command": "torchrun --nproc-per-node 2 train.py"},
         "command: it starts torchrun itself, and hpo starts each trial's processes"),
        ({"command": "python -m torch.distributed.launch train.py"},
         "command: it starts python -m torch.distributed.launch itself"),
        (_p("x", high=float("inf")), "parameters.x.high: .inf is not a finite number"),
        (_p("x", step=float("nan")), "parameters.x.step: .nan is not a finite number"),
        (_p("n", type="int", low=0, high=float("inf")), "parameters.n.high: .inf is not a finite number"),
        (_p("c", type="categorical", choices=["a", float("nan")]), "parameters.c.choices.1: .nan is not a finite"),
        (_p("c", type="categorical", choices=[None, 1]),
         "parameters.c.choices.0: null is not a number, a string or true/false"),
        (_p("c", type="constant", value=[1, 2]), "parameters.c.value: [1, 2] is not a number, a string or true/false"),
        (_p("y", type="float", low=0, high=1, condition={"opt": [None]}),
         "parameters.y.condition.opt: [null] is not a number, a string, true/false or a list of them"),
        (_p("seed", type="int", low=0, high=3), "parameters.seed: the name is reserved"),
        (_p("y", type="float", low=0, high=1, condition={"x": 0.5}), "x is not categorical"),
        (_p("y", type="float", low=0, high=1, condition={"opt": "z"}), "'z' is not a choice of opt"),
        (_p("y", type="float", low=0, high=1, condition={"opt": []}),
         "parameters.y.condition.opt: an empty list holds for no value of opt, so y would never be searched"),
        ({"parameters": {"n": {"type": "categorical", "choices": [1, 2]},
                         "y": {"type": "float", "low": 0, "high": 1, "condition": {"n": True}}}},
         "parameters.y.condition: true is not a choice of n ([1, 2])"),
        ({"parameters": {"m": {"type": "categorical", "choices": ["b", "c"], "condition": {"opt": "a"}},
                         "y": {"type": "float", "low": 0, "high": 1, "condition": {"opt": "b", "m": "c"}}}},
         "parameters.y.condition: it can never hold: its parents' own conditions want other values"),
        ({"name": "bad name!"}, "name: 'bad name!' is not a study name: a letter or digit, then letters"),
        ({"seed_flag": "seed"}, "seed_flag: 'seed' is not a flag: - or -- and a letter or digit"),
        ({"parameters": {"x": {"type": "float", "low": 0, "high": 1, "flag": "--l r"}}}, "parameters.x.flag: '--l r' is not a flag: "),
        ({"command": "python 'unclosed"}, "command: cannot split the command"),
        ({"command": []}, "command: the command is empty"),
        ({"search": {"method": "grid", "csv": "d.csv"}}, "search.csv: only method csv reads a CSV"),
        ({"search": {"trials": 0}}, "search.trials: Input should be greater than or equal to 1"),
        ({"objective": {"direction": "up"}}, "objective.direction: Input should be 'minimize' or 'maximize'"),
        ({"resources": {"gpus": [0, 0]}}, "resources.gpus: GPU ids must be unique"),
        ({"resources": {"timeout": 0}}, "resources.timeout: Input should be greater than 0"),
        ({"path": "x"}, "path: unknown key"),
        ({"search": {"seed": -1}}, "search.seed: Input should be greater than or equal to 0"),
        ({"search": {"seed": 2**32}}, "search.seed: Input should be less than or equal to 2147483647"),
        ({"env": {"A=B": "x"}}, "env: 'A=B' is not an environment variable name"),
        ({"env": {"": "x"}}, "env: '' is not an environment variable name"),
        ({"resources": {"parallel": True}}, ("resources.parallel: expected a whole number of trials at once (1 or "
                                             "more) or auto, got true")),
        ({"resources": {"torchrun": "maybe"}}, "resources.torchrun: expected auto, true or false, got maybe"),
        ({"search": {"retry_failed": True}}, "search.retry_failed: Input should be a valid integer"),
        ({"search": {"pruner": "median", "max_step": 10}},
         "search.max_step: only pruner hyperband reads max_step, but pruner is median"),
        ({"search": {"max_step": 10}}, "search.max_step: only pruner hyperband reads max_step, but pruner is none"),
        ({"search": {"pruner": "hyperband", "max_step": 0}}, "search.max_step: Input should be greater than or equal"),
        ({"search": {"pruner": "hyperband", "max_step": 2.5}}, "search.max_step: Input should be a valid integer"),
        ({"resources": {"gpus": [-1]}}, "resources.gpus.0: Input should be greater than or equal to 0"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env.CUDA_VISIBLE_DEVICES: hpo sets it for each trial"),
        ({"env": {"HPO_SLOT": "1"}}, "env.HPO_SLOT: hpo sets it for each trial"),
        ({"env": {"HPO_GPUS": "0"}}, "env.HPO_GPUS: hpo reads it from its own environment, not from a trial's"),
        ({"env": {"HPO_DEBUG": "1"}}, "env.HPO_DEBUG: hpo reads it from its own environment, not from a trial's"),
        ({"resources": {"gpus_per_trial": "auto", "processes_per_trial": 100000}},
         "resources.processes_per_trial: 100000 processes per trial; a trial runs at most 1024"),
        ({"resources": {"gpus_per_trial": 5000}},
         "resources.gpus_per_trial: 5000 GPUs (processes) per trial; a trial runs at most 1024"),
        ({"env": {1: "x"}}, "env: the name 1 is not a string: YAML reads yes/no, on/off"),
        ({"parameters": {True: {"type": "float", "low": 0, "high": 1}}},
         "parameters: the name true is not a string: YAML reads true/false, null and numbers unquoted"),
        ({"data_dir": " "}, "data_dir: the path is empty"),
        ({"template": ["train.py.j2", ""]}, "template: the path is empty"),
        ({"flags": True, **_p("y", type="float", low=0, high=1, flag="--x")},
         "parameters.y: its flag --x is also the flag of x; a trial would get both"),
        ({"flags": True, "flag_style": "-name", "seed_flag": "-x"}, "seed_flag: -x is also the flag of x"),
        ({"objective": {"held_out": "test_error"}},
         "objective.held_out: expected a list of metric names, got 'test_error'"),
        (_p("opt", choices="sgd"), "parameters.opt.choices: expected a list of values, got 'sgd'"),
        ({"resources": {"gpus": 0}}, "resources.gpus: expected a list of GPU ids, got 0"),
        ({"template": 5}, "template: expected a path or a list of paths, got 5"),
        ({"command": 5}, "command: expected a command line or a list of its arguments, got 5"),
        ({"resources": {"cluster": {"kind": "slurm", "cores": 1, "memory": "1GB", "setup": "module load x"}}},
         "resources.cluster.setup: expected a list of shell lines, got 'module load x'"),
        ({"search": "sobol"}, "search: expected a mapping of keys, got 'sobol'"),
        ({"parameters": {"x": 5}}, "parameters.x: expected a mapping of keys, got 5"),
        ({"parameters": ["x", "opt"]}, "parameters: expected a mapping of keys, got [x, opt]"),
        ({"env": "A=1"}, "env: expected a mapping of keys, got 'A=1'"),
    ],
)
def test_invalid_scenarios_name_the_field(tmp_path: Path, write_scenario: WriteScenario,
                                          overrides: dict[str, Any], expected: str) -> None:
    path = write_scenario(tmp_path, **overrides)
    message = _refusal(path)
    assert message.startswith("scenario.yaml: ")
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("spec", [
    {"type": "float", "low": 0.0, "high": 0.3, "step": 0.1},
    {"type": "float", "low": 1e-4, "high": 0.5, "step": 1e-4},
    {"type": "float", "low": -3, "high": 3, "step": 1},
    {"type": "float", "low": 0.5, "high": 0.5, "step": 0.2},
    {"type": "int", "low": 10, "high": 28, "step": 6},
])
def test_steps_that_divide_the_range_pass_and_optuna_keeps_them(tmp_path: Path, write_scenario: WriteScenario,
                                                                spec: dict[str, Any]) -> None:
    """A step accepted here is one Optuna takes as it is: no warning, the same high."""
    params = load_scenario(write_scenario(tmp_path, parameters={"x": spec})).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distribution = space.distributions(params)["x"]
    assert distribution.high == spec["high"]


def test_empty_parameters_is_an_error(tmp_path: Path, write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path, drop=("parameters.x", "parameters.opt"))
    with pytest.raises(InputError, match="parameters: the scenario defines no parameter"):
        load_scenario(path)


def test_parameters_whose_conditions_exclude_each_other_may_share_a_flag(tmp_path: Path,
                                                                           write_scenario: WriteScenario) -> None:
    shared = {"type": "float", "low": 0, "high": 1, "flag": "--lr"}
    path = write_scenario(tmp_path, parameters={"a": {**shared, "condition": {"opt": "a"}},
                                                "b": {**shared, "condition": {"opt": ["b"]}}})
    assert load_scenario(path).parameters["b"].flag == "--lr"
    overlapping = write_scenario(tmp_path, parameters={"a": {**shared, "condition": {"opt": "a"}},
                                                       "b": {**shared, "condition": {"opt": ["a", "b"]}}})
    with pytest.raises(InputError, match="parameters.b: its flag --lr is also the flag of a"):
        load_scenario(overlapping)


def test_a_path_may_start_with_the_home_folder(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path, data_dir="~/hpo-data"))
    assert scenario.data_dir == Path.home().resolve() / "hpo-data"


def test_env_numbers_are_their_text(tmp_path: Path, write_scenario: WriteScenario) -> None:
    scenario = load_scenario(write_scenario(tmp_path, env={"OMP_NUM_THREADS": 4, "LR_SCALE": 0.5}))
    assert scenario.env == {"OMP_NUM_THREADS": "4", "LR_SCALE": "0.5"}
    with pytest.raises(InputError, match="env.FLAG: true is not text"):
        load_scenario(write_scenario(tmp_path, env={"FLAG": True}))


def test_a_list_or_a_mapping_is_asked_for_in_the_users_terms(tmp_path: Path, write_scenario: WriteScenario,
                                                               run_cli: RunCli) -> None:
    """YAML has lists and mappings; the message never speaks of tuples or dictionaries."""
    for overrides, line in [
        ({"objective": {"held_out": "test_error"}},
         "objective.held_out: expected a list of metric names, got 'test_error'"),
        ({"parameters": {"opt": {"choices": "sgd"}}}, "parameters.opt.choices: expected a list of values, got 'sgd'"),
    ]:
        result = run_cli("validate", write_scenario(tmp_path, **overrides), cwd=tmp_path)
        assert (result.returncode, result.stderr) == (2, f"error: scenario.yaml: {line}\n")


def test_template_is_optional(tmp_path: Path, write_scenario: WriteScenario, run_cli: RunCli) -> None:
    """A scenario may run a script it does not copy (an absolute path); without ``template``
    the trial folder holds no file of the user's, and the command check says so."""
    script = tmp_path / "elsewhere" / "train.py"
    script.parent.mkdir()
    script.write_text("from hpo.results import report\nreport(val_error=0.5)\n")
    path = write_scenario(tmp_path, drop=("template",), template_text=None, command=f"python {script}")
    assert load_scenario(path).template == ()
    assert run_cli("validate", path, cwd=tmp_path).returncode == 0
    result = run_cli("validate", write_scenario(tmp_path, drop=("template",), template_text=None), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: scenario.yaml: command: train.py is neither a file of the trial folder"), result.stderr


@pytest.mark.parametrize(("data", "line", "byte"), [
    (b"name: caf\xe9\n", 1, "0xe9"),
    (b"# ok\nname: demo\n\xff\xfe", 3, "0xff"),
])
def test_a_scenario_that_is_not_utf8_names_the_file_and_line(tmp_path: Path, data: bytes, line: int,
                                                             byte: str) -> None:
    path = tmp_path / "lat.yaml"
    path.write_bytes(data)
    assert _refusal(path) == f"lat.yaml line {line}: not UTF-8 text (byte {byte}); save it as UTF-8"


def test_a_utf8_scenario_and_template_run_under_an_ascii_locale(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Scenario files and templates are UTF-8 (with or without a byte order mark) whatever the
    locale: under LANG=C without Python's UTF-8 coercion, validate said ok and run died on a
    bare UnicodeDecodeError (exit 1) reading the scenario again for the study."""
    path = write_scenario(tmp_path, template_text="# café\nprint('val_error=0.5 test_error=0.5')\n")
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes() + "# the café's sweep\n".encode())
    assert load_scenario(path).name == "demo"
    env = {**cli_env(), "LC_ALL": "C", "LANG": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    for command in ("validate", "run"):
        done = subprocess.run([sys.executable, "-m", "hpo", command, str(path)], env=env, capture_output=True,
                              text=True, errors="replace", timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "2/2 trials done: 2 complete." in done.stdout


def test_a_folder_for_the_scenario_is_called_a_folder(tmp_path: Path, write_scenario: WriteScenario) -> None:
    assert _refusal(tmp_path) == f"{tmp_path} is a folder; name the scenario file in it"
    path = write_scenario(tmp_path)
    assert _refusal(tmp_path) == f"{tmp_path} is a folder; name the scenario file in it, e.g. {path}"
    with pytest.raises(InputError, match="nope.yaml: scenario file not found"):
        load_scenario(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("low", "high", "step"), [(0.2, 0.3, 0.1), (0.8, 0.9, 0.1), (0.1, 0.3, 0.2)])
def test_a_step_as_wide_as_its_range_is_one_step(tmp_path: Path, write_scenario: WriteScenario,
                                                  low: float, high: float, step: float) -> None:
    """0.3 - 0.2 is 0.09999999999999998 in binary: the step 0.1 was called wider than the range."""
    path = write_scenario(tmp_path, parameters={"x": {"type": "float", "low": low, "high": high, "step": step}})
    assert load_scenario(path).parameters["x"].step == step


def test_1e_3_outside_the_parameters_stays_as_written(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """Read as a number everywhere, 1e-3 broke a command's --wd 1e-3 (not a string) and passed
    env EPS: 1e-8 as 1e-08."""
    path = write_scenario(tmp_path)
    path.write_text(path.read_text().replace("command: python train.py", "command: [python, train.py, --wd, 1e-3]")
                    + "env: {EPS: 1e-8, X: 1E5}\n")
    scenario = load_scenario(path)
    assert scenario.command == ("python", "train.py", "--wd", "1e-3")
    assert dict(scenario.env) == {"EPS": "1e-8", "X": "1E5"}


def _with_lines(path: Path, parameters: str = "", extra: str = "") -> Path:
    """``path`` (a scenario written by ``write_scenario``) with YAML lines as written added to its
    parameters and at its end (``yaml.safe_dump`` would quote ``yes`` or ``010``)."""
    path.write_text(path.read_text().replace("parameters:\n", f"parameters:\n{parameters}") + extra)
    return path


def test_the_parameters_are_read_as_yaml_1_2_reads_them(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """YAML 1.1 read 010 as eight, 1_000 as 1000 and [yes, no] as a switch; outside the
    parameters it still reads (flags: yes is true)."""
    path = _with_lines(write_scenario(tmp_path), parameters=(
        "  width: {type: categorical, choices: [010, 020, 0o17, 0x1f, -7]}\n"
        "  act: {type: categorical, choices: [yes, no, on, 'off']}\n"
        "  b: {type: categorical, choices: [True, FALSE]}\n"
        "  k: {type: constant, value: 1_000}\n"
        "  day: {type: constant, value: 2001-01-01}\n"
        "  lr: {type: categorical, choices: [.5, 1e3, -2E-1, 1.]}\n"
        "  m: {type: float, low: 0, high: 1, log: no, condition: {act: yes}}\n"
        "  on: {type: constant, value: 3}\n"), extra="flags: yes\n")
    scenario = load_scenario(path)
    params = scenario.parameters
    assert params["width"].choices == (10, 20, 15, 31, -7)
    assert params["act"].choices == ("yes", "no", "on", "off")
    assert params["b"].choices == (True, False)
    assert (params["k"].value, params["day"].value, params["on"].value) == ("1_000", "2001-01-01", 3)
    assert params["lr"].choices == (0.5, 1000.0, -0.2, 1.0)
    assert params["m"].condition == {"act": "yes"} and params["m"].log is False
    assert scenario.flags is True
    assert flag_args(scenario, {"act": "yes", "width": 10}) == ["--act", "yes", "--width", "10"]


@pytest.mark.parametrize(("choices", "expected"), [
    ("[true, True]", "parameters.c.choices: true is listed twice, as YAML reads the values"),
    ("[0x10, 16]", "parameters.c.choices: 16 is listed twice, as YAML reads the values"),
    ("[1, 1.0]", "parameters.c.choices: 1 and 1.0 compare equal"),
])
def test_choices_that_yaml_reads_alike_say_so(tmp_path: Path, write_scenario: WriteScenario, choices: str,
                                              expected: str) -> None:
    path = _with_lines(write_scenario(tmp_path), parameters=f"  c: {{type: categorical, choices: {choices}}}\n")
    assert _refusal(path).startswith(f"scenario.yaml: {expected}")


@pytest.mark.parametrize(("text", "line", "anchor"), [
    ("a: &a [*a]\n", 1, "a"),
    ("name: demo\nparameters:\n  x: &a {type: categorical,\n    choices: [*a]}\n", 4, "a"),
    ("name: demo\nenv: &e {A: *e}\n", 2, "e"),
    ("name: demo\nparameters: &p\n  x: {<<: *p}\n", 3, "p"),
])
def test_an_alias_inside_its_own_node_names_the_file_and_line(tmp_path: Path, text: str, line: int,
                                                               anchor: str) -> None:
    """PyYAML builds such a loop, and hpo recursed through it until a RecursionError (exit code 1)."""
    path = tmp_path / "loop.yaml"
    path.write_text(text)
    assert _refusal(path) == (f"loop.yaml line {line}: the alias *{anchor} refers to itself (it lies inside the "
                               f"node &{anchor} names)")


@pytest.mark.parametrize(("value", "expected"), [
    ("true", ("env.WANDB_SILENT: true is not text (YAML reads true/false, yes/no and on/off unquoted as "
              "true/false); quote it, e.g. 'true'")),
    ("yes", "env.WANDB_SILENT: true is not text"),
    ("off", "env.WANDB_SILENT: false is not text"),
    ("~", ("env.WANDB_SILENT: null is not text (YAML reads ~, null and nothing unquoted as null); quote it, or "
           "write ''")),
    ("2001-01-01", "env.WANDB_SILENT: 2001-01-01 is not text (YAML reads it unquoted as a date); quote it"),
    ("[1, 2]", "env.WANDB_SILENT: env values are text, not a list ([1, 2])"),
    ("{a: 1}", "env.WANDB_SILENT: env values are text, not a mapping ({a: 1})"),
])
def test_an_env_value_that_is_not_text_says_to_quote_it(tmp_path: Path, write_scenario: WriteScenario, value: str,
                                                         expected: str) -> None:
    path = _with_lines(write_scenario(tmp_path), extra=f"env: {{WANDB_SILENT: {value}}}\n")
    assert _refusal(path).startswith(f"scenario.yaml: {expected}")
    path = _with_lines(write_scenario(tmp_path), extra=f"env: {{WANDB_SILENT: '{value}', N: 4}}\n")
    assert load_scenario(path).env == {"WANDB_SILENT": value, "N": "4"}


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                  "TORCHELASTIC_RUN_ID", "PET_NNODES"])
def test_env_leaves_a_trials_place_in_a_distributed_job_to_torchrun(tmp_path: Path, write_scenario: WriteScenario,
                                                                     name: str) -> None:
    """report() prints on rank 0 only: env RANK: '1' failed every trial with "val_error was never reported"."""
    assert _refusal(write_scenario(tmp_path, env={name: "1"})).startswith(f"scenario.yaml: env.{name}: torchrun sets it for each trial process; ")
    assert load_scenario(write_scenario(tmp_path, env={"NCCL_DEBUG": "INFO", "RANKING": "1"})).env["RANKING"] == "1"


SLURM = {"kind": "slurm", "cores": 4, "memory": "16GB"}


@pytest.mark.parametrize(("cluster", "expected"), [
    ({**SLURM, "address": "tcp://head:8786"},
     "resources.cluster: address and kind exclude each other: give address for a running Dask scheduler, or kind"),
    ({**SLURM, "walltime": "abc"}, ("resources.cluster.walltime: expected a slurm time limit (MM, MM:SS, "
                                    "HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS), got 'abc'")),
    ({**SLURM, "walltime": "2h"}, "resources.cluster.walltime: expected a slurm time limit"),
    ({**SLURM, "kind": "pbs", "walltime": "1-00:00"}, ("resources.cluster.walltime: expected a pbs time limit "
                                                       "(HH:MM:SS, MM:SS or seconds), got '1-00:00'")),
    ({**SLURM, "kind": "lsf", "walltime": "02:00:00"}, "resources.cluster.walltime: expected a lsf time limit"),
    ({**SLURM, "walltime": 7200}, "resources.cluster.walltime: got the number 7200; quote the walltime"),
])
def test_a_cluster_says_what_is_wrong_with_it(tmp_path: Path, write_scenario: WriteScenario,
                                              cluster: dict[str, Any], expected: str) -> None:
    assert _refusal(write_scenario(tmp_path, resources={"cluster": cluster})).startswith(f"scenario.yaml: {expected}")


@pytest.mark.parametrize(("kind", "walltimes"), [
    ("slurm", ["30", "30:00", "02:00:00", "1-12", "1-12:30", "1-12:30:00"]),
    ("pbs", ["3600", "60:00", "01:00:00"]),
    ("sge", ["3600", "01:00:00"]),
    ("lsf", ["90", "1:30"]),
])
def test_the_walltimes_each_batch_system_takes_pass(tmp_path: Path, write_scenario: WriteScenario, kind: str,
                                                    walltimes: list[str]) -> None:
    for walltime in walltimes:
        cluster = {**SLURM, "kind": kind, "walltime": walltime}
        assert load_scenario(write_scenario(tmp_path, resources={"cluster": cluster})).resources.cluster.walltime \
            == walltime


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_program_that_lost_its_execute_bit_is_bad_input(tmp_path: Path, write_scenario: WriteScenario,
                                                            run_cli: RunCli, command: str) -> None:
    """validate said ok and run spent the budget: every trial failed 'Permission denied'."""
    path = write_scenario(tmp_path, template=["run.sh"], command="./run.sh",
                          files={"run.sh": "#!/bin/sh\necho val_error=0.3\n"})
    (tmp_path / "run.sh").chmod(0o644)
    result = run_cli(command, path, cwd=tmp_path)
    said = ("error: scenario.yaml: command: program ./run.sh is not executable (it lacks the execute bit): chmod +x "
            "the file, or run it with its interpreter (sh ./run.sh)\n")
    assert (result.returncode, result.stderr) == (2, said)
    assert not list(tmp_path.glob("runs/*/trial-*"))
    (tmp_path / "run.sh").chmod(0o755)
    assert run_cli("validate", path, cwd=tmp_path).returncode == 0


def test_a_command_that_launches_itself_may_under_torchrun_false(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """torchrun in the command, under hpo's own torchrun, ran each trial as two 2-rank jobs
    that reported every metric twice; with torchrun: false the command launches itself."""
    path = write_scenario(tmp_path, command="/usr/bin/torchrun --nproc-per-node 2 train.py",
                          resources={"torchrun": False})
    assert load_scenario(path).command[0] == "/usr/bin/torchrun"
