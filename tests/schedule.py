"""Longest files first: the order in which the xdist workers take the test files (`--dist loadfile`), from each
file's measured cost, so that a long file never starts last and leaves one worker running it alone.

xdist hands out whole files, by default the files with the most tests first; a run's wall time is then set by
whichever long file happens to start late (the slow tier's server soak alone is minutes). Ordering
the files by measured seconds, longest first, is the classic longest-processing-time schedule: every worker is
busy until the last file is handed out, and what one finishes after the other is at most one short file.

The costs are `tests/file_costs.json` (seconds per test file, setup, call and teardown summed over both tiers,
on this project's 2-core machine); a file missing from it (new) goes after the measured ones, in collection
order. Refresh it with both tiers:

    KVFORGE_RECORD_COSTS=tests/file_costs.json python3 -m pytest -q
    KVFORGE_RECORD_COSTS=tests/file_costs.json python3 -m pytest -q -m slow

A run records into the named file: the files it ran are replaced, the others kept. Only the order changes, never
which tests run or what they assert."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("file_costs.json")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_costs(path: Path = COSTS) -> dict[str, float]:
    """{test file (relative to the repository root, as in node ids): seconds}; empty where the table is absent or
    unreadable (the order is then pytest's own)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {name: float(seconds) for name, seconds in table.items() if isinstance(seconds, (int, float))}


def longest_first(items: list, costs: dict[str, float]) -> list:
    """`items` (pytest items, or anything with a `nodeid`) grouped by file, the files in descending cost; the
    unmeasured files after the measured ones in their first-seen order, and each file's tests in their own order."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_file_of(item.nodeid), len(first_seen))

    def key(item):
        name = _file_of(item.nodeid)
        return (name not in costs, -costs.get(name, 0.0), first_seen[name])

    return sorted(items, key=key)  # stable: a file's tests keep their order


class LongestFirst:
    def __init__(self, costs: dict[str, float], record: str | None):
        self.costs, self.record = costs, record
        self.spent: dict[str, float] = defaultdict(float)

    @pytest.hookimpl(trylast=True)  # after the -m selection: orders what runs
    def pytest_collection_modifyitems(self, items):
        items[:] = longest_first(items, self.costs)

    def pytest_runtest_logreport(self, report):
        # in the controller (which sees every worker's reports), or in a run without workers
        if self.record and not os.environ.get("PYTEST_XDIST_WORKER"):
            self.spent[_file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self):
        if not self.record or os.environ.get("PYTEST_XDIST_WORKER") or not self.spent:
            return
        path = Path(self.record)
        table = load_costs(path)
        table.update({name: round(seconds, 1) for name, seconds in self.spent.items()})
        path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")


def configure(config) -> None:
    """Registers the order (and the recording, where KVFORGE_RECORD_COSTS names a file); xdist is told to keep
    the collection's order of files rather than sort them by test count."""
    record = os.environ.get("KVFORGE_RECORD_COSTS")
    costs = load_costs()
    if hasattr(config.option, "loadscopereorder") and costs:
        config.option.loadscopereorder = False
    config.pluginmanager.register(LongestFirst(costs, record), "kvforge-longest-first")
