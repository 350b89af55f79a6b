"""Trial folders: the scenario's templates rendered with one trial's parameters.

A template whose name ends in ``.j2``, ``.jinja``, ``.jinja2`` or ``.tmpl`` is rendered and
written without that suffix; any other file is copied as it is. A folder brings its files,
rendered or copied the same way, under its own name (``models/``, ``models/net.py``); a link
to a folder inside it is linked, not copied (``models/data`` links to where ``data`` leads),
a link that leads nowhere (missing, a loop) is left out (:func:`left_out_links` says so, for
the commands to note), and one to a folder that holds it is bad input. The syntax is
Jinja2 with StrictUndefined (``{{ lr }}``) or, with ``syntax: dollar``, Rescale's ``${lr}``; a
Jinja template may include, import or extend the files of its own folder and of the template
folder it is in. Templates see every parameter by name plus ``trial_number``, ``trial_dir``,
``seed`` (the study's), ``trial_seed`` (the trial's own, see :func:`trial_seed`) and, when the
scenario sets it, ``data_dir``. A template file named in the scenario that holds a parameter's
placeholder it is never rendered with (``{{ lr }}`` in a file that is copied, ``${lr}`` in a
Jinja template that uses no Jinja) is bad input, and so is such a placeholder of any of these
names in the command, post_process or an ``env`` value, which are never rendered.

A trial folder whose disk is full (ENOSPC, a quota) is no fault of the trial: its writes
raise :class:`FolderFull`, which names the file and the room left on its disk.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

from hpo.errors import InputError
from hpo.outcome import TrialResult
from hpo.scenario import Scenario
from hpo.storage import disk_full, free_space

RENDERED_SUFFIXES = (".j2", ".jinja", ".jinja2", ".tmpl")
PARAMS_FILE = "params.json"
COMMAND_FILE = "command.txt"
LOG_FILE = "trial.log"
RESULT_FILE = "result.json"
RESERVED_FILES = (PARAMS_FILE, COMMAND_FILE, LOG_FILE, RESULT_FILE)
_DOLLAR = re.compile(r"\$(\$)?\{\s*([A-Za-z_]\w*)\s*\}")


class FolderFull(Exception):
    """A file of a trial folder could not be written because its disk is full: the message
    is :func:`full_disk`'s line. ``result`` is how the trial ended where it had ended (its
    ``result.json`` could not be written, or its log: then INTERRUPTED), else None (it never
    started). The sweep records ``result`` all the same and waits for room (:class:`hpo.engine.Sweep`).
    ``where``: the folders in words where they are not this machine's (a Dask worker's disk)."""

    def __init__(self, message: str, result: TrialResult | None = None, where: str | None = None) -> None:
        super().__init__(message)
        self.result = result
        self.where = where


def full_disk(path: Path, exc: BaseException) -> str | None:
    """``cannot write PATH: No space left on device (0 bytes free on /mnt)`` where ``exc``
    says that the disk of ``path`` is full (:func:`hpo.storage.disk_full`), else None."""
    if not disk_full(exc):
        return None
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"cannot write {path}: {why} ({free_space(path)})"


def folder_full(exc: BaseException, path: Path, result: TrialResult | None = None) -> FolderFull | None:
    """``exc``, an error writing ``path``, as :class:`FolderFull` with ``result`` where it
    says that the disk is full (:func:`full_disk`), else None."""
    line = full_disk(path, exc)
    return None if line is None else FolderFull(line, result)


@contextlib.contextmanager
def folder_writes(path: Path, result: TrialResult | None = None) -> Iterator[None]:
    """Run the block, which writes ``path``; an error that says its disk is full is raised
    as :class:`FolderFull` with ``result`` (:func:`folder_full`), any other as it is."""
    try:
        yield
    except OSError as exc:
        full = folder_full(exc, path, result)
        if full is None:
            raise
        raise full from None


def trial_folder(workdir: Path, number: int) -> Path:
    """The folder of trial ``number``: ``<workdir>/trial-0007``."""
    return workdir / f"trial-{number:04d}"


def _output_name(template: Path) -> tuple[str, bool]:
    for suffix in RENDERED_SUFFIXES:
        if template.name.endswith(suffix):
            return template.name[: -len(suffix)], True
    return template.name, False


def _dollar(template: Path, text: str) -> Callable[[Mapping[str, Any]], str]:
    """Rescale's syntax: ``${name}`` is the value of ``name``; ``$${name}`` is a literal
    ``${name}`` (a shell variable, say)."""
    def render(context: Mapping[str, Any]) -> str:
        def value(match: re.Match[str]) -> str:
            escaped, name = match.groups()
            if escaped:
                return match.group(0)[1:]
            if name not in context:
                line = text.count("\n", 0, match.start()) + 1
                raise InputError(f"template {template.name} line {line}: ${{{name}}} is undefined "
                                 f"(write $${{{name}}} for a literal ${{{name}}})")
            return str(context[name])

        return _DOLLAR.sub(value, text)

    return render


def _variables(text: str, syntax: str) -> set[str]:
    """The names a template of ``syntax`` (``jinja`` or ``dollar``) reads (its syntax checked elsewhere)."""
    if syntax == "dollar":
        return {name for escaped, name in _DOLLAR.findall(text) if not escaped}
    import jinja2
    import jinja2.meta

    try:
        return set(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(text)))
    except jinja2.TemplateSyntaxError:
        return set()


def _jinja(template: Path, text: str, folder: Path) -> Callable[[Mapping[str, Any]], str]:
    """Jinja2 syntax; ``{% include %}``, ``{% import %}`` and ``{% extends %}`` find the files of
    the template's own folder, then of ``folder`` (the template folder it is in)."""
    import jinja2

    searched = list(dict.fromkeys((template.parent, folder)))
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False, loader=jinja2.FileSystemLoader(searched))
    try:
        compiled = env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise InputError(f"template {template.name} line {exc.lineno}: {exc.message}") from None

    def render(context: Mapping[str, Any]) -> str:
        try:
            return compiled.render(**context)
        except jinja2.TemplateNotFound as exc:
            problem = f"{' or '.join(map(str, exc.templates))} not found in {' or '.join(map(str, searched))}"
            tb = exc.__traceback__
        except jinja2.TemplateError as exc:
            problem, tb = exc.message or str(exc), exc.__traceback__
        except Exception as exc:  # the template's own code failed, e.g. {{ 1 / 0 }}
            problem, tb = f"{type(exc).__name__}: {exc}", exc.__traceback__
        raise InputError(f"template {template.name}{_template_lines(tb, template.parent)}: {problem}")

    return render


