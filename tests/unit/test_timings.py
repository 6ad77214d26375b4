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


def test_summary_says_how_busy_the_machine_was_per_test_and_over_the_run():
    records = [{"kind": "phase", "nodeid": "tests/integration/test_b.py::test_y", "tier": "integration", "when": w,
                "seconds": s, "outcome": "passed", "busy_cores": c} for w, s, c in (("setup", 10.0, 2.0), ("call", 30.0, 1.0))]
    records.append({"kind": "session", "seconds": 41.0, "workers": 0, "cpus": 2, "busy_cores": 1.2,
                    "load_start": 0.5, "load_end": 1.5})
    text = summarise(records, top=5)
    assert "the machine's CPUs busy 1.20 of 2 on average, load average 0.5 at the start and 1.5 at the end" in text
    slowest = text.splitlines()[text.splitlines().index(
        "slowest 5 tests (setup + call + teardown, seconds; busy cores: the machine's mean while it ran):") + 1]
    assert "cores 1.25" in slowest  # (10 x 2 + 30 x 1) / 40


def test_the_recorder_reads_the_machines_cpu_time_and_it_advances():
    from tests.timings import machine_cpu_busy_s

    first = machine_cpu_busy_s()
    sum(i * i for i in range(2_000_000))  # keep one core busy a little
    assert first is not None and machine_cpu_busy_s() > first
