"""A long study read whole, for the commands that read it once (status, export, best).

The rows of finished trials come from :mod:`hpo.rowcache`'s file; the storage is asked only
for the unfinished trials and those finished since, through Optuna's public storage API,
one trial at a time up to :data:`SNAPSHOT_FETCH_LIMIT` of them, else in one read of all.
"""
from __future__ import annotations

from collections.abc import Callable

import optuna
from optuna.trial import TrialState

from hpo import rowcache
from hpo.rows import TrialRow, presented
from hpo.store import STUDY_CREATED, StudyStore, read_row

SNAPSHOT_FETCH_LIMIT = 500


def snapshot(store: StudyStore) -> list[TrialRow]:
    """Every trial of ``store``'s study as a :class:`TrialRow`, by number, updating the cache
    file; a store other than a database is read whole (:meth:`StudyStore.rows`)."""
    storage = store.optuna_storage
    if not isinstance(storage, optuna.storages.RDBStorage):
        return store.rows()
    sid, call, scenario = store.study_id, store.call, store.scenario
    created = call(storage.get_study_user_attrs, sid).get(STUDY_CREATED, "")
    path, key = rowcache.cache_path(store.url, scenario.name), f"{scenario.name}:{sid}:{created}"
    cache = rowcache.load(path)
    cached = {row.number: row for row in cache.finished} if cache is not None and cache.key == key else {}
    rows = {t.number: read_row(t) for t in call(storage.get_all_trials, sid, deepcopy=False,
                                                    states=(TrialState.RUNNING, TrialState.WAITING))}
    known = set(cached) | set(rows)
    count = count_trials(_exists(store), max(known, default=-1) + 1)
    missing = [n for n in range(count) if n not in known]
    if len(missing) > SNAPSHOT_FETCH_LIMIT:
        fresh = [read_row(t) for t in call(storage.get_all_trials, sid, deepcopy=False)]
    else:
        fresh = [read_row(call(storage.get_trial, store.trial_id(n))) for n in missing]
    for row in fresh:
        (cached if row.outcome.ended else rows)[row.number] = row
    unfinished = tuple(row for _, row in sorted(rows.items()))
    quiet = store.quiet_stamp
    if any(row.outcome.ended for row in fresh) or cache is None or cache.key != key or \
            (quiet is not None and (cache.stamp, cache.unfinished) != (quiet, unfinished)):
        rowcache.save(path, rowcache.Cached(key, rowcache.objective_of(scenario.objective),
                                           [row for _, row in sorted(cached.items())], quiet, unfinished))
    return presented([row for _, row in sorted({**cached, **rows}.items())], scenario.parameters)


def _exists(store: StudyStore) -> Callable[[int], bool]:
    """A test of whether ``store``'s study has the trial of a given number (its storage id is found)."""
    def exists(number: int) -> bool:
        try:
            store.trial_id(number)
        except KeyError:
            return False
        return True

    return exists


def count_trials(exists: Callable[[int], bool], at_least: int) -> int:
    """The first number ``n`` for which ``exists(n)`` is False, where it is True for every number
    below ``n`` and False for every one above (0 if ``exists(at_least - 1)`` is False): a doubling
    search from ``at_least``, then a bisection, in O(log n) calls."""
    if at_least > 0 and not exists(at_least - 1):
        return 0
    low, step = at_least, 1
    while exists(low + step - 1):
        low, step = low + step, step * 2
    high = low + step - 1
    while low < high:
        middle = (low + high) // 2
        if exists(middle):
            low = middle + 1
        else:
            high = middle
    return low