def _template_lines(tb: TracebackType | None, folder: Path) -> str:
    """Where a rendering error's traceback passed through templates, or '': `` line N`` of the
    template itself, then ``, common.j2 line M`` for each file it included, imported or
    extended (named from ``folder``); the innermost line of each."""
    frames: list[tuple[str, int]] = []
    while tb is not None:
        if "__jinja_exception__" in tb.tb_frame.f_globals:  # a template's frame (jinja2.debug.fake_traceback)
            filename = tb.tb_frame.f_code.co_filename
            if frames and frames[-1][0] == filename:
                frames.pop()
            frames.append((filename, tb.tb_lineno))
        tb = tb.tb_next
    lines = [f"line {line}" if filename == "<template>" else f"{os.path.relpath(filename, folder)} line {line}"
             for filename, line in frames]
    return f" {', '.join(lines)}" if lines else ""


@dataclass(frozen=True)
class TrialFile:
    """One file of a trial folder: its name in the folder, its bytes and its mode bits; with
    ``link``, a link to that folder instead (a linked folder of a template folder)."""

    name: str
    data: bytes
    mode: int = 0o644
    link: Path | None = None


def _leads_nowhere(link: Path) -> str | None:
    """Why the symbolic link ``link`` leads nowhere (``links to /x, which does not exist``;
    ``is a link loop``), or None where it leads to a file or a folder."""
    try:
        link.resolve(strict=True)
    except RuntimeError:  # a loop, before Python 3.13
        return "is a link loop"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a link loop"
        target = os.path.realpath(link)
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"links to {target}, which does not exist"
        return f"links to {target}, which cannot be reached ({exc.strerror or exc})"
    return None


