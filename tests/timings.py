"""Where the suite's time goes: a pytest plugin that records it and a summary that prints it.

Plugin (loaded by tests/conftest.py): with `--timings-file PATH`, every test phase (setup / call / teardown, the
test's node id and tier) and every fixture set-up (name, scope, the test that triggered it) is appended to PATH as
one JSON line, as it happens, so a run cut short still leaves its record. Fixture set-up time is part of its test's
setup phase; a session- or module-scoped fixture is charged once, to the first test that needs it.

Each phase also records how busy the machine's CPUs were while it ran (all processes, from /proc/stat: the test's
own ranks, servers and children, and anything else running), and the session records the machine's load at its start
and end: a run's figures say how loaded a machine they were taken on, and a test using well under all cores is one a
parallel run could overlap.

Summary: `python -m tests.timings PATH... [--top N]` prints the time per tier (setup / call / teardown, summed over
tests) and each run's wall clock with the machine's CPU use, the N slowest tests (setup vs call), the N most expensive fixtures (all their
set-ups summed, with their count) and every kept test world started, with why. `make test` writes one file per pytest
run and prints this summary at the end, so every CI log shows it.

Must not: change what runs or how (it only observes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

TIERS = ("unit", "distributed", "kernels", "integration", "gpu")


def machine_cpu_busy_s() -> float | None:
    """Seconds of CPU time all of the machine's cores have spent not idle since boot (/proc/stat); None off Linux."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _load_average() -> float | None:
    try:
        with open("/proc/loadavg") as loadavg:
            return float(loadavg.read().split()[0])
    except (OSError, ValueError):
        return None


def tier_of(nodeid: str) -> str:
    """The tier folder of a node id (`tests/<tier>/...`), or "other"."""
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else "other"


class TimingRecorder:
    """Appends one JSON line per test phase, per fixture set-up and per kept test world started to a file.

    Under pytest-xdist the controller starts the file and records the phases (every worker's reports reach it) and
    the session's wall time; each worker appends the fixtures and world starts of the tests it runs."""

    def __init__(self, path: Path, worker: str | None = None, parallel: bool = False):
        """parallel: tests run in several xdist workers at once (then phases overlap: no per-phase CPU figure)."""
        self.path, self.worker, self.parallel = path, worker, parallel
        if worker is None:
            self.path.write_text("")
        self._file = open(path, "a", buffering=1)  # line-buffered: a killed run keeps what it recorded
        self._worlds_seen = 0
        self._start = self._last = time.perf_counter()
        self._busy_start = self._busy_last = machine_cpu_busy_s()
        self._load_start = _load_average()

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record if self.worker is None else {**record, "worker": self.worker}) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        start = time.perf_counter()
        yield
        self._write({"kind": "fixture", "name": fixturedef.argname, "scope": fixturedef.scope,
                     "nodeid": request.node.nodeid, "seconds": time.perf_counter() - start})

    def pytest_runtest_logreport(self, report):
        if self.worker is None:
            busy, now = machine_cpu_busy_s(), time.perf_counter()
            cores = None  # the machine's mean busy cores since the last report: this phase's, when tests run one by one
            if busy is not None and self._busy_last is not None and now > self._last and not self.parallel:
                cores = (busy - self._busy_last) / (now - self._last)
            self._busy_last, self._last = busy, now
            self._write({"kind": "phase", "nodeid": report.nodeid, "tier": tier_of(report.nodeid),
                         "when": report.when, "seconds": report.duration, "outcome": report.outcome,
                         "busy_cores": cores})
        launcher = sys.modules.get("tests.distributed.launcher")
        starts = getattr(launcher, "world_starts", [])
        for size, why in starts[self._worlds_seen:]:
            self._write({"kind": "world", "nodeid": report.nodeid, "size": size, "why": why})
        self._worlds_seen = len(starts)

    def pytest_sessionfinish(self, session):
        if self.worker is None:
            workers = getattr(session.config.option, "numprocesses", None) or 0
            seconds, busy = time.perf_counter() - self._start, machine_cpu_busy_s()
            self._write({"kind": "session", "seconds": seconds, "workers": workers, "cpus": os.cpu_count(),
                         "busy_cores": None if busy is None or self._busy_start is None else (busy - self._busy_start) / seconds,
                         "load_start": self._load_start, "load_end": _load_average()})

    def pytest_unconfigure(self, config):
        self._file.close()


