"""Trial folders: templates rendered (Jinja or dollar syntax), other files copied verbatim."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpo.cli import main
from hpo.errors import InputError
from hpo.launch import check_command
from hpo.render import COMMAND_FILE, PARAMS_FILE, Renderer, left_out_links, trial_folder, write_files
from hpo.scenario import Scenario, load_scenario

WriteScenario = Callable[..., Path]
RunCli = Callable[..., "subprocess.CompletedProcess[str]"]


def _renderer(tmp_path: Path, write_scenario: WriteScenario, templates: dict[str, str | bytes],
              executable: tuple[str, ...] = (), **overrides: Any) -> Renderer:
    """Write ``templates`` (name to content; those named in ``executable`` with the execute
    bit) beside a scenario that lists them; return its Renderer."""
    folder = tmp_path / "sc"
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in templates.items():
        path = folder / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        path.chmod(0o755 if name in executable else 0o644)
    path = write_scenario(folder, template=list(templates), template_text=None, **overrides)
    return Renderer(load_scenario(path))


def _render(renderer: Renderer, folder: Path, number: int, params: dict[str, Any], argv: list[str],
            seed: int | None = None) -> tuple[str, ...]:
    """Render the trial's files and write them into ``folder``, as an executor does; return their names."""
    files = renderer.files(number, folder, params, argv, seed)
    write_files(folder, files)
    return tuple(file.name for file in files)


def test_trial_folder_name(tmp_path: Path) -> None:
    assert trial_folder(tmp_path, 7) == tmp_path / "trial-0007"
    assert trial_folder(tmp_path, 12345) == tmp_path / "trial-12345"


@pytest.mark.parametrize(
    ("syntax", "text", "expected"),
    [
        ("jinja", "lr = {{ x }}\nopt = '{{ opt }}'\n", "lr = 0.25\nopt = 'adam'\n"),
        ("jinja", "{% if opt == 'adam' %}A{% else %}S{% endif %} {{ '%.1f' % x }}", "A 0.2"),
        ("jinja", "trial {{ trial_number }} seed {{ seed }} dir {{ trial_dir }}", "trial 3 seed 1 dir {folder}"),
        ("dollar", "lr = ${x}\nopt = '${ opt }'\n", "lr = 0.25\nopt = 'adam'\n"),
        ("dollar", "keep $x and {{ x }}; trial ${trial_number}", "keep $x and {{ x }}; trial 3"),
        ("dollar", 'cd "$${HOME}" && echo $${ x } ${x}', 'cd "${HOME}" && echo ${ x } 0.25'),
    ],
)
def test_templates_render(tmp_path: Path, write_scenario: WriteScenario, syntax: str, text: str,
                          expected: str) -> None:
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": text}, syntax=syntax)
    folder = tmp_path / "work" / "trial-0003"
    names = _render(renderer, folder, 3, {"x": 0.25, "opt": "adam"}, ["python", "train.py"])
    assert (folder / "train.py").read_text() == expected.replace("{folder}", str(folder))
    assert names == ("train.py", PARAMS_FILE, COMMAND_FILE) and renderer.names == ("train.py",)


@pytest.mark.parametrize(
    ("syntax", "text", "overrides", "sees"),
    [
        ("jinja", "seed = {{ trial_seed }}", {}, True),
        ("jinja", "{% set s = trial_seed %}{{ s }}", {}, True),
        ("jinja", "seed = {{ seed }}", {}, False),
        ("dollar", "--seed ${trial_seed}", {}, True),
        ("dollar", "echo $${trial_seed}", {}, False),
        ("jinja", "x = {{ x }}", {"seed_flag": "--seed"}, True),
    ],
)
def test_whether_a_trial_sees_its_trial_seed(tmp_path: Path, write_scenario: WriteScenario, syntax: str,
                                             text: str, overrides: dict[str, Any], sees: bool) -> None:
    """hpo rerun --seed is refused where the trial would not see it."""
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": text}, syntax=syntax, **overrides)
    assert renderer.sees_trial_seed is sees


def test_data_dir_reaches_the_template(tmp_path: Path, write_scenario: WriteScenario) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("x\n")
    renderer = _renderer(tmp_path, write_scenario, {"t.py.jinja": "{{ data_dir }}"}, data_dir="../data")
    texts = renderer.render_texts(0, tmp_path, {"x": 0.5, "opt": "a"})
    assert texts == {"t.py": str((tmp_path / "data").resolve())}


