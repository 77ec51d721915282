"""tests/schedule.py: the workers take the longest test files first, and a run records what each file cost."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests import schedule


def _items(*nodeids):
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_go_longest_first_and_keep_their_tests_order_with_the_unmeasured_last():
    items = _items("tests/a.py::t1", "tests/new.py::n1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t1",
                   "tests/b.py::t2", "tests/new.py::n2", "tests/other_new.py::o")
    costs = {"tests/a.py": 3.0, "tests/b.py": 40.0, "tests/c.py": 12.5}
    ordered = [i.nodeid for i in schedule.longest_first(items, costs)]
    assert ordered == ["tests/b.py::t1", "tests/b.py::t2", "tests/c.py::t1", "tests/a.py::t1", "tests/a.py::t2",
                       "tests/new.py::n1", "tests/new.py::n2", "tests/other_new.py::o"]
    # without a table the order is pytest's, files grouped as xdist's loadfile groups them anyway
    assert [i.nodeid for i in schedule.longest_first(items[:3], {})] == [i.nodeid for i in items[:3]]


def test_a_run_records_each_files_seconds_and_keeps_the_files_it_did_not_run(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"tests/kept.py": 7.0, "tests/a.py": 99.0}))
    plugin = schedule.LongestFirst({}, str(table))
    for nodeid, seconds in [("tests/a.py::t1", 1.25), ("tests/a.py::t1", 0.5), ("tests/a.py::t2", 2.0),
                            ("tests/b.py::t", 4.0)]:
        plugin.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    plugin.pytest_sessionfinish()
    assert json.loads(table.read_text()) == {"tests/a.py": 3.8, "tests/b.py": 4.0, "tests/kept.py": 7.0}
    assert schedule.load_costs(table) == {"tests/a.py": 3.8, "tests/b.py": 4.0, "tests/kept.py": 7.0}


def test_an_unreadable_table_leaves_the_order_alone(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    assert schedule.load_costs(tmp_path / "bad.json") == {}
    assert schedule.load_costs(tmp_path / "absent.json") == {}


def test_the_run_uses_the_committed_table_and_keeps_the_files_order(pytestconfig):
    """The suite itself: the committed table is read and xdist is told not to re-sort the files by test count."""
    costs = schedule.load_costs()
    assert costs and all(seconds >= 0 for seconds in costs.values())
    if hasattr(pytestconfig.option, "loadscopereorder"):
        assert pytestconfig.option.loadscopereorder is False