def _link_target(link: Path) -> Path | None:
    """Where the symbolic link ``link`` of a template folder leads; None where it leads nowhere
    (:func:`_leads_nowhere`: left out, as an editor's lock file ``.#train.py`` is); InputError
    where it leads to a folder that holds it (trial folders would hold themselves)."""
    if _leads_nowhere(link) is not None:
        return None
    target = link.resolve()
    if link.parent.resolve().is_relative_to(target):
        raise InputError(f"template: {link} links to {target}, a folder that holds it")
    return target


WORKDIR_OWNER = ".hpo-study"
"""The file that marks a workdir as a study's (the commands write it: :mod:`hpo.cli`)."""


def _folder_paths(template: Path, workdir: Path | None = None) -> list[Path]:
    """Every path below the template folder ``template``, sorted, ``__pycache__`` left out, and
    so are ``workdir`` and any other study's workdir (a folder holding :data:`WORKDIR_OWNER`):
    with ``template: .`` the default workdir ``runs/<name>`` lies inside it, and each trial
    folder took a copy of the study's store and of every earlier trial. A folder left out is
    not entered (a workdir holds thousands of trials); a linked folder is listed, and not
    entered."""
    workdir_path = None if workdir is None else os.path.abspath(workdir)

    def study(folder: str) -> bool:
        marker = os.path.join(folder, WORKDIR_OWNER)
        return os.path.abspath(folder) == workdir_path or (os.path.isfile(marker) and not os.path.islink(marker))

    if study(str(template)) or (workdir_path is not None and Path(os.path.abspath(template)).is_relative_to(workdir_path)):
        return []
    paths = []
    for folder, folders, files in os.walk(template):  # lists a linked folder, and does not enter it
        folders[:] = [name for name in folders if name != "__pycache__"
                      and (os.path.islink(os.path.join(folder, name)) or not study(os.path.join(folder, name)))]
        paths += [Path(folder, name) for name in (*folders, *files) if name != "__pycache__"]
    return sorted(paths)


def left_out_links(templates: Sequence[Path], workdir: Path | None = None) -> list[str]:
    """One line for each link of a template folder that leads nowhere, and is so left out of
    the trial folders (``template: proj/data links to /datasets/x, which does not exist; left
    out of the trial folders``); an editor's lock file (``.#train.py``, a link that leads
    nowhere by design) is left out without a word."""
    lines = []
    for template in templates:
        if not template.is_dir():
            continue
        for path in _folder_paths(template, workdir):
            why = _leads_nowhere(path) if path.is_symlink() and not path.name.startswith(".#") else None
            if why is not None:
                lines.append(f"template: {path.relative_to(template.parent).as_posix()} {why}; "
                             "left out of the trial folders")
    return lines


def _entries(templates: Sequence[Path], workdir: Path | None) -> list[tuple[Path, str, bool, Path]]:
    """Each file a trial folder gets from ``templates``: (source, name in the folder, rendered
    or copied, the template folder it is in). A folder brings every file below it under its own
    name (:func:`_folder_paths`); a link to a folder below it comes as that folder (the source),
    which the trial folder links (:func:`_link_target`); a link that leads nowhere is left out
    (:func:`left_out_links` says so), and so are the studies' workdirs in it."""
    out = []
    for template in templates:
        if template.is_dir():
            for path in _folder_paths(template, workdir):
                linked = _link_target(path) if path.is_symlink() else None
                if linked is not None and linked.is_dir():
                    out.append((linked, path.relative_to(template.parent).as_posix(), False, template))
                elif path.is_file():
                    name, rendered = _output_name(path)
                    out.append((path, (path.parent.relative_to(template.parent) / name).as_posix(), rendered, template))
        elif template.is_file():
            out.append((template, *_output_name(template), template.parent))
        else:
            raise InputError(f"template: file {template} not found")
    return out


