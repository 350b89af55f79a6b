"""The optimizer benchmark's table compares smac with the best anchor by median and seed by
seed (bench/optimizers.py)."""
from __future__ import annotations

from bench.optimizers import Run, paired, report


def test_paired_counts_seeds_won_tied_and_lost_and_tests_the_differences() -> None:
    mine = {seed: 1.0 for seed in range(10)}
    assert paired(mine, {seed: 2.0 for seed in range(10)}) == "10-0-0 0.00"
    assert paired(mine, dict(mine)) == "0-10-0 1.00"
    other = {**{seed: 2.0 for seed in range(5)}, **{seed: 0.5 for seed in range(5, 9)}, 9: 1.0, 10: 3.0}
    wins, p = paired(mine, other).split()
    assert wins == "5-1-4"  # seed 10 is only in one of them
    assert 0.05 < float(p) < 1.0  # won by 1 on five seeds, lost by 0.5 on four: not significant


def test_the_table_names_the_best_anchor_and_smac_against_it_seed_by_seed() -> None:
    def run(method: str, seed: int, value: float) -> Run:
        return Run(method, "branin", seed, {50: value, 100: value}, 1.0)

    optimum = 0.397887
    runs = [run("smac", s, optimum + 0.01 * (s + 1)) for s in range(4)]
    runs += [run("gp", s, optimum + 0.02 * (s + 1)) for s in range(4)]
    runs += [run("tpe", s, optimum + 1.0) for s in range(4)]
    line = next(row for row in report(runs, [50], ["branin"]).splitlines() if row.startswith("branin"))
    assert line.split()[-4:] == ["0.50", "gp", "4-0-0", "0.12"]