@pytest.mark.parametrize("suffix", [".j2", ".jinja", ".jinja2", ".tmpl"])
def test_rendered_suffixes_are_stripped(tmp_path: Path, write_scenario: WriteScenario, suffix: str) -> None:
    renderer = _renderer(tmp_path, write_scenario, {f"conf.yaml{suffix}": "x: {{ x }}\n"})
    _render(renderer, tmp_path / "t", 0, {"x": 1, "opt": "a"}, ["python"])
    assert (tmp_path / "t" / "conf.yaml").read_text() == "x: 1\n"


def test_other_files_are_copied_verbatim(tmp_path: Path, write_scenario: WriteScenario) -> None:
    raw = "{{ not rendered }} ${HOME}\n"
    blob = bytes(range(256))
    renderer = _renderer(tmp_path, write_scenario,
                         {"train.py.j2": "{{ x }}", "helper.py": raw, "weights.bin": blob, "run.sh": "#!/bin/sh\n"},
                         executable=("run.sh",))
    folder = tmp_path / "t"
    names = _render(renderer, folder, 0, {"x": 1, "opt": "a"}, ["./run.sh"])
    assert (folder / "helper.py").read_text() == raw
    assert (folder / "weights.bin").read_bytes() == blob
    assert os.stat(folder / "run.sh").st_mode & stat.S_IXUSR
    assert names[:4] == ("train.py", "helper.py", "weights.bin", "run.sh")


def test_rendered_template_keeps_its_mode(tmp_path: Path, write_scenario: WriteScenario) -> None:
    renderer = _renderer(tmp_path, write_scenario, {"run.sh.j2": "#!/bin/sh\necho {{ x }}\n"}, executable=("run.sh.j2",))
    _render(renderer, tmp_path / "t", 0, {"x": 1, "opt": "a"}, ["./run.sh"])
    assert os.stat(tmp_path / "t" / "run.sh").st_mode & stat.S_IXUSR


def test_params_json_and_command_txt(tmp_path: Path, write_scenario: WriteScenario) -> None:
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": "{{ x }}"})
    folder = tmp_path / "t"
    argv = ["/usr/bin/python3", "train.py", "--opt", "a b", "--x", "0.5"]
    _render(renderer, folder, 4, {"x": 0.5, "opt": "a b"}, argv)
    assert json.loads((folder / PARAMS_FILE).read_text()) == {"trial": 4, "params": {"x": 0.5, "opt": "a b"},
                                                              "trial_seed": 5}
    command = (folder / COMMAND_FILE).read_text()
    assert command.endswith("\n")
    assert shlex.split(command) == argv


def test_command_txt_sets_the_scenarios_env(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """A copy of the best trial's folder ran without the scenario's env, and gave another result."""
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": "{{ x }}"}, env={"SCALE": "2.5", "NOTE": "a b"})
    folder = tmp_path / "t"
    _render(renderer, folder, 0, {"x": 0.5, "opt": "a"}, ["/usr/bin/python3", "train.py"])
    assert shlex.split((folder / COMMAND_FILE).read_text()) == ["env", "SCALE=2.5", "NOTE=a b", "/usr/bin/python3",
                                                                "train.py"]


def test_render_texts_writes_nothing(tmp_path: Path, write_scenario: WriteScenario) -> None:
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": "{{ x }}", "helper.py": "pass"})
    folder = tmp_path / "never"
    assert renderer.render_texts(0, folder, {"x": 2, "opt": "a"}) == {"train.py": "2"}
    assert not folder.exists()


@pytest.mark.parametrize(
    ("syntax", "text", "message"),
    [
        ("jinja", "ok\nlr = {{ lr }}\n", "template train.py.j2 line 2: 'lr' is undefined"),
        ("jinja", "a\nb\n{% for i in range(2) %}\n{{ cfg.depth }}\n{% endfor %}\n",
         "template train.py.j2 line 4: 'cfg' is undefined"),
        ("jinja", "{{ x }}\n{{ 1 / 0 }}\n", "template train.py.j2 line 2: ZeroDivisionError: division by zero"),
        ("dollar", "a = 1\nb = 2\nlr = ${lr}\n", "template train.py.j2 line 3: ${lr} is undefined (write $${lr} for a literal ${lr})"),
    ],
)
def test_undefined_variables_name_file_and_line(tmp_path: Path, write_scenario: WriteScenario, syntax: str,
                                                text: str, message: str) -> None:
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": text}, syntax=syntax)
    with pytest.raises(InputError) as info:
        _render(renderer, tmp_path / "t", 0, {"x": 1, "opt": "a"}, ["python"])
    assert str(info.value) == message
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a\n{% if x %}\nno end", "template train.py.j2 line 2: Unexpected end of template"),
        ("a\nb\n{{ x \n", "template train.py.j2 line 3: unexpected end of template"),
        ("{% frobnicate %}", "template train.py.j2 line 1: Encountered unknown tag 'frobnicate'"),
    ],
)
def test_syntax_errors_name_file_and_line(tmp_path: Path, write_scenario: WriteScenario, text: str,
                                          message: str) -> None:
    with pytest.raises(InputError) as info:
        _renderer(tmp_path, write_scenario, {"train.py.j2": text})
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_missing_template_and_clashing_names(tmp_path: Path, write_scenario: WriteScenario) -> None:
    path = write_scenario(tmp_path / "a", template=["nope.py.j2"], template_text=None)
    with pytest.raises(InputError, match=r"template: file .*nope\.py\.j2 not found"):
        Renderer(load_scenario(path))
    with pytest.raises(InputError, match="template: two files would be written as train.py"):
        _renderer(tmp_path / "b", write_scenario, {"train.py.j2": "", "train.py": ""})
    with pytest.raises(InputError, match="template: two files would be written as params.json"):
        _renderer(tmp_path / "c", write_scenario, {"params.json.j2": ""})