_PLACEHOLDER = {"jinja": "{{{{ {} }}}}", "dollar": "${{{}}}"}
_SUFFIX = {"jinja": ".j2", "dollar": ".tmpl"}
_CHECKED_BYTES = 1 << 20  # a copied file larger than this is data, not a script that was meant to be rendered


def _check_placeholders(scenario: Scenario, template: Path, rendered: bool) -> None:
    """InputError where a template file written in the scenario holds a parameter's
    placeholder that will never be replaced: the file is copied as it is (its name lacks a
    rendering suffix) and holds one in the scenario's syntax of a parameter passed by no flag,
    or it is rendered and holds one in the other syntax and none of its own."""
    try:
        if template.stat().st_size > _CHECKED_BYTES:
            return
        text = template.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    params, syntax = set(scenario.parameters), scenario.syntax
    other = "dollar" if syntax == "jinja" else "jinja"
    if not rendered:  # only the scenario's own syntax (a copied shell script's ${lr} is the shell's), and only
        # parameters that reach the trial by no flag (a script driven by flags may print "{{ lr }}" itself)
        unflagged = {name for name in params if not (scenario.flags or scenario.parameters[name].flag)}
        found = sorted(_variables(text, syntax) & unflagged)
        if found:
            raise InputError(f"template {template.name}: holds {_PLACEHOLDER[syntax].format(found[0])} but is copied "
                             f"as it is (only files named *{', *'.join(RENDERED_SUFFIXES)} are rendered): name it "
                             f"{template.name}{_SUFFIX[syntax]}")
        return
    found = [] if _variables(text, syntax) else sorted(_variables(text, other) & params)  # it uses no syntax of its own
    if found:
        raise InputError(f"template {template.name}: holds {_PLACEHOLDER[other].format(found[0])}, which syntax: "
                         f"{syntax} leaves as it is: write {_PLACEHOLDER[syntax].format(found[0])}, or set syntax: "
                         f"{other}")


_CONTEXT_HINTS = {
    "trial_number": "the command sees it as HPO_TRIAL_NUMBER, or put it in a rendered template",
    "trial_dir": "the command sees it as HPO_TRIAL_DIR, or put it in a rendered template",
    "trial_seed": "pass it with seed_flag, or put it in a rendered template",
    "seed": "put it in a rendered template",
    "data_dir": "put it in a rendered template",
}


def _check_unrendered(scenario: Scenario) -> None:
    """InputError where the command, post_process or an ``env`` value holds the placeholder of
    a name templates see (a parameter, ``trial_seed``, ...), in either syntax (``${lr}``, or
    ``{{ lr }}``, which the command's split gives as ``{{``, ``lr``, ``}}``): they are neither
    rendered nor run by a shell, so every trial would get it as it is."""
    names = {*scenario.parameters, *_CONTEXT_HINTS} - (set() if scenario.data_dir is not None else {"data_dir"})
    command = "the command is neither rendered nor run by a shell"
    texts = {"command": (" ".join(scenario.command), command),
             "objective.post_process": (" ".join(scenario.objective.post_process or ()), command),
             **{f"env.{key}": (value, "env is not rendered") for key, value in scenario.env.items()}}
    for field, (text, why) in texts.items():
        for syntax in ("jinja", "dollar"):
            found = sorted(_variables(text, syntax) & names)
            if found:
                name = found[0]
                hint = _CONTEXT_HINTS.get(name, f"pass {name} as a flag (parameters.{name}.flag, or flags: true) "
                                                f"or put it in a rendered template")
                raise InputError(f"{field}: {_PLACEHOLDER[syntax].format(name)} is passed as it is: {why}; {hint}")


def _check_data_dir(scenario: Scenario) -> None:
    """InputError unless the scenario's ``data_dir``, if set, is an existing folder that holds
    something where it may be listed (an empty one fails every trial, each spending one of the
    budget's); where trials run on a Dask cluster it is a path on the cluster's machines, and is
    not checked here."""
    data_dir = scenario.data_dir
    if data_dir is None or scenario.resources.cluster is not None:
        return
    if not data_dir.is_dir():
        problem = "is a file, not a folder" if data_dir.exists() else "not found"
        raise InputError(f"data_dir: {data_dir} {problem}")
    try:
        empty = next(data_dir.iterdir(), None) is None
    except OSError:  # a folder that may be entered, not listed: its files may still be read by name
        return
    if empty:
        raise InputError(f"data_dir: {data_dir} is empty; put the data set there first")


