"""Launching trials: argument lists, task slots with fake GPUs, and the process tree's lifetime."""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hpo import cli, launch
from hpo.errors import ExecutorUnavailable, InputError
from hpo.launch import (
    GPU_ENV,
    TOKEN_ENV,
    Slot,
    build_argv,
    check_command,
    detect_gpus,
    env_threads,
    flag_args,
    gpu_ids,
    kill_by_token,
    plan_slots,
    run_process,
    trial_env,
    usable_cores,
    uses_torchrun,
)
from hpo.scenario import Resources, Scenario

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]


def scenario(command: list[str], values: dict[str, Any], flags: bool = False, **fields: Any) -> Scenario:
    """A scenario whose parameters are ``values``' names, each a parameter of the value's type."""
    def param(value: Any) -> dict[str, Any]:
        if isinstance(value, bool):
            return {"type": "bool"}
        if isinstance(value, (int, float)):
            return {"type": "int" if isinstance(value, int) else "float", "low": 0, "high": 1000}
        return {"type": "categorical", "choices": [value]}

    params = {name: {**param(value), **fields.pop(f"{name}_param", {})} for name, value in values.items()}
    return Scenario(name="s", command=command, flags=flags, parameters=params or {"x": param(1.0)},
                    search={"method": "tpe", "trials": 1}, path=Path("/s/s.yaml"), **fields)


@pytest.mark.parametrize(
    ("command", "params", "flags", "processes", "torchrun", "expected"),
    [
        pytest.param(["python", "train.py"], {"lr": 0.1}, False, 1, False, [sys.executable, "train.py"],
                     id="python-is-this-interpreter"),
        pytest.param(["python3", "-u", "train.py"], {}, False, 1, False, [sys.executable, "-u", "train.py"],
                     id="python3"),
        pytest.param(["/usr/bin/python3", "train.py"], {}, False, 1, False, [sys.executable, "train.py"],
                     id="python-by-path"),
        pytest.param(["./run.sh", "--fast"], {"lr": 0.1}, False, 1, False, ["./run.sh", "--fast"],
                     id="not-python-kept"),
        pytest.param(["python", "train.py"], {"lr": 0.001, "opt": "adam", "units": 64, "bn": True}, True, 1, False,
                     [sys.executable, "train.py", "--lr", "0.001", "--opt", "adam", "--units", "64", "--bn"],
                     id="flags-appended-bool-a-switch"),
        pytest.param(["python", "train.py"], {"bn": False, "units": 3}, True, 1, False,
                     [sys.executable, "train.py", "--units", "3"], id="false-switch-absent"),
        pytest.param(["python", "train.py"], {"name": "two words", "path": "a b/c d"}, True, 1, False,
                     [sys.executable, "train.py", "--name", "two words", "--path", "a b/c d"],
                     id="flag-values-with-spaces-stay-one-item"),
        pytest.param(["python", "train.py", "--epochs", "3"], {"lr": 0.5}, True, 2, True,
                     [*TORCHRUN, "2", "--no-python", sys.executable, "train.py", "--epochs", "3", "--lr", "0.5"],
                     id="torchrun-python"),
        pytest.param(["python", "train.py"], {}, False, 4, True, [*TORCHRUN, "4", "--no-python", sys.executable,
                                                                  "train.py"], id="torchrun-no-flags"),
        pytest.param(["python", "-u", "-m", "pkg.train"], {}, False, 2, True,
                     [*TORCHRUN, "2", "--no-python", sys.executable, "-u", "-m", "pkg.train"],
                     id="torchrun-keeps-interpreter-options"),
        pytest.param(["./train.sh", "a b"], {"lr": 0.5}, True, 2, True,
                     [*TORCHRUN, "2", "--no-python", "./train.sh", "a b", "--lr", "0.5"],
                     id="torchrun-non-python-uses-no-python"),
        pytest.param(["trainer"], {}, False, 8, True, [*TORCHRUN, "8", "--no-python", "trainer"],
                     id="torchrun-executable"),
    ],
)
def test_build_argv(command: list[str], params: dict[str, Any], flags: bool, processes: int, torchrun: bool,
                    expected: list[str]) -> None:
    assert build_argv(scenario(command, params, flags), params, processes, torchrun) == expected


@pytest.mark.parametrize(("style", "expected"), [
    ("--name", ["--batch-size", "64", "--lr", "0.1", "--save-model", "--seed", "7"]),
    ("--name=value", ["--batch-size=64", "--lr=0.1", "--save-model", "--seed=7"]),
    ("-name", ["--batch-size", "64", "-lr", "0.1", "--save-model", "--seed", "7"]),
])
def test_flag_names_styles_switches_and_the_seed_flag(style: str, expected: list[str]) -> None:
    values = {"batch_size": 64, "lr": 0.1, "save_model": True}
    sc = scenario(["python", "main.py"], values, flags=True, flag_style=style, seed_flag="--seed",
                  batch_size_param={"flag": "--batch-size"}, save_model_param={"flag": "--save-model"})
    assert flag_args(sc, values, seed=7) == expected


def test_a_value_that_starts_with_a_dash_is_joined_to_a_long_flag() -> None:
    values = {"bias": -6.4e-05, "activation": "-x", "depth": -3, "lr": 0.1}
    sc = scenario(["python", "main.py"], values, flags=True)
    assert flag_args(sc, values) == ["--bias=-6.4e-05", "--activation=-x", "--depth=-3", "--lr", "0.1"]
    single = scenario(["./sim"], values, flags=True, flag_style="-name")  # a program's own parser may not split -a=b
    assert flag_args(single, values) == ["-bias", "-6.4e-05", "-activation", "-x", "-depth", "-3", "-lr", "0.1"]


