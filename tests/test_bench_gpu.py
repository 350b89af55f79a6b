"""bench/gpu.py's plain loop builds each template's own model and optimizer.

The GPU bench compares every template against the same training written out plainly; the
plain loop takes the network and the optimizer from the rendered script (``make_model``,
``make_optimizer``). This checks that contract on the CPU sizes, one short epoch each, so a
template change cannot break the bench where no GPU runs it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import gpu


@pytest.mark.parametrize("work", gpu.workloads(gpu=False), ids=lambda work: work.name)
def test_the_plain_loop_trains_the_templates_model_and_optimizer(
        work: gpu.Workload, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = gpu.render(work, tmp_path / "trial", tmp_path / "no-data-read", epochs=1)
    _, _, shape = gpu.sizes(work, gpu=False)

    gpu.plain_loop(work, tmp_path / "trial" / argv[0], 2 * work.batch_size, 64, shape, epochs=1)

    line = capsys.readouterr().out.strip()
    assert line.startswith("epoch 1 val_error ")
    assert 0.0 <= float(line.split()[-1]) <= 1.0