def _check_template_paths(scenario: Scenario, entries: Sequence[tuple[Path, str, bool, Path]]) -> None:
    """InputError where the command or post_process names a template by its path from the
    scenario's folder (``sub/t.py``) while the trial folder holds it under another name (``t.py``)."""
    names = {name for _, name, _, _ in entries}
    written_as = {source: name for source, name, _, _ in entries}
    commands = {"command": scenario.command, "objective.post_process": scenario.objective.post_process or ()}
    for field, argv in commands.items():
        for arg in argv:
            if arg.startswith("-") or Path(arg).is_absolute() or os.path.normpath(arg) in names:
                continue
            name = written_as.get(Path(os.path.normpath(scenario.folder / arg)))
            if name is not None:
                top = Path(os.path.normpath(arg)).parts[0]
                keep = f", or use the folder {top}/ as the template to keep its path" if top != ".." else ""
                raise InputError(f"{field}: template {arg} is written into the trial folder as {name}; "
                                 f"write {name}{keep}")


def trial_seed(seed: int, number: int) -> int:
    """The per-trial seed that templates see as ``trial_seed``: the study's seed plus
    ``number`` (the trial's place among the study's new configurations: :mod:`hpo.scheduler`;
    by default its trial number), so trials differ and a study repeats, kept in [0, 2**31)."""
    return (seed + number) % 2**31


