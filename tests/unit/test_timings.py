"""tests/timings.py: the suite-time summary (per tier, slowest tests, most expensive fixtures) from recorded lines."""

from __future__ import annotations

from tests.timings import summarise, tier_of


def test_summary_charges_each_tier_and_ranks_tests_and_fixtures_by_time():
    phase = lambda nodeid, when, s: {"kind": "phase", "nodeid": nodeid, "tier": tier_of(nodeid), "when": when,  # noqa: E731
                                     "seconds": s, "outcome": "passed"}
    records = [phase("tests/unit/test_a.py::test_x", "call", 1.0), phase("tests/unit/test_a.py::test_x", "setup", 0.5),
               phase("tests/integration/test_b.py::test_y", "setup", 40.0),
               phase("tests/integration/test_b.py::test_y", "call", 5.0),
               {"kind": "fixture", "name": "engine", "scope": "module", "nodeid": "tests/integration/test_b.py::test_y",
                "seconds": 39.0},
               {"kind": "fixture", "name": "tmp_path", "scope": "function", "nodeid": "x", "seconds": 0.1},
               {"kind": "fixture", "name": "tmp_path", "scope": "function", "nodeid": "y", "seconds": 0.1}]
    text = summarise(records, top=5)
    lines = text.splitlines()
    assert lines[2].split() == ["integration", "1", "40.0", "5.0", "0.0", "45.0"]  # the costliest tier first
    assert lines[3].split() == ["unit", "1", "0.5", "1.0", "0.0", "1.5"]
    assert "46.5  (0.8 min)" in lines[4]
    slowest = lines[lines.index("slowest 5 tests (setup + call + teardown, seconds):") + 1]
    assert slowest.split()[0] == "45.0" and slowest.endswith("tests/integration/test_b.py::test_y")
    fixtures = lines[lines.index("most expensive 5 fixtures (all set-ups, seconds):") + 1:]
    assert fixtures[0].split() == ["39.0", "x1", "module", "engine"] and fixtures[1].split() == ["0.2", "x2", "function",
                                                                                                 "tmp_path"]
    assert tier_of("tests/other.py::t") == "other"