def test_negative_values_reach_an_argparse_script_as_numbers() -> None:
    values = {"bias": -6.4e-05, "shift": -2.0}
    sc = scenario(["python", "main.py"], values, flags=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--bias", type=float)
    parser.add_argument("--shift", type=float)
    assert vars(parser.parse_args(flag_args(sc, values))) == values


def test_true_or_false_among_other_choices_is_a_value_not_a_switch() -> None:
    """A choice of [2, x, true, false] gave ``--cm`` alone (argparse: expected one argument) or nothing."""
    mixed = {"type": "categorical", "choices": [2, "x", True, False]}
    sc = scenario(["python", "main.py"], {"cm": "x"}, flags=True, cm_param=mixed)
    for value, expected in ((True, ["--cm", "true"]), (False, ["--cm", "false"]), (2, ["--cm", "2"])):
        assert flag_args(sc, {"cm": value}) == expected
    switch = scenario(["python", "main.py"], {"bn": True}, flags=True, bn_param={"type": "categorical",
                                                                                  "choices": [False, True]})
    assert flag_args(switch, {"bn": True}) == ["--bn"] and flag_args(switch, {"bn": False}) == []


def test_a_parameter_with_its_own_flag_is_passed_without_flags_true() -> None:
    values = {"batch_size": 64, "lr": 0.1}
    sc = scenario(["python", "main.py"], values, batch_size_param={"flag": "--batch-size"})
    assert flag_args(sc, values) == ["--batch-size", "64"]


@pytest.mark.parametrize(("command", "problem"), [
    (["python", "train.py"], None),
    (["python", "-m", "pkg.train"], None),
    (["python", "-u", "train.py"], None),
    ([sys.executable, "train.py", "--lr", "1"], None),
    (["sh", "-c", "true"], None),
    (["python", "trian.py"], ("command: trian.py is neither a file of the trial folder nor an existing path "
                              "(did you mean train.py?)")),
    (["python", "evaluate.py"], ("command: evaluate.py is neither a file of the trial folder nor an existing path "
                                 "(the trial folder holds train.py, helper.sh, sub/run.sh)")),
    (["no-such-program-xyz", "train.py"], "command: program no-such-program-xyz not found"),
    (["./helper.sh"], None),
    (["bash", "run.py"], "command: run.py is neither"),
    (["python", "-W", "ignore", "train.py"], None),
    (["python", "-X", "dev", "train.py"], None),
    (["python", "-X", "dev", "-u", "train.py"], None),
    (["python", "--check-hash-based-pycs", "never", "train.py"], None),
    (["python", "-uW", "ignore", "train.py"], None),
    (["python", "-Wignore", "-Xdev", "train.py"], None),
    (["python", "-W", "ignore", "trian.py"], "command: trian.py is neither"),
    (["python", "-uc", "print(1)"], None),
    (["bash", "-c", "python train.py"], None),
    (["bash", "-c", "python evaluate.py"], None),
    (["bash", "-e", "run.py"], "command: run.py is neither"),
    (["helper.sh"], "command: helper.sh is not on PATH; write ./helper.sh to run the trial folder's file"),
    (["./missing.sh"], "command: program ./missing.sh is neither a file of the trial folder nor an existing path"),
    (["sub/run.sh"], None),
    (["python", "../../outside.py"], ("command: ../../outside.py is neither a file of the trial folder nor an existing "
                                      "path; a script outside the trial folder is given by its absolute path")),
])
def test_check_command(command: list[str], problem: str | None) -> None:
    if problem is None:
        check_command(command, ["train.py", "helper.sh", "sub/run.sh"])
    else:
        with pytest.raises(InputError) as error:
            check_command(command, ["train.py", "helper.sh", "sub/run.sh"])
        assert str(error.value).startswith(problem)


def test_check_command_names_the_field() -> None:
    with pytest.raises(InputError, match=r"^objective.post_process: parse.py is not on PATH; write ./parse.py"):
        check_command(["parse.py"], ["parse.py"], field="objective.post_process")
    with pytest.raises(InputError, match=r"^objective.post_process: prase.py is neither .* \(did you mean parse.py\?\)"):
        check_command(["python", "prase.py"], ["parse.py"], field="objective.post_process")


def test_a_program_without_the_execute_bit_is_refused(tmp_path: Path) -> None:
    """A script that arrived without its execute bit passed the check, then every trial failed
    with 'cannot start ./run.sh: Permission denied'."""
    with pytest.raises(InputError, match=r"^command: program ./run.sh is not executable \(it lacks the execute bit\): "
                                         r"chmod \+x the file, or run it with its interpreter \(sh ./run.sh\)$"):
        check_command(["./run.sh"], ["run.sh"], unexecutable={"run.sh"})
    check_command(["sh", "./run.sh"], ["run.sh"], unexecutable={"run.sh"})
    check_command(["./run.sh"], ["run.sh", "other.sh"], unexecutable={"other.sh"})
    outside = tmp_path / "train.py"
    outside.write_text("print(1)\n")
    with pytest.raises(InputError, match=r"is not executable .*\(python .*train.py\)$"):
        check_command([str(outside)], [])
    outside.chmod(0o755)
    check_command([str(outside)], [])


def test_build_argv_does_not_change_its_input() -> None:
    command = ["python", "train.py"]
    sc = scenario(command, {"lr": 1.0}, True)
    build_argv(sc, {"lr": 1}, 2, True)
    assert sc.command == ("python", "train.py")


@pytest.mark.parametrize(
    ("resources", "gpus", "expected"),
    [
        pytest.param({"parallel": 2, "gpus_per_trial": 2}, (0, 1, 2, 3),
                     [((0, 1), 2), ((2, 3), 2)], id="4-gpus-2-per-trial"),
        pytest.param({"parallel": 4, "gpus_per_trial": 2}, (0, 1, 2, 3),
                     [((0, 1), 2), ((2, 3), 2)], id="parallel-capped-by-gpus"),
        pytest.param({"parallel": 4, "gpus_per_trial": 1}, (0, 1, 2, 3),
                     [((0,), 1), ((1,), 1), ((2,), 1), ((3,), 1)], id="one-gpu-each"),
        pytest.param({"parallel": 1, "gpus_per_trial": 2}, (0, 1, 2, 3), [((0, 1), 2)], id="fewer-slots"),
        pytest.param({"parallel": 2, "gpus_per_trial": 2}, (4, 5, 6), [((4, 5), 2)], id="odd-gpu-left-idle"),
        pytest.param({"parallel": 2, "gpus_per_trial": 1, "gpus": (6, 7)}, (),
                     [((6,), 1), ((7,), 1)], id="scenario-gpus-where-none-are-found"),
        pytest.param({"parallel": 2, "gpus_per_trial": 1, "gpus": (2, 3)}, (0, 1, 2, 3),
                     [((2,), 1), ((3,), 1)], id="scenario-gpus-a-subset"),
        pytest.param({"parallel": "auto", "gpus_per_trial": 2}, tuple(range(8)),
                     [((0, 1), 2), ((2, 3), 2), ((4, 5), 2), ((6, 7), 2)], id="auto-parallel-fills-gpus"),
        pytest.param({"parallel": "auto", "processes_per_trial": 2}, (0,), [((0,), 1)], id="auto-one-gpu"),
        pytest.param({"parallel": "auto", "processes_per_trial": 2}, (0, 1), [((0, 1), 2)], id="auto-two-gpus"),
        pytest.param({"parallel": "auto", "processes_per_trial": 2}, (0, 1, 2), [((0, 1), 2)], id="auto-three"),
    ],
)
def test_plan_slots_with_fake_gpus(resources: dict[str, Any], gpus: tuple[int, ...],
                                   expected: list[tuple[tuple[int, ...], int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GPU_ENV, raising=False)
    slots = plan_slots(Resources(**resources), gpus, cpu_count=16)
    assert [(slot.gpus, slot.processes) for slot in slots] == expected
    assert [slot.index for slot in slots] == list(range(len(expected)))
    owned = [gpu for slot in slots for gpu in slot.gpus]
    assert len(owned) == len(set(owned))
    assert all(slot.threads == 16 // (len(slots) * slot.processes) for slot in slots)


@pytest.mark.parametrize(("fraction", "parallel", "gpus", "expected"), [
    (0.5, 8, (0, 1), [(0,), (1,), (0,), (1,)]),
    (0.25, 8, (0,), [(0,)] * 4),
    (0.25, 3, (0, 1), [(0,), (1,), (0,)]),
    (0.333, "auto", (0, 1), [(0,), (1,)] * 3),
    (0.0625, "auto", (0,), [(0,)] * 16),
])
def test_fractional_gpus_pack_trials_onto_each_gpu(fraction: float, parallel: Any, gpus: tuple[int, ...],
                                                   expected: list[tuple[int, ...]]) -> None:
    slots = plan_slots(Resources(gpus_per_trial=fraction, parallel=parallel), gpus, cpu_count=16)
    assert [slot.gpus for slot in slots] == expected
    assert all(slot.processes == 1 and slot.share == round(1 / fraction) for slot in slots)
    assert "1 process on 1/" in slots[0].describe()


def test_fractions_on_a_cpu_machine_are_one_process_per_trial() -> None:
    slots = plan_slots(Resources(gpus_per_trial=0.5, parallel=2), (), cpu_count=8)
    assert slots == (Slot(0, (), 1, 4), Slot(1, (), 1, 4))


@pytest.mark.parametrize(("value", "message"), [
    (0.3, "0.3 is neither a whole number of GPUs nor a fraction 1/k"),
    (0.7, "0.7 is neither"), (1.5, "1.5 is neither"), (0.05, "0.05 is neither"), (0, "0 is neither"),
    ("two", "expected a number of GPUs, a fraction 1/k or auto"),
])
def test_bad_gpu_counts(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Resources(gpus_per_trial=value)


def test_a_fraction_cannot_be_forced_under_torchrun() -> None:
    with pytest.raises(ValueError, match="torchrun: true would put several NCCL ranks on one GPU"):
        Resources(gpus_per_trial=0.5, torchrun=True)


@pytest.mark.parametrize(
    ("parallel", "per_trial", "cpus", "threads"),
    [(2, 1, 8, 4), (1, 1, 8, 8), (2, 2, 8, 2), (4, 1, 2, 1), (3, 1, 16, 5)],
)
def test_plan_slots_on_cpu(parallel: int, per_trial: int, cpus: int, threads: int) -> None:
    slots = plan_slots(Resources(parallel=parallel, gpus_per_trial=per_trial), (), cpu_count=cpus)
    assert slots == tuple(Slot(i, (), per_trial, threads) for i in range(parallel))


@pytest.mark.parametrize(("workers", "cpus", "threads"), [(2, 2, 1), (4, 16, 4), (1, 8, 8)])
def test_workers_share_the_machine(workers: int, cpus: int, threads: int) -> None:
    slots = plan_slots(Resources(), (), cpu_count=cpus, at_least=workers)  # parallel left out
    assert len(slots) == workers and all(slot.threads == threads for slot in slots)


@pytest.mark.parametrize(("resources", "gpus", "error"), [
    ({"parallel": 2}, (), ("--workers 4: resources.parallel is 2, and each worker runs at least one trial at a time; "
                          "use --workers 2 or fewer, or raise resources.parallel")),
    ({"parallel": 2, "gpus_per_trial": 1}, (0, 1, 2, 3), "--workers 4: resources.parallel is 2"),
    ({}, (), ("--workers 4: hpo may run on 2 cores here, and each worker runs at least one trial at a time; use "
             "--workers 2 or fewer, or set resources.parallel to the trials to run at once")),
    ({"parallel": "auto"}, (), "--workers 4: hpo may run on 2 cores here"),
])
def test_workers_beyond_a_parallel_given_or_the_cores_are_refused(resources: dict[str, Any], gpus: tuple[int, ...],
                                                                  error: str) -> None:
    """hpo run --workers 4 ran 4 trials at once where the scenario said parallel: 2, and
    --workers 1000 on 2 cores planned 1000 slots (and logs), without a word."""
    with pytest.raises(InputError) as info:
        plan_slots(Resources(**resources), gpus, cpu_count=2, at_least=4)
    assert str(info.value).startswith(error), str(info.value)
    assert len(plan_slots(Resources(parallel=4), (), cpu_count=2, at_least=4)) == 4  # asked for: as given


def test_more_workers_than_cpus_get_a_slot_each_under_parallel_auto() -> None:
    slots = plan_slots(Resources(parallel="auto", processes_per_trial=2), (), cpu_count=2, at_least=2)
    assert [(slot.processes, slot.threads) for slot in slots] == [(2, 1), (2, 1)]


def test_the_main_job_on_zero_one_and_two_gpus() -> None:
    main_job = Resources(parallel="auto", gpus_per_trial="auto", processes_per_trial=2)
    cpu, = plan_slots(main_job, (), cpu_count=2)
    assert (cpu.gpus, cpu.processes, cpu.threads) == ((), 2, 1)
    one, = plan_slots(main_job, (0,), cpu_count=16)
    assert (one.gpus, one.processes) == ((0,), 1)
    two, = plan_slots(main_job, (0, 1), cpu_count=16)
    assert (two.gpus, two.processes) == ((0, 1), 2)


@pytest.mark.parametrize(("resources", "gpus", "expected"), [
    pytest.param({"parallel": "auto", "gpus_per_trial": 2, "torchrun": False}, (0, 1, 2, 3),
                 [((0, 1), 1, 8), ((2, 3), 1, 8)], id="two-gpus-one-process"),
    pytest.param({"parallel": "auto", "processes_per_trial": 2, "torchrun": False}, (0, 1),
                 [((0, 1), 1, 16)], id="auto-gpus-one-process"),
    pytest.param({"parallel": "auto", "processes_per_trial": 2, "torchrun": False}, (),
                 [((), 1, 1)] * 16, id="cpu-auto-one-process-per-core"),
    pytest.param({"parallel": 1, "processes_per_trial": 2, "torchrun": False}, (),
                 [((), 1, 16)], id="cpu-one-process-takes-the-cores"),
    pytest.param({"parallel": 1, "processes_per_trial": 2}, (), [((), 2, 8)], id="cpu-torchrun-auto-unchanged"),
])
def test_without_torchrun_a_slot_runs_one_process_with_the_slots_cores(
        resources: dict[str, Any], gpus: tuple[int, ...], expected: list[tuple[tuple[int, ...], int, int]]) -> None:
    """The plan is what runs: without torchrun nothing starts a second process, so the one
    process gets the threads of the whole slot."""
    resources_model = Resources(**resources)
    slots = plan_slots(resources_model, gpus, cpu_count=16)
    assert [(slot.gpus, slot.processes, slot.threads) for slot in slots] == expected
    assert uses_torchrun(resources_model, slots[0]) is (resources_model.torchrun == "auto")


def test_without_torchrun_the_plan_says_one_process() -> None:
    on_gpus, = plan_slots(Resources(gpus_per_trial=2, torchrun=False), (0, 1), cpu_count=2)
    assert on_gpus.describe() == "1 process on GPUs 0,1"
    on_cpu, = plan_slots(Resources(processes_per_trial=2, torchrun=False), (), cpu_count=2)
    assert on_cpu.describe() == "1 CPU process of 2 threads"


def test_the_plan_counts_the_cores_this_process_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under taskset or a batch job's cpuset the machine has more cores than hpo may use."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5})
    assert usable_cores() == 2
    slots = plan_slots(Resources(parallel="auto"), ())
    assert [(slot.processes, slot.threads) for slot in slots] == [(1, 1), (1, 1)]
    one, = plan_slots(Resources(parallel=1), ())
    assert one.threads == 2


def test_plan_slots_needs_enough_gpus() -> None:
    with pytest.raises(InputError, match="resources.gpus_per_trial: 4 GPUs per trial, but this machine has 2 GPUs"):
        plan_slots(Resources(gpus_per_trial=4), (0, 1))
    with pytest.raises(InputError, match="--workers 2: this machine runs 1 trial at a time"):
        plan_slots(Resources(gpus_per_trial=1), (0,), at_least=2)


@pytest.mark.parametrize(("resources", "gpus", "workers", "hint"), [
    ({"gpus_per_trial": 0.5}, (0,), 3,
     "a smaller fraction, gpus_per_trial: 0.333 would run 3 trials on each GPU, or give --workers 2 at most"),
    ({"gpus_per_trial": "auto", "processes_per_trial": 2, "parallel": 1}, (0, 1), 4,
     "give --workers 1 at most (a share of a GPU per trial runs one process, not processes_per_trial: 2)"),
    ({"gpus_per_trial": 1}, (0, 1), 4, "gpus_per_trial: 0.5 would run 2 trials on each GPU, or give --workers 2 at most"),
    ({"gpus_per_trial": 1, "torchrun": True}, (0,), 2,
     "give --workers 1 at most (a share of a GPU per trial is not for torchrun: true)"),
    ({"gpus_per_trial": 2, "torchrun": True}, (0, 1, 2, 3), 4,
     "gpus_per_trial: 1 would run 4 trials at a time, or give --workers 2 at most"),
    ({"gpus_per_trial": "auto", "processes_per_trial": 2, "parallel": 1}, (0, 1, 2, 3), 4,
     "processes_per_trial: 1 would run 4 trials at a time, or give --workers 2 at most"),
])
def test_too_many_workers_for_the_gpus_get_a_hint_that_applies(resources: dict[str, Any], gpus: tuple[int, ...],
                                                              workers: int, hint: str) -> None:
    """The hint was always 'a fraction such as 0.5 shares GPUs', also where the scenario
    had that fraction already, or where a fraction is refused."""
    with pytest.raises(InputError) as info:
        plan_slots(Resources(**resources), gpus, at_least=workers)
    assert str(info.value).endswith(f"); {hint}"), str(info.value)


@pytest.mark.parametrize(("value", "expected"), [("", ()), ("0", (0,)), ("0,1, 3", (0, 1, 3)), ("2,", (2,))])
def test_detect_gpus_honours_the_override(value: str, expected: tuple[int, ...],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GPU_ENV, value)
    assert detect_gpus() == expected


@pytest.mark.parametrize("value", ["²", "٣", "0,１", "1,²"])
def test_gpu_ids_are_ascii_digits(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``str.isdigit`` holds for superscripts and other scripts' digits, which ``int`` reads
    as another number or refuses."""
    with pytest.raises(InputError) as info:
        gpu_ids(value, "--gpus")
    assert str(info.value) == f"--gpus: {value!r} is not a comma-separated list of GPU ids (whole numbers, e.g. 0,1)"
    monkeypatch.setenv(GPU_ENV, value)
    with pytest.raises(InputError, match=f"^{GPU_ENV}: "):
        detect_gpus()


def test_an_empty_hpo_gpus_leaves_no_gpu_to_resources_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HPO_GPUS=`` means none: resources.gpus (or --gpus) cannot name one."""
    monkeypatch.setenv(GPU_ENV, "")
    with pytest.raises(InputError) as info:
        plan_slots(Resources(gpus=[0, 1], gpus_per_trial=1), detect_gpus())
    assert str(info.value) == f"resources.gpus: GPU 0 is not on this machine (it has none: {GPU_ENV} is empty)"
    with pytest.raises(InputError, match=r"^--gpus: GPU 3 is not on this machine"):
        plan_slots(Resources(gpus=[3]), detect_gpus(), gpus_field="--gpus")
    monkeypatch.setenv(GPU_ENV, "0,1")
    assert [slot.gpus for slot in plan_slots(Resources(gpus=[1], gpus_per_trial=1), detect_gpus())] == [(1,)]


def test_resources_gpus_say_what_there_is_where_none_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HPO_GPUS and no GPU found (nvidia-smi may be missing): the scenario's list is taken."""
    monkeypatch.delenv(GPU_ENV, raising=False)
    assert [slot.gpus for slot in plan_slots(Resources(gpus=[0, 1], gpus_per_trial=1, parallel=2), ())] == [(0,), (1,)]


@pytest.mark.parametrize(("extra", "expected"), [({}, "1"), ({"PYTHONUNBUFFERED": ""}, ""),
                                                 ({"PYTHONUNBUFFERED": "0"}, "0")])
def test_the_scenario_env_may_set_pythonunbuffered(extra: dict[str, str], expected: str) -> None:
    env = trial_env(Slot(0, (), 1, 1), "tok", extra, base={"PYTHONUNBUFFERED": "x"})
    assert env["PYTHONUNBUFFERED"] == expected


@pytest.mark.parametrize(("env", "stdout"), [({}, "FileIO '1'"), ({"PYTHONUNBUFFERED": ""}, "BufferedWriter ''")])
def test_a_trial_gets_the_pythonunbuffered_of_its_scenario(tmp_path: Path, write_scenario: Any,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           env: dict[str, str], stdout: str) -> None:
    """Unbuffered, ``print`` writes a line's text and its newline in two calls, and the lines
    of DDP ranks that print interleave; an empty value gives the trial buffered output."""
    monkeypatch.setenv(GPU_ENV, "")
    probe = ("import os, sys\n"
             "from pathlib import Path\n"
             "Path('stdout.txt').write_text(f\"{type(sys.stdout.buffer).__name__} {os.environ.get('PYTHONUNBUFFERED')!r}\")\n"
             "print('val_error={{ x }}')\n")
    path = write_scenario(tmp_path, template_text=probe, env=env, search={"trials": 1},
                          objective={"held_out": []})
    assert cli.main(["run", str(path), "--workdir", str(tmp_path / "w")]) == 0
    assert (tmp_path / "w" / "trial-0000" / "stdout.txt").read_text() == stdout


def test_the_scenario_env_sets_omp_num_threads() -> None:
    env = trial_env(Slot(0, (), 1, 6), "tok", {"OMP_NUM_THREADS": "3"}, base={"OMP_NUM_THREADS": "8"})
    assert env["OMP_NUM_THREADS"] == "3"
    assert trial_env(Slot(0, (), 1, 6), "tok", {}, base={"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "6"


@pytest.mark.parametrize(("env", "expected"), [
    ({"OMP_NUM_THREADS": "4"}, 4), ({"OMP_NUM_THREADS": "4,2"}, 4), ({"OMP_NUM_THREADS": " 3 "}, 3),
    ({}, None), ({"OMP_NUM_THREADS": "0"}, None), ({"OMP_NUM_THREADS": "many"}, None), ({"OTHER": "4"}, None),
])
def test_env_threads(env: dict[str, str], expected: int | None) -> None:
    assert env_threads(env) == expected


@pytest.mark.parametrize(("gpus", "cpus"), [((), 2), ((0, 1), 16)])
def test_the_plan_gives_the_threads_that_the_env_sets(gpus: tuple[int, ...], cpus: int) -> None:
    slots = plan_slots(Resources(parallel=2), gpus, cpu_count=cpus, threads=4)
    assert [slot.threads for slot in slots] == [4, 4]
    assert trial_env(slots[0], "tok", {"OMP_NUM_THREADS": "4"}, base={})["OMP_NUM_THREADS"] == "4"
    if not gpus:
        assert slots[0].describe() == "1 CPU process of 4 threads"


def test_trial_env() -> None:
    gpu = trial_env(Slot(1, (2, 3), 2, 1), "tok", {"A": "1"}, base={"PATH": "/bin", "A": "0"})
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert gpu[TOKEN_ENV] == "tok" and gpu["A"] == "1" and gpu["PATH"] == "/bin"
    assert gpu["OMP_NUM_THREADS"] == "1" and gpu["HPO_SLOT"] == "1" and gpu["PYTHONUNBUFFERED"] == "1"
    cpu = trial_env(Slot(0, (), 1, 6), "tok", {}, base={"CUDA_VISIBLE_DEVICES": "0"})
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["OMP_NUM_THREADS"] == "6"


def test_a_trial_is_not_given_the_place_of_hpo_in_a_distributed_job() -> None:
    """hpo started by torchrun (or in a Kubeflow PyTorchJob) handed its RANK=1 to every trial,
    whose report() then printed nothing; WORLD_SIZE=2 left init_process_group waiting."""
    job = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
           "TORCHELASTIC_RUN_ID": "x", "PET_NNODES": "2", "PET_NODE_RANK": "1", "NODE_RANK": "1", "PATH": "/bin"}
    env = trial_env(Slot(0, (), 1, 1), "tok", {"MASTER_PORT": "1234"}, base=job)
    assert set(env) & set(job) == {"MASTER_PORT", "PATH"} and env["PATH"] == "/bin"
    assert env["MASTER_PORT"] == "1234"  # the scenario's env may set one


def _run(tmp_path: Path, code: str, timeout: float | None = 30, should_end: Any = None,
         env: dict[str, str] | None = None) -> tuple[Any, list[str]]:
    """Run ``code`` as a script under :func:`run_process`; return the result and the lines seen."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    lines: list[str] = []
    result = run_process([sys.executable, str(script)], tmp_path, env or dict(os.environ), tmp_path / "trial.log",
                         timeout, lambda batch, running: lines.extend(batch), should_end or (lambda: None))
    return result, lines


def test_exit_code_and_output(tmp_path: Path) -> None:
    result, lines = _run(tmp_path, """\
        import sys
        print("hello")
        print("val_error=0.5", file=sys.stderr)
        sys.exit(3)
    """)
    assert result.exit_code == 3
    assert result.ended_by is None
    assert result.duration_s >= 0
    assert lines == ["hello\n", "val_error=0.5\n"]
    assert (tmp_path / "trial.log").read_text() == "hello\nval_error=0.5\n"


def test_a_process_that_ends_while_its_poller_is_paused_was_last_seen_before_the_pause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The poller paused (SIGSTOP, a stalled machine) just after a poll found the process
    alive, before anything else ran: the process ends meanwhile, and it is known to have run
    until that poll, not until the poller woke (a CI run saw a frozen worker's trial count
    its whole pause)."""
    real = launch._exits_within
    polls = 0

    def paused_after_the_second_poll(proc: Any, seconds: float) -> bool:
        nonlocal polls
        exited = real(proc, seconds)
        polls += 1
        if polls == 2 and not exited:
            time.sleep(1.5)
        return exited

    monkeypatch.setattr(launch, "_exits_within", paused_after_the_second_poll)
    result, _ = _run(tmp_path, "import time; time.sleep(0.2)")
    assert result.exit_code == 0 and result.duration_s > 1.5
    assert result.seen_running_s < 0.5, result


def test_log_is_appended(tmp_path: Path) -> None:
    (tmp_path / "trial.log").write_text("earlier\n")
    _run(tmp_path, "print('later')")
    assert (tmp_path / "trial.log").read_text() == "earlier\nlater\n"


def test_runs_in_cwd_with_env(tmp_path: Path) -> None:
    env = {**os.environ, "HPO_TEST_VALUE": "42"}
    result, lines = _run(tmp_path, "import os; print(os.getcwd(), os.environ['HPO_TEST_VALUE'])", env=env)
    assert result.exit_code == 0
    assert lines == [f"{tmp_path} 42\n"]


def test_a_log_that_cannot_be_written_ends_the_process_at_once(tmp_path: Path) -> None:
    """/dev/full refuses every write (ENOSPC), as a full disk does: the process is ended as a
    timeout ends it, not left to train unlogged to its end (here 30 s), the lines read until
    then are handled, and the result says the disk is full (no fault of the process)."""
    script = tmp_path / "child.py"
    script.write_text("import time\nprint('val_error=0.5', flush=True)\ntime.sleep(30)\n")
    lines: list[str] = []
    began = time.monotonic()
    result = run_process([sys.executable, str(script)], tmp_path, dict(os.environ), Path("/dev/full"), 60,
                         lambda batch, running: lines.extend(batch), lambda: None)
    assert time.monotonic() - began < 10
    assert re.fullmatch(r"cannot write /dev/full: No space left on device \([0-9.]+ \w+ free on /dev\)",
                        result.ended_by or ""), result.ended_by
    assert result.disk_full and result.exit_code == -signal.SIGTERM and _gone(result.pid)
    assert lines == ["val_error=0.5\n"]


def test_should_end_is_asked_as_soon_as_the_process_runs_and_never_for_one_that_did_not_start(
        tmp_path: Path) -> None:
    """A process that exits before the first poll was still asked (the sweep announces a start
    then: :class:`hpo.engine._Control`); one that could not start never is."""
    asked: list[str] = []

    def should_end() -> None:
        asked.append("asked")

    quick = run_process(["true"], tmp_path, dict(os.environ), tmp_path / "trial.log", 30,
                        lambda batch, running: None, should_end)
    assert quick.exit_code == 0 and asked
    asked.clear()
    missing = run_process([str(tmp_path / "no-such-program")], tmp_path, dict(os.environ), tmp_path / "trial.log",
                          30, lambda batch, running: None, should_end)
    assert missing.exit_code == 127 and not asked


def test_a_start_refused_by_a_limit_of_the_machine_stops_the_sweep(tmp_path: Path) -> None:
    """Too many open files in hpo's own process is no fault of the trial's: not a FAIL."""
    script = tmp_path / "child.py"
    script.write_text("print('val_error=0.5')\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, os.listdir("/proc/self/fd"))) + 8, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        os.close(held.pop())  # room for the log, none for the process's pipes
        with pytest.raises(ExecutorUnavailable, match="cannot start a trial's process: Too many open files"):
            run_process([sys.executable, str(script)], tmp_path, dict(os.environ), tmp_path / "trial.log", 30,
                        lambda batch, running: None, lambda: None)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_bad_callback_does_not_stop_the_log(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text("print('a')\nprint('b')\n")

    def explode(lines: list[str], running: bool) -> None:
        raise ValueError("boom")

    result = run_process([sys.executable, str(script)], tmp_path, dict(os.environ), tmp_path / "trial.log", 30,
                         explode, lambda: None)
    assert result.exit_code == 0
    log = (tmp_path / "trial.log").read_text()
    assert log.startswith("a\n") and "b\n" in log and "could not handle output lines: boom" in log


def test_missing_executable(tmp_path: Path) -> None:
    result = run_process([str(tmp_path / "no-such-program")], tmp_path, dict(os.environ), tmp_path / "trial.log",
                         30, lambda lines, running: None, lambda: None)
    assert result.exit_code == 127
    assert result.ended_by is not None and "cannot start" in result.ended_by
    assert "cannot start" in (tmp_path / "trial.log").read_text()


FAMILY = """\
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"],
                                  start_new_session={new_session})
    with open("pids.txt", "w") as handle:
        handle.write(f"{{grandchild.pid}}\\n")
    print("ready", flush=True)
    time.sleep(1000)
"""


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether ``pid`` has exited (a zombie waiting to be reaped counts as exited)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("new_session", [False, True], ids=["same-group", "own-session"])
def test_timeout_kills_child_and_grandchild(tmp_path: Path, new_session: bool) -> None:
    start = time.monotonic()
    result, lines = _run(tmp_path, FAMILY.format(new_session=new_session), timeout=1.0)
    assert result.ended_by == "timeout"
    assert result.exit_code != 0
    assert lines == ["ready\n"]
    assert time.monotonic() - start < 10
    grandchild = int((tmp_path / "pids.txt").read_text())
    assert _gone(result.pid)
    assert _gone(grandchild)


def test_should_end_is_honoured(tmp_path: Path) -> None:
    seen: list[str] = []
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(FAMILY.format(new_session=False)))
    polls = 0

    def should_end() -> str | None:
        nonlocal polls
        polls += 1
        return "stopped" if seen else None

    start = time.monotonic()
    result = run_process([sys.executable, str(script)], tmp_path, dict(os.environ), tmp_path / "trial.log", None,
                         lambda lines, running: seen.extend(lines), should_end)
    assert result.ended_by == "stopped"
    assert polls >= 1
    assert time.monotonic() - start < 10
    assert _gone(result.pid)
    assert _gone(int((tmp_path / "pids.txt").read_text()))


def test_background_leftovers_are_killed_after_a_normal_exit(tmp_path: Path) -> None:
    result, _ = _run(tmp_path, """\
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
        open("pids.txt", "w").write(str(child.pid))
    """, timeout=1)
    assert result.exit_code == 0 and result.ended_by is None
    assert _gone(int((tmp_path / "pids.txt").read_text()))


def test_kill_by_token(tmp_path: Path) -> None:
    token = f"test:{os.getpid()}:{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"],
                            env={**os.environ, TOKEN_ENV: token}, start_new_session=True)
    try:
        assert kill_by_token(token) == 1
        assert _gone(proc.pid)
        assert kill_by_token(token) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_trial_that_closes_its_output_does_not_spin_a_core(tmp_path: Path) -> None:
    cpu = time.process_time()
    result = run_process(["sh", "-c", "exec >/dev/null 2>&1; sleep 1.5"], tmp_path, dict(os.environ),
                         tmp_path / "trial.log", 30, lambda lines, running: None, lambda: None)
    assert result.exit_code == 0 and result.duration_s >= 1.5
    assert time.process_time() - cpu < 0.3


DETACHED = """\
    import subprocess, sys
    code = "import sys, time\\nwhile True:\\n    print('still here', flush=True)\\n    time.sleep(0.02)"
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, env={env},
                             stdout={stdout})
    open("pids.txt", "w").write(str(child.pid))
    print("detached", flush=True)
"""


def _kill(pid: int) -> None:
    try:
        psutil.Process(pid).kill()
    except psutil.NoSuchProcess:
        pass


def test_every_line_is_logged_and_handled_however_slow_the_handler(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines still waiting for a slow handler when the process ends are all handled (as left
    over: ``running`` False) before run_process returns; KILL_GRACE_S bounds only how long
    the pipe is read after the end, not how long the handler takes."""
    monkeypatch.setattr("hpo.launch.KILL_GRACE_S", 0.2)
    script = tmp_path / "child.py"
    script.write_text("import time\nprint('line 0', flush=True)\ntime.sleep(0.3)\n"
                      "for i in range(1, 3000):\n    print(f'line {i}')\n")
    seen: list[tuple[str, bool]] = []

    def slow(lines: list[str], running: bool) -> None:
        time.sleep(0.5 if not seen else 0.0)
        seen.extend((line, running) for line in lines)

    result = run_process([sys.executable, str(script)], tmp_path, dict(os.environ), tmp_path / "trial.log", 30,
                         slow, lambda: None)
    assert result.exit_code == 0
    expected = [f"line {i}\n" for i in range(3000)]
    assert [line for line, _ in seen] == expected
    assert (tmp_path / "trial.log").read_text() == "".join(expected)
    assert seen[0][1] and not seen[-1][1]


@pytest.mark.parametrize("stdout", ["None", "subprocess.DEVNULL"], ids=["keeps-the-pipe", "own-output"])
def test_a_detached_process_with_the_token_ends_with_the_trial(tmp_path: Path, stdout: str) -> None:
    env = {**os.environ, TOKEN_ENV: f"test:{os.getpid()}:{time.monotonic_ns()}"}
    start = time.monotonic()
    result, lines = _run(tmp_path, DETACHED.format(env="None", stdout=stdout), env=env)
    pid = int((tmp_path / "pids.txt").read_text())
    try:
        assert result.exit_code == 0 and result.ended_by is None
        assert lines[0] == "detached\n"
        assert result.duration_s < 2 and time.monotonic() - start < 3
        assert _gone(pid, wait_s=0.5)
    finally:
        _kill(pid)


def test_output_after_the_log_is_closed_is_dropped_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("hpo.launch.KILL_GRACE_S", 0.2)
    raised: list[Any] = []
    monkeypatch.setattr("threading.excepthook", raised.append)
    without_token = f"{{k: v for k, v in __import__('os').environ.items() if k != {TOKEN_ENV!r}}}"
    env = {**os.environ, TOKEN_ENV: f"test:{os.getpid()}:{time.monotonic_ns()}"}
    result, _ = _run(tmp_path, DETACHED.format(env=without_token, stdout="None"), env=env)
    pid = int((tmp_path / "pids.txt").read_text())
    try:
        time.sleep(0.3)
        assert result.exit_code == 0 and not raised
    finally:
        _kill(pid)


def test_resources_gpus_must_be_on_this_machine() -> None:
    with pytest.raises(InputError, match=r"resources.gpus: GPU 5 is not on this machine \(it has GPUs 0,1,2,3;"):
        plan_slots(Resources(gpus=[5], gpus_per_trial=1), (0, 1, 2, 3))
    with pytest.raises(InputError, match="2 GPUs per trial, but resources.gpus names 1 GPU"):
        plan_slots(Resources(gpus=[0], gpus_per_trial=2), (0, 1, 2, 3))


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM])
def test_a_child_gets_its_parent_death_signal_even_where_the_parent_ignores_it(signum: signal.Signals) -> None:
    """``nohup hpo run --workers K`` ignores SIGHUP, and an ignored signal stays ignored through
    exec: die_with_parent gives the child the signal's default action back."""
    show = f"import signal; print(int(signal.getsignal({int(signum)})))"
    previous = signal.signal(signum, signal.SIG_IGN)
    try:
        child = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True,
                               preexec_fn=lambda: launch.die_with_parent(signum))
        plain = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True)
    finally:
        signal.signal(signum, previous)
    assert int(child.stdout) == int(signal.SIG_DFL) and int(plain.stdout) == int(signal.SIG_IGN)