def write_files(folder: Path, files: Sequence[TrialFile]) -> None:
    """Write ``files`` into ``folder`` (created if need be); :class:`FolderFull` where its
    disk is full."""
    with folder_writes(folder):
        folder.mkdir(parents=True, exist_ok=True)
    for file in files:
        target = folder / file.name
        with folder_writes(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            if file.link is not None:
                if target.is_symlink():  # written before, by a try the full disk stopped
                    target.unlink()
                target.symlink_to(file.link, target_is_directory=True)
            else:
                target.write_bytes(file.data)
                target.chmod(file.mode)


def _copied(template: Path) -> bytes:
    """The bytes of ``template``, a file copied as it is into each trial folder (read for each
    trial); InputError where it cannot be read (the trial fails with that reason)."""
    try:
        return template.read_bytes()
    except OSError as exc:
        raise InputError(f"template {template.name}: cannot read {template}: {exc.strerror or exc}") from None


class Renderer:
    """Compiles a scenario's templates once; renders them into one folder per trial.

    Construction raises :class:`InputError` for a missing template, a syntax error, a
    ``data_dir`` that is not a folder or is empty, a command that names a template by a path the trial
    folder does not hold it under, or a placeholder in the command or ``env`` (:func:`_check_unrendered`).
    A template folder's files leave out ``workdir`` (the trial folders' folder) and any other
    study's workdir in it.
    """

    def __init__(self, scenario: Scenario, workdir: Path | None = None) -> None:
        self._scenario = scenario
        self._renderers: list[tuple[str, Callable[[Mapping[str, Any]], str] | None, Path]] = []
        self._links: dict[str, Path] = {}  # a trial folder's links to folders, by name: what each holds
        self._modes: dict[str, int] = {}  # the mode bits of each file, by name
        _check_data_dir(scenario)
        _check_unrendered(scenario)
        entries = _entries(scenario.template, workdir)
        names: set[str] = set()
        for template, name, rendered, folder in entries:
            if name in names or name in RESERVED_FILES:
                raise InputError(f"template: two files would be written as {name}")
            names.add(name)
            render = None
            if rendered:
                try:
                    text = template.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    raise InputError(f"template {template.name}: not a UTF-8 text file") from None
                render = _dollar(template, text) if scenario.syntax == "dollar" else _jinja(template, text, folder)
            if template in scenario.template:  # named on its own: a folder brings a project's files as they are
                _check_placeholders(scenario, template, rendered)
            if template.is_dir():
                self._links[name] = self._link(name, template)
            else:  # kept from the start, as the text is: a file saved by renaming it is briefly gone
                self._modes[name] = template.stat().st_mode & 0o777
            self._renderers.append((name, render, template))
        _check_template_paths(scenario, entries)

    def _link(self, name: str, target: Path) -> Path:
        """What the trial folder's link ``name`` to the folder ``target`` holds: where ``target``
        lies in the trial folder, relative to the link, if it is in a template folder (rendered
        there); else ``target`` itself."""
        for template in self._scenario.template:
            root = template.resolve()
            if template.is_dir() and target.is_relative_to(root):
                return Path(os.path.relpath(target.relative_to(root.parent), PurePosixPath(name).parent))
        return target

    @property
    def scenario(self) -> Scenario:
        """The scenario whose templates this renders."""
        return self._scenario

    @property
    def sees_trial_seed(self) -> bool:
        """Whether a trial's ``trial_seed`` reaches it other than through ``params.json``: a
        template reads it, or ``seed_flag`` passes it to the command (the templates are read
        again: only ``hpo rerun --seed`` asks)."""
        return self._scenario.seed_flag is not None or any(
            "trial_seed" in _variables(template.read_text(encoding="utf-8"), self._scenario.syntax)
            for _, render, template in self._renderers if render is not None)

    @property
    def unexecutable(self) -> frozenset[str]:
        """The names of the trial folder's files that no one may execute (their templates'
        modes are kept: a script without the execute bit cannot be the command's program)."""
        return frozenset(name for name, mode in self._modes.items() if not mode & 0o111)

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the files the templates become in a trial folder."""
        return tuple(name for name, _, _ in self._renderers)

    def context(self, number: int, folder: Path, params: Mapping[str, Any], seed: int | None = None) -> dict[str, Any]:
        """The variables a template sees for this trial (``seed`` overrides ``trial_seed``)."""
        context: dict[str, Any] = dict(params)
        study_seed = self._scenario.search.seed
        context.update(trial_number=number, trial_dir=str(folder), seed=study_seed,
                       trial_seed=trial_seed(study_seed, number) if seed is None else seed)
        if self._scenario.data_dir is not None:
            context["data_dir"] = str(self._scenario.data_dir)
        return context

    def render_texts(self, number: int, folder: Path, params: Mapping[str, Any],
                     seed: int | None = None) -> dict[str, str]:
        """Render every rendered template in memory (a pre-flight check writes nothing)."""
        context = self.context(number, folder, params, seed)
        return {name: render(context) for name, render, _ in self._renderers if render is not None}

    def files(self, number: int, folder: Path, params: Mapping[str, Any], argv: Sequence[str],
              seed: int | None = None, post: Sequence[str] = ()) -> tuple[TrialFile, ...]:
        """The trial folder's files: rendered templates, copied files, ``params.json`` and
        ``command.txt``, in memory (written by :func:`write_files` wherever the trial runs).
        ``command.txt`` runs the trial again from a copy of its folder (``sh command.txt``): the
        scenario's ``env`` comes first, through ``env``; then ``post`` (the post_process's
        argument list), where the command succeeded."""
        texts = self.render_texts(number, folder, params, seed)
        out = []
        for name, render, template in self._renderers:
            if name in self._links:
                out.append(TrialFile(name, b"", link=self._links[name]))
                continue
            out.append(TrialFile(name, _copied(template) if render is None else texts[name].encode(), self._modes[name]))
        context = self.context(number, folder, params, seed)
        record = {"trial": number, "params": dict(params), "trial_seed": context["trial_seed"]}
        out.append(TrialFile(PARAMS_FILE, (json.dumps(record, indent=2) + "\n").encode()))
        env = [f"{name}={value}" for name, value in self._scenario.env.items()]
        lines = [shlex.join([*(["env", *env] if env else []), *command]) for command in (argv, post) if command]
        out.append(TrialFile(COMMAND_FILE, (" && \\\n  ".join(lines) + "\n").encode()))
        return tuple(out)