def pytest_addoption(parser):
    parser.addoption("--timings-file", default=None, help="append per-phase and per-fixture timings (JSON lines) "
                     "to this file; summarise with `python -m tests.timings FILE`")


def pytest_configure(config):
    path = config.getoption("--timings-file")
    if path:
        worker = getattr(config, "workerinput", {}).get("workerid")  # set in pytest-xdist's workers
        parallel = bool(getattr(config.option, "numprocesses", None))
        config.pluginmanager.register(TimingRecorder(Path(path), worker, parallel), "grpo-timings")


def summarise(records: list[dict], top: int = 15) -> str:
    """The printed summary of a timings file's records (module docstring)."""
    phases = [r for r in records if r["kind"] == "phase"]
    by_tier: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    tests: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in phases:
        by_tier[r["tier"]][r["when"]] += r["seconds"]
        tests[r["nodeid"]][r["when"]] += r["seconds"]
    counts = defaultdict(int)
    for nodeid in tests:
        counts[tier_of(nodeid)] += 1
    lines = ["suite time per tier (seconds):", f"  {'tier':<12} {'tests':>6} {'setup':>8} {'call':>8} {'teardown':>9} "
             f"{'total':>8}"]
    total = 0.0
    for tier in sorted(by_tier, key=lambda t: -sum(by_tier[t].values())):
        t = by_tier[tier]
        tier_total = sum(t.values())
        total += tier_total
        lines.append(f"  {tier:<12} {counts[tier]:>6} {t['setup']:>8.1f} {t['call']:>8.1f} {t['teardown']:>9.1f} "
                     f"{tier_total:>8.1f}")
    lines.append(f"  {'all':<12} {len(tests):>6} {'':>8} {'':>8} {'':>9} {total:>8.1f}  ({total / 60:.1f} min)")
    for r in records:
        if r["kind"] == "session":
            busy = (f"; the machine's CPUs busy {r['busy_cores']:.2f} of {r['cpus']} on average, load average "
                    f"{r['load_start']} at the start and {r['load_end']} at the end") if r.get("busy_cores") is not None else ""
            lines.append(f"  wall clock {r['seconds']:.1f} s ({r['seconds'] / 60:.1f} min)"
                         + (f" with {r['workers']} pytest-xdist workers" if r["workers"] else "") + busy)
    busy_s: dict[str, float] = defaultdict(float)
    for r in phases:
        if r.get("busy_cores") is not None:
            busy_s[r["nodeid"]] += r["busy_cores"] * r["seconds"]
    show_cores = bool(busy_s)  # recorded only where tests run one at a time
    lines += ["", f"slowest {top} tests (setup + call + teardown, seconds"
              + ("; busy cores: the machine's mean while it ran" if show_cores else "") + "):"]
    for nodeid, t in sorted(tests.items(), key=lambda kv: -sum(kv[1].values()))[:top]:
        wall = sum(t.values())
        cores = f"  cores {busy_s[nodeid] / wall:4.2f}" if nodeid in busy_s and wall > 0 else ""
        lines.append(f"  {wall:7.1f}  setup {t['setup']:6.1f}  call {t['call']:6.1f}{cores}  {nodeid}")
    fixtures: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in records:
        if r["kind"] == "fixture":
            fixtures[(r["name"], r["scope"])].append(r["seconds"])
    lines += ["", f"most expensive {top} fixtures (all set-ups, seconds):"]
    for (name, scope), seconds in sorted(fixtures.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(seconds):7.1f}  x{len(seconds):<4} {scope:<8} {name}")
    worlds = [r for r in records if r["kind"] == "world"]
    if worlds:
        lines += ["", f"kept test worlds started: {len(worlds)} (tests/distributed/launcher.py; each costs a rank start)"]
        lines += [f"  size {r['size']}  at {r['nodeid']}: {r['why'][:300]}" for r in worlds]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, nargs="+", help="one file per pytest run (make test makes two)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    records = [json.loads(line) for path in args.path for line in path.read_text().splitlines() if line.strip()]
    print(summarise(records, args.top))


if __name__ == "__main__":
    main()