def test_non_utf8_template_is_an_input_error(tmp_path: Path, write_scenario: WriteScenario) -> None:
    with pytest.raises(InputError, match="template train.py.j2: not a UTF-8 text file"):
        _renderer(tmp_path, write_scenario, {"train.py.j2": b"\xff\xfe{{ x }}"})


def test_context_has_reserved_names(tmp_path: Path, write_scenario: WriteScenario) -> None:
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": ""}, search={"seed": 9})
    scenario: Scenario = renderer.scenario
    assert renderer.context(2, tmp_path, {"x": 1}) == {"x": 1, "trial_number": 2, "trial_dir": str(tmp_path),
                                                       "seed": 9, "trial_seed": 11}
    assert renderer.context(2, tmp_path, {"x": 1}, seed=5)["trial_seed"] == 5
    assert scenario.search.seed == 9


def test_a_folder_brings_its_files_under_its_name(tmp_path: Path, write_scenario: WriteScenario) -> None:
    package = tmp_path / "models"
    (package / "blocks").mkdir(parents=True)
    (package / "__pycache__").mkdir()
    (package / "__init__.py").write_text("")
    (package / "blocks" / "net.py.j2").write_text("WIDTH = {{ x }}\n")
    (package / "__pycache__" / "net.cpython-311.pyc").write_bytes(b"\0")
    path = write_scenario(tmp_path, template=["train.py.j2", "models"], command="python train.py")
    renderer = Renderer(load_scenario(path))
    assert renderer.names == ("train.py", "models/__init__.py", "models/blocks/net.py")
    folder = tmp_path / "trial-0000"
    write_files(folder, renderer.files(0, folder, {"x": 0.25, "opt": "a"}, ["python", "train.py"]))
    assert (folder / "models" / "blocks" / "net.py").read_text() == "WIDTH = 0.25\n"
    assert not (folder / "models" / "__pycache__").exists()


def test_a_template_saved_by_renaming_it_mid_sweep_does_not_stop_the_sweep(tmp_path: Path,
                                                                            write_scenario: WriteScenario) -> None:
    """A rendered template's text is read once, but its mode was read for every trial: an
    editor that saves by renaming left no file for a moment, and the sweep stopped with a bare
    FileNotFoundError. A file copied as it is, gone, fails its trial with a reason."""
    (tmp_path / "run.sh").write_text("echo hi\n")
    (tmp_path / "run.sh").chmod(0o755)
    path = write_scenario(tmp_path, template=["train.py.j2", "run.sh"], command="python train.py")
    renderer = Renderer(load_scenario(path))
    (tmp_path / "train.py.j2").rename(tmp_path / "train.py.j2~")
    folder = tmp_path / "trial-0000"
    write_files(folder, renderer.files(0, folder, {"x": 0.25, "opt": "a"}, ["python", "train.py"]))
    assert (folder / "train.py").is_file() and os.access(folder / "run.sh", os.X_OK)
    (tmp_path / "run.sh").unlink()
    with pytest.raises(InputError, match=rf"^template run.sh: cannot read {tmp_path / 'run.sh'}: No such file"):
        renderer.files(1, tmp_path / "trial-0001", {"x": 0.5, "opt": "a"}, ["python", "train.py"])


