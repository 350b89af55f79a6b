"""smac's forest in a helper process (hpo.forest_service): the same candidates and random
draws as in this process, the work done here when the helper fails, no helper left behind, and
a sweep that starts one only where its forest proposes."""
from __future__ import annotations

import io
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_env

from hpo import forest, forest_service
from hpo.cli import main
from hpo.codec import Codec
from hpo.scenario import Param

SETTINGS = {"n_trees": 10, "max_points": 256, "n_random": 200, "n_starts": 5}


@pytest.fixture(autouse=True)
def no_helper_after() -> Iterator[None]:
    yield
    forest_service.stop()


Rows = tuple[np.ndarray, np.ndarray, np.ndarray]


def observations(n: int = 60) -> tuple[Codec, Rows]:
    """A codec, and observed rows, their costs and pending rows."""
    codec = Codec({"lr": Param(type="float", low=1e-4, high=1.0, log=True), "layers": Param(type="int", low=1, high=6),
                   "act": Param(type="categorical", choices=("relu", "tanh"))})
    rng = np.random.default_rng(7)
    x = codec.sample(n, rng)
    y = (x[:, 0] - 0.3) ** 2 + 0.1 * x[:, 1] + 0.05 * x[:, 2]
    pending = codec.sample(2, rng)
    return codec, (x, y, pending)


def ranked_here(codec: Codec, seen: Rows, seed: int) -> tuple[np.ndarray, np.random.Generator]:
    rng = np.random.default_rng(seed)
    return forest.ranked(codec, *seen, f"here-{seed}", rng, **SETTINGS), rng


def test_the_helper_ranks_the_candidates_and_draws_as_this_process_does() -> None:
    codec, seen = observations()
    forest_service.start()
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        candidates = forest_service.ranked(codec, *seen, f"helper-{seed}", rng, **SETTINGS)
        expected, expected_rng = ranked_here(codec, seen, seed)
        np.testing.assert_array_equal(candidates, expected)
        assert rng.random() == expected_rng.random()
    helper = forest_service._helper
    assert helper is not None and helper.process.poll() is None


def test_without_a_helper_the_work_is_done_here() -> None:
    codec, seen = observations()
    rng = np.random.default_rng(3)
    candidates = forest_service.ranked(codec, *seen, "no-helper", rng, **SETTINGS)
    np.testing.assert_array_equal(candidates, ranked_here(codec, seen, 3)[0])


def test_a_helper_that_died_leaves_the_work_to_this_process() -> None:
    codec, seen = observations()
    forest_service.start()
    helper = forest_service._helper
    assert helper is not None
    helper.process.kill()
    helper.process.wait()
    rng = np.random.default_rng(4)
    candidates = forest_service.ranked(codec, *seen, "after-death", rng, **SETTINGS)
    np.testing.assert_array_equal(candidates, ranked_here(codec, seen, 4)[0])
    assert forest_service._helper is None


def test_the_helper_unpickles_its_work_without_pydantic_or_optuna() -> None:
    """The helper imports scikit-learn and hpo.forest before its first answer, nothing slower:
    a codec pickles as plain data, so the helper's copy needs neither the scenario's pydantic
    models nor Optuna, scikit-learn comes without pandas and rich, and it ranks what this
    process would."""
    codec, seen = observations()
    request = pickle.dumps((codec, *seen))
    script = textwrap.dedent("""\
        import pickle, sys
        import numpy as np
        from hpo import forest_service
        forest_service._import_forests()
        from hpo import forest
        codec, x, y, pending = pickle.loads(sys.stdin.buffer.read())
        rows = forest.ranked(codec, x, y, pending, "copy", np.random.default_rng(9), n_trees=10, max_points=256,
                             n_random=200, n_starts=5)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("pydantic", "optuna", "hpo", "pandas", "rich")))
        np.save(sys.stdout.buffer, rows)
        """)
    run = subprocess.run([sys.executable, "-c", script], input=request, capture_output=True, env=cli_env(), check=True)
    modules, _, saved = run.stdout.partition(b"\n")
    assert modules.decode() == "['hpo', 'hpo.codec', 'hpo.forest', 'hpo.forest_service', 'hpo.space']"
    np.testing.assert_array_equal(np.load(io.BytesIO(saved)), ranked_here(codec, seen, 9)[0])
    assert codec.decode(codec.sample(1, np.random.default_rng(0))[0]) == \
        pickle.loads(pickle.dumps(codec)).decode(codec.sample(1, np.random.default_rng(0))[0])


def test_the_helper_exits_when_its_process_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""\
            import time
            from hpo import forest_service
            forest_service.start()
            print(forest_service._helper.process.pid, flush=True)
            time.sleep(60)
            """)], stdout=subprocess.PIPE, text=True, env=cli_env())
    assert parent.stdout is not None
    helper_pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while _alive(helper_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(helper_pid)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, which init reaps, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sweep_keeps_the_helper_only_where_the_forest_proposes(write_scenario, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A conditional space is the forest's from the first model-based proposal: the helper
    answers each of them (a failed helper would be gone); a small continuous space within
    the GP's reach needs none."""
    monkeypatch.setenv("HPO_GPUS", "")
    conditional = write_scenario(
        tmp_path / "forest", search={"method": "smac", "trials": 8, "seed": 3},
        parameters={"x": {"type": "float", "low": 0.0, "high": 1.0},
                    "opt": {"type": "categorical", "choices": ["a", "b"]},
                    "momentum": {"type": "float", "low": 0.0, "high": 0.9, "condition": {"opt": "a"}}})
    assert main(["run", str(conditional)]) == 0
    helper = forest_service._helper
    assert helper is not None and helper.process.poll() is None
    forest_service.stop()
    small = write_scenario(tmp_path / "gp", search={"method": "smac", "trials": 3, "seed": 3})
    assert main(["run", str(small)]) == 0
    assert forest_service._helper is None