def test_a_template_folder_leaves_out_the_workdirs_in_it(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """``template: .``: the default workdir runs/<name> lies in the template folder, and each
    trial folder took a copy of study.db and, on a resume, of every earlier trial folder (7
    trivial trials grew to 3.8 MB each). That workdir, and any other study's workdir there,
    are left out."""
    path = write_scenario(tmp_path / "proj", template=".", command="python proj/train.py", search={"trials": 2})
    other = tmp_path / "proj" / "old-runs"
    other.mkdir()
    (other / ".hpo-study").write_text("older\n")
    (other / "model.pt").write_bytes(b"\0" * 100)
    assert main(["run", str(path)]) == 0
    assert main(["run", str(path)]) == 0  # resumed, the study in the workdir now
    workdir = tmp_path / "proj" / "runs" / "demo"
    renderer = Renderer(load_scenario(path), workdir)
    assert sorted(renderer.names) == ["proj/scenario.yaml", "proj/train.py"]
    for trial in workdir.glob("trial-*"):
        copied = {p.relative_to(trial).as_posix() for p in trial.rglob("*")}
        assert not [name for name in copied if "runs" in name or "study.db" in name], copied


@pytest.mark.parametrize(
    ("data_dir", "problem"),
    [
        pytest.param("../no-such-data", "{tmp}/no-such-data not found", id="missing"),
        pytest.param("../notes.txt", "{tmp}/notes.txt is a file, not a folder", id="a-file"),
        pytest.param("../dangling", "{tmp}/gone not found", id="a-dangling-link-names-its-target"),
        pytest.param("../empty", "{tmp}/empty is empty; put the data set there first", id="empty"),
    ],
)
def test_data_dir_must_be_a_folder(tmp_path: Path, write_scenario: WriteScenario, data_dir: str, problem: str) -> None:
    """An empty one failed every trial (the data set not found), each spending one of the budget's."""
    (tmp_path / "notes.txt").write_text("not data\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(InputError) as info:
        _renderer(tmp_path, write_scenario, {"train.py.j2": "{{ data_dir }}"}, data_dir=data_dir)
    assert str(info.value) == "data_dir: " + problem.format(tmp=tmp_path.resolve())


def test_a_clusters_data_dir_is_a_path_on_its_machines(tmp_path: Path, write_scenario: WriteScenario) -> None:
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": "{{ data_dir }}"}, data_dir="/on/the/workers",
                         resources={"cluster": {"address": "tcp://127.0.0.1:8786"}})
    assert renderer.scenario.data_dir == Path("/on/the/workers")


@pytest.mark.parametrize(
    ("template", "overrides", "message"),
    [
        pytest.param("sub/t.py", {"command": "python sub/t.py"},
                     "command: template sub/t.py is written into the trial folder as t.py; write t.py, or use the "
                     "folder sub/ as the template to keep its path", id="command"),
        pytest.param("sub/t.py", {"command": "python t.py", "objective": {"post_process": "python ./sub/t.py"}},
                     "objective.post_process: template ./sub/t.py is written into the trial folder as t.py; write "
                     "t.py, or use the folder sub/ as the template to keep its path", id="post-process"),
        pytest.param("../shared/t.py.j2", {"command": "python ../shared/t.py.j2"},
                     "command: template ../shared/t.py.j2 is written into the trial folder as t.py; write t.py",
                     id="outside-the-scenario-folder"),
    ],
)
def test_a_command_naming_a_template_by_a_path_it_is_not_written_under_is_an_error(
        tmp_path: Path, write_scenario: WriteScenario, template: str, overrides: dict[str, Any], message: str) -> None:
    for name in ("sc/sub/t.py", "shared/t.py.j2"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("print(1)\n")
    path = write_scenario(tmp_path / "sc", template=[template], template_text=None, **overrides)
    with pytest.raises(InputError) as info:
        Renderer(load_scenario(path))
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("template", "command", "names"),
    [
        pytest.param("sub/t.py", "python t.py", ("t.py",), id="a-file-under-its-own-name"),
        pytest.param("sub", "python sub/t.py", ("sub/t.py",), id="a-folder-keeps-its-path"),
        pytest.param("t.py", "python ./t.py", ("t.py",), id="dot-slash"),
    ],
)
def test_where_a_template_lands_is_what_the_command_runs(tmp_path: Path, write_scenario: WriteScenario,
                                                         template: str, command: str, names: tuple[str, ...]) -> None:
    for name in ("sub/t.py", "t.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("print(1)\n")
    renderer = Renderer(load_scenario(write_scenario(tmp_path, template=[template], template_text=None,
                                                     command=command)))
    assert renderer.names == names
    folder = tmp_path / "trial-0000"
    write_files(folder, renderer.files(0, folder, {"x": 0.5, "opt": "a"}, shlex.split(command)))
    assert (folder / names[0]).read_text() == "print(1)\n"


COPIED = "but is copied as it is (only files named *.j2, *.jinja, *.jinja2, *.tmpl are rendered): name it"


@pytest.mark.parametrize(("syntax", "name", "text", "said"), [
    ("jinja", "train.py", "x = {{ x }}\n", f"template train.py: holds {{{{ x }}}} {COPIED} train.py.j2"),
    ("dollar", "train.py", "x = ${x}\n", f"template train.py: holds ${{x}} {COPIED} train.py.tmpl"),
    ("jinja", "train.py.j2", "x = ${x}\n",
     "template train.py.j2: holds ${x}, which syntax: jinja leaves as it is: write {{ x }}, or set syntax: dollar"),
    ("dollar", "train.py.tmpl", "x = {{ x }}\n",
     "template train.py.tmpl: holds {{ x }}, which syntax: dollar leaves as it is: write ${x}, or set syntax: jinja"),
])
def test_a_placeholder_that_is_never_replaced_is_an_input_error(tmp_path: Path, write_scenario: WriteScenario,
                                                                syntax: str, name: str, text: str, said: str) -> None:
    """A template holding a parameter's placeholder that its file is never rendered with passed
    hpo validate, and every trial then failed on it (or, in a shell script, ran without it)."""
    with pytest.raises(InputError) as raised:
        _renderer(tmp_path, write_scenario, {name: text}, syntax=syntax)
    assert str(raised.value) == said


@pytest.mark.parametrize(("syntax", "templates", "overrides"), [
    ("jinja", {"train.py.j2": "X={{ x }}\npython t.py --x ${X} --home ${HOME}\n"}, {}),  # a shell variable beside its own
    ("jinja", {"train.py": "HOME = '${HOME}'\nsize = {'w': 2}\n"}, {}),  # no parameter's placeholder
    ("jinja", {"run.sh": "x=$1\npython train.py --x ${x}\n"}, {}),  # copied: the shell's own ${x}
    ("jinja", {"train.py": "print(f'{{ x }} is {args.x}')\n"}, {"flags": True}),  # x reaches it as a flag
    ("jinja", {"models/net.py": "x = {{ x }}\n"}, {}),  # a folder brings a project's files as they are
])
def test_placeholders_of_no_parameter_or_beside_the_files_own_are_left_alone(
        tmp_path: Path, write_scenario: WriteScenario, syntax: str, templates: dict[str, str],
        overrides: dict[str, Any]) -> None:
    folder = tmp_path / "sc"
    if "models/net.py" in templates:
        (folder / "models").mkdir(parents=True)
        (folder / "models" / "net.py").write_text(templates["models/net.py"])
        (folder / "train.py.j2").write_text("x = {{ x }}\n")
        path = write_scenario(folder, template=["models", "train.py.j2"], template_text=None, syntax=syntax)
        Renderer(load_scenario(path))
        return
    _renderer(tmp_path, write_scenario, templates, syntax=syntax, **overrides)


FLAG_HINT = "pass x as a flag (parameters.x.flag, or flags: true) or put it in a rendered template"
NOT_RUN = "is passed as it is: the command is neither rendered nor run by a shell"


@pytest.mark.parametrize(("overrides", "said"), [
    pytest.param({"syntax": "dollar", "command": "python train.py x=${x}"},
                 f"command: ${{x}} {NOT_RUN}; {FLAG_HINT}", id="dollar"),
    pytest.param({"command": "python train.py --x {{ x }}"}, f"command: {{{{ x }}}} {NOT_RUN}; {FLAG_HINT}",
                 id="jinja-split-by-the-command"),
    pytest.param({"command": ["python", "train.py", "x={{x|round(2)}}"]},
                 f"command: {{{{ x }}}} {NOT_RUN}; {FLAG_HINT}", id="jinja-in-one-argument"),
    pytest.param({"env": {"X": "${x}"}}, f"env.X: ${{x}} is passed as it is: env is not rendered; {FLAG_HINT}",
                 id="env"),
    pytest.param({"objective": {"post_process": "python train.py --seed {{ trial_seed }}"}},
                 f"objective.post_process: {{{{ trial_seed }}}} {NOT_RUN}; pass it with seed_flag, or put it in a "
                 "rendered template", id="post-process-trial-seed"),
    pytest.param({"command": "python train.py --out ${trial_dir}/out"},
                 f"command: ${{trial_dir}} {NOT_RUN}; the command sees it as HPO_TRIAL_DIR, or put it in a rendered "
                 "template", id="trial-dir"),
])
def test_a_placeholder_in_the_command_or_env_is_an_input_error(tmp_path: Path, write_scenario: WriteScenario,
                                                               overrides: dict[str, Any], said: str) -> None:
    """``command: python train.py lr=${lr}`` passed hpo validate, and every trial ran the script
    with the text ``${lr}`` (Hydra even resolved it as its own interpolation): one configuration."""
    with pytest.raises(InputError) as raised:
        _renderer(tmp_path, write_scenario, {"train.py.j2": "x = {{ x }}\n"}, **overrides)
    assert str(raised.value) == said


@pytest.mark.parametrize("overrides", [
    pytest.param({"command": "python train.py --home ${HOME} --name {{ name }}"}, id="names-templates-do-not-see"),
    pytest.param({"syntax": "dollar", "command": "python train.py x=$${x}"}, id="escaped"),
    pytest.param({"command": "python train.py --dir ${data_dir}"}, id="data-dir-unset"),
    pytest.param({"command": ["python", "train.py", '{"x": {"depth": 2}}'], "env": {"X": "x}}"}},
                 id="json-braces"),
    pytest.param({"command": "python train.py", "flags": True}, id="flags"),
])
def test_command_and_env_text_of_no_templated_name_is_left_alone(tmp_path: Path, write_scenario: WriteScenario,
                                                                 overrides: dict[str, Any]) -> None:
    renderer = _renderer(tmp_path, write_scenario, {"train.py.j2": "x = 1\n"}, **overrides)
    assert renderer.names == ("train.py",)


@pytest.mark.parametrize("command", ["validate", "run"])
def test_validate_and_run_refuse_a_placeholder_in_the_command(tmp_path: Path, write_scenario: WriteScenario,
                                                              run_cli: RunCli, command: str) -> None:
    path = write_scenario(tmp_path, command="python train.py x={{ x }}")
    done = run_cli(command, path, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == f"error: scenario.yaml: command: {{{{ x }}}} {NOT_RUN}; {FLAG_HINT}\n"
    assert not list(tmp_path.glob("**/trial-*"))


def test_a_linked_folder_of_a_template_folder_is_linked(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """A symbolic link to a folder (``data -> ../datasets/digits``) was left out of every trial
    folder, and every trial failed to read its data; it is linked, not copied into each trial."""
    digits = tmp_path / "datasets" / "digits"
    digits.mkdir(parents=True)
    (digits / "train.csv").write_text("1,2\n")
    (digits / "raw.j2").write_text("{{ not rendered }}")
    project = tmp_path / "sc" / "project"
    project.mkdir(parents=True)
    (project / "train.py.j2").write_text("x = {{ x }}\n")
    (project / "data").symlink_to(Path("..", "..", "datasets", "digits"))
    (project / "notes.txt").symlink_to(digits / "train.csv")
    path = write_scenario(tmp_path / "sc", template=["project"], template_text=None, command="python project/train.py")
    renderer = Renderer(load_scenario(path))
    assert renderer.names == ("project/data", "project/notes.txt", "project/train.py")
    folder = tmp_path / "work" / "trial-0000"
    files = renderer.files(0, folder, {"x": 0.5, "opt": "a"}, ["python", "project/train.py"])
    write_files(folder, files)
    write_files(folder, files)  # again, as after a full disk stopped the first try
    data = folder / "project" / "data"
    assert data.is_symlink() and data.readlink() == digits.resolve()
    assert (data / "train.csv").read_text() == "1,2\n"
    assert (data / "raw.j2").read_text() == "{{ not rendered }}"
    assert not (folder / "project" / "notes.txt").is_symlink()
    assert (folder / "project" / "notes.txt").read_text() == "1,2\n"


def test_a_link_that_leads_back_is_an_input_error_and_one_that_leads_nowhere_is_left_out(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """A dangling link (an editor's lock file, ``.#train.py``) or a loop is left out, as any
    file that is none; a link to a folder that holds it would make trial folders hold themselves."""
    project = tmp_path / "sc" / "project"
    project.mkdir(parents=True)
    (project / "train.py").write_text("print(1)\n")
    (project / ".#train.py").symlink_to("root@host.1234:1700000000")
    (project / "loop1").symlink_to("loop2")
    (project / "loop2").symlink_to("loop1")
    path = write_scenario(tmp_path / "sc", template=["project"], template_text=None, command="python project/train.py")
    assert Renderer(load_scenario(path)).names == ("project/train.py",)
    assert left_out_links(load_scenario(path).template) == [
        "template: project/loop1 is a link loop; left out of the trial folders",
        "template: project/loop2 is a link loop; left out of the trial folders"]
    (project / "up").symlink_to("..")
    with pytest.raises(InputError) as raised:
        Renderer(load_scenario(path))
    sc = (tmp_path / "sc").resolve()
    assert str(raised.value) == f"template: {sc / 'project' / 'up'} links to {sc}, a folder that holds it"


def test_a_link_that_leads_nowhere_is_noted_once_by_validate_and_run(tmp_path: Path, write_scenario: WriteScenario,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A broken ``data -> /datasets/x`` gave trials without ``data``, and not a word; an
    editor's lock file (``.#train.py``), a link that leads nowhere by design, is still left out quietly."""
    monkeypatch.setenv("HPO_GPUS", "")
    project = tmp_path / "sc" / "project"
    project.mkdir(parents=True)
    (project / "train.py").write_text("print('val_error=0.5 test_error=0.5')\n")
    (project / ".#train.py").symlink_to("root@host.1234:1700000000")
    (project / "data").symlink_to(tmp_path / "datasets" / "x")
    path = write_scenario(tmp_path / "sc", template=["project"], template_text=None, command="python project/train.py",
                          search={"trials": 1})
    note = (f"note: template: project/data links to {tmp_path.resolve() / 'datasets' / 'x'}, which does not exist; "
            "left out of the trial folders")
    assert main(["validate", str(path)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("ok: demo: ") and said[-1] == note and said.count(note) == 1
    assert main(["run", str(path)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0] == note and said.count(note) == 1 and not any(".#" in line for line in said)
    assert sorted(p.name for p in (tmp_path / "sc" / "runs" / "demo" / "trial-0000" / "project").iterdir()) == [
        "train.py"]


def test_a_link_to_a_folder_of_the_template_folder_leads_to_its_rendered_copy(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """It led to the template's own sources, unrendered."""
    project = tmp_path / "sc" / "project"
    (project / "nets").mkdir(parents=True)
    (project / "nets" / "net.py.j2").write_text("x = {{ x }}\n")
    (project / "train.py").write_text("print(1)\n")
    (project / "models").symlink_to("nets")
    path = write_scenario(tmp_path / "sc", template=["project"], template_text=None, command="python project/train.py")
    folder = tmp_path / "work" / "trial-0000"
    write_files(folder, Renderer(load_scenario(path)).files(0, folder, {"x": 0.5, "opt": "a"},
                                                            ["python", "project/train.py"]))
    assert (folder / "project" / "models").readlink() == Path("nets")
    assert (folder / "project" / "models" / "net.py").read_text() == "x = 0.5\n"
    check_command(["python", "project/models/net.py"], Renderer(load_scenario(path)).names)  # below a linked folder


def test_jinja_templates_include_import_and_extend_the_files_of_their_folder(
        tmp_path: Path, write_scenario: WriteScenario) -> None:
    """``{% include "common.py.j2" %}`` failed with "no loader for this environment specified"."""
    tpl = tmp_path / "tpl"
    (tpl / "nets").mkdir(parents=True)
    (tpl / "common.inc").write_text("# x is {{ x }}\n")
    (tpl / "macros.inc").write_text("{% macro width(n) %}{{ n * 2 }}{% endmacro %}")
    (tpl / "main.py.j2").write_text('{% include "common.inc" %}{% import "macros.inc" as m %}W = {{ m.width(3) }}\n')
    (tpl / "nets" / "base.inc").write_text("{% block body %}{% endblock %}# end\n")
    (tpl / "nets" / "net.py.j2").write_text('{% extends "base.inc" %}{% block body %}{% include "common.inc" %}'
                                            '{% endblock %}')
    (tmp_path / "beside.inc").write_text("opt = '{{ opt }}'\n")
    (tmp_path / "train.py.j2").write_text('{% include "beside.inc" %}')
    path = write_scenario(tmp_path, template=["tpl", "train.py.j2"], template_text=None, command="python train.py")
    texts = Renderer(load_scenario(path)).render_texts(0, tmp_path / "t", {"x": 0.5, "opt": "adam"})
    assert texts == {"tpl/main.py": "# x is 0.5\nW = 6\n", "tpl/nets/net.py": "# x is 0.5\n# end\n",
                     "train.py": "opt = 'adam'\n"}


@pytest.mark.parametrize(("text", "said"), [
    ('x = {{ x }}\n{% include "nope.inc" %}', "template main.py.j2 line 2: nope.inc not found in {tpl}"),
    ('{% include "common.inc" %}', "template main.py.j2 line 1, common.inc line 2: 'depth' is undefined"),
    ('{% include "bad.inc" %}', "template main.py.j2 line 1, bad.inc line 1: unexpected '}'"),
])
def test_an_included_file_that_is_missing_or_fails_is_named(tmp_path: Path, write_scenario: WriteScenario,
                                                            text: str, said: str) -> None:
    tpl = tmp_path / "tpl"
    tpl.mkdir()
    (tpl / "main.py.j2").write_text(text)
    (tpl / "common.inc").write_text("a = 1\nb = {{ depth }}\n")
    (tpl / "bad.inc").write_text("{{ x } }\n")
    path = write_scenario(tmp_path, template=["tpl"], template_text=None, command="python tpl/main.py")
    renderer = Renderer(load_scenario(path))
    with pytest.raises(InputError) as raised:
        renderer.render_texts(0, tmp_path / "t", {"x": 0.5, "opt": "a"})
    assert str(raised.value) == said.replace("{tpl}", str(tpl))


def test_a_data_dir_that_cannot_be_listed_is_taken_as_it_is(tmp_path: Path, write_scenario: WriteScenario,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder of mode 711 (entered, not listed): its files may still be read by name; the
    check for an empty one made it a PermissionError, exit 1."""
    (tmp_path / "data").mkdir()

    def refused(self: Path) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", refused)
    renderer = _renderer(tmp_path, write_scenario, {"t.py.jinja": "{{ data_dir }}"}, data_dir="../data")
    assert renderer.render_texts(0, tmp_path, {"x": 0.5, "opt": "a"}) == {"t.py": str((tmp_path / "data").resolve())}


def test_command_txt_runs_the_post_process_too(tmp_path: Path, write_scenario: WriteScenario) -> None:
    """sh command.txt ran the script alone: a trial whose metric its post_process prints gave none."""
    from conftest import run_hpo
    path = write_scenario(tmp_path, template_text="open('out.txt', 'w').write('{{ x }}')\n",
                          files={"parse.py": "print('val_error=' + open('out.txt').read())\n"},
                          template=["train.py.j2", "parse.py"], search={"trials": 1},
                          objective={"post_process": "python parse.py", "held_out": []})
    assert run_hpo("run", path).returncode == 0
    folder = next((tmp_path / "runs" / "demo").glob("trial-*"))
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (copy / "out.txt").unlink()
    again = subprocess.run(["sh", "command.txt"], cwd=copy, capture_output=True, text=True, check=False)
    assert again.returncode == 0 and again.stdout.startswith("val_error=0."), again


@pytest.mark.parametrize("method", ["tpe", "monte_carlo", "grid"])
def test_validate_renders_the_choices_that_conditions_name(tmp_path: Path, write_scenario: WriteScenario,
                                                           capsys: pytest.CaptureFixture[str], method: str) -> None:
    """Only the middle of the space (or the first design point) was rendered: a template using
    momentum, which only opt=a searches, passed validate and then every opt=b trial failed."""
    path = write_scenario(tmp_path, template_text="m = {{ momentum }}\n", search={"method": method, "trials": 4},
                          parameters={"x": {"type": "float", "low": 0, "high": 1, "step": 0.5},
                                      "momentum": {"type": "float", "low": 0.5, "high": 0.9, "step": 0.1,
                                                   "condition": {"opt": "a"}}})
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: template train.py.j2 line 1: 'momentum' is undefined (with x=") and "opt=b)" in err
    (tmp_path / "train.py.j2").write_text("{% if momentum is defined %}m = {{ momentum }}{% endif %}\n")
    assert main(["validate", str(path)]) == 0
