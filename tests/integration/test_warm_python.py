"""tests/helpers/warm_python.py: a command forked from the warm interpreter sees what a fresh `python` would show it
(argv, `__main__`, `__file__`, sys.path, the working directory, the environment, its streams, its session, the
thread count OMP_NUM_THREADS asks for) and ends as it would (exit status, an uncaught exception, a signal); a request
whose environment changes what the preloaded libraries read at import goes to a warm interpreter started with it.

Each probe runs both ways and the observations are compared, except what tells them apart (whether Megatron was
already imported when the script started, and the pid)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import warm_python

REPO = Path(__file__).resolve().parents[2]

PROBE = '''
"""probe docstring"""
import ctypes, json, os, sys, threading
warm = "megatron.core" in sys.modules
import torch
import huggingface_hub.constants
record = {"offline": huggingface_hub.constants.HF_HUB_OFFLINE, "argv": sys.argv, "name": __name__, "file": __file__, "doc": __doc__, "path0": sys.path[0],
          "repo_on_path": any(p == REPO for p in sys.path), "cwd": os.getcwd(), "marker": os.environ.get("PROBE_MARKER"),
          "threads": torch.get_num_threads(), "own_session": os.getsid(0) == os.getpid(), "warm": warm,
          "main_is_me": sys.modules["__main__"].__dict__ is globals()}
gomp = [p for p in open("/proc/self/maps").read().split() if p.endswith("libgomp.so.1")]
seen = []  # OpenMP's default thread count as a thread started now sees it (vLLM's CPU attention checks it)
thread = threading.Thread(target=lambda: seen.append(ctypes.CDLL(gomp[0]).omp_get_max_threads()))
thread.start()
thread.join()
record["omp_new_thread"] = seen[0]
import tests.helpers.warm_python
record["forked_child"] = tests.helpers.warm_python._forked_child  # its own commands then run fresh
print(json.dumps(record))
print("to stderr", file=sys.stderr)
if len(sys.argv) > 1 and sys.argv[1] == "fail":
    raise ValueError("the probe failed on purpose")
if len(sys.argv) > 1 and sys.argv[1] == "sleep":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 0)
'''


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "HF_HUB_OFFLINE": "1", **extra}


def _both(tmp_path: Path, *args: str, env: dict | None = None, module: bool = False, **kwargs):
    """(warm, fresh) CompletedProcess of the probe (a script in tmp_path/scripts, or `-m probe_mod`)."""
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    (scripts / "probe.py").write_text(PROBE.replace("REPO", repr(str(REPO))))
    (scripts / "probe_mod.py").write_text(PROBE.replace("REPO", repr(str(REPO))))
    env = env or _env(PROBE_MARKER="m", OMP_NUM_THREADS="1")
    if module:
        env = {**env, "PYTHONPATH": str(scripts) + os.pathsep + env["PYTHONPATH"]}
    command = [sys.executable, "-m", "probe_mod", *args] if module else [sys.executable, "scripts/probe.py", *args]
    results = []
    for fresh in ("0", "1"):
        results.append(warm_python.run(command, cwd=tmp_path, env={**env, warm_python.FRESH_ENV: fresh},
                                       capture_output=True, text=True, timeout=300, **kwargs))
    return results


def _record(proc) -> dict:
    return json.loads(proc.stdout.splitlines()[0])


def test_a_warm_script_sees_what_a_fresh_interpreter_shows_it(tmp_path):
    warm, fresh = _both(tmp_path, "3")
    assert warm.returncode == fresh.returncode == 3
    assert warm.stderr.strip() == fresh.stderr.strip() == "to stderr"
    w, f = _record(warm), _record(fresh)
    assert w.pop("warm") is w.pop("forked_child") is True and f.pop("warm") is f.pop("forked_child") is False
    assert w == f
    assert f["argv"] == ["scripts/probe.py", "3"] and f["name"] == "__main__" and f["doc"] == "probe docstring"
    assert f["file"] == str(tmp_path / "scripts" / "probe.py") and f["path0"] == str(tmp_path / "scripts")
    assert f["marker"] == "m" and f["threads"] == f["omp_new_thread"] == 1 and f["main_is_me"] and f["repo_on_path"]


def test_a_warm_module_run_and_a_new_session_match_a_fresh_one(tmp_path):
    warm, fresh = _both(tmp_path, module=True, start_new_session=True)
    assert warm.returncode == fresh.returncode == 0
    w, f = _record(warm), _record(fresh)
    assert w.pop("warm") is w.pop("forked_child") is True and f.pop("warm") is f.pop("forked_child") is False
    assert w == f and f["own_session"] and f["path0"] == str(tmp_path) and f["argv"][0].endswith("probe_mod.py")


def test_an_uncaught_exception_and_a_kill_end_a_warm_run_as_a_fresh_one(tmp_path):
    warm, fresh = _both(tmp_path, "fail")
    assert warm.returncode == fresh.returncode == 1
    for proc in (warm, fresh):
        assert proc.stderr.rstrip().endswith("ValueError: the probe failed on purpose"), proc.stderr
    log = tmp_path / "sleep.log"
    with open(log, "w") as out:
        proc = warm_python.Popen([sys.executable, "scripts/probe.py", "sleep"], cwd=tmp_path, env=_env(), stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while not log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None and json.loads(log.read_text().splitlines()[0])["warm"]
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL == proc.returncode


def test_what_the_preloaded_libraries_read_at_import_is_the_requests_own(tmp_path):
    """HF_HUB_OFFLINE, read when huggingface_hub is imported (by the preloaded transformers), set and unset, and
    OpenMP's default without OMP_NUM_THREADS: each request's probe reads its own values, through a warm interpreter
    of that environment."""
    online = {k: v for k, v in _env().items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS")}
    for env, expected in ((online, False), ({**online, "HF_HUB_OFFLINE": "1"}, True)):
        warm, fresh = _both(tmp_path, env=env)
        w, f = _record(warm), _record(fresh)
        assert w.pop("warm") is w.pop("forked_child") is True and f.pop("warm") is f.pop("forked_child") is False
        assert w == f and f["offline"] is expected and f["omp_new_thread"] == os.cpu_count()  # OMP_NUM_THREADS unset


def test_a_new_import_time_setting_stops_the_least_recently_used_idle_warm_interpreter(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_python, "MAX_WARM", 1)
    for value in ("error", "warning"):
        warm, _ = _both(tmp_path, env=_env(TRANSFORMERS_VERBOSITY=value))
        assert _record(warm)["warm"] is True
    [(key, kept)] = warm_python._warms.items()
    assert ("TRANSFORMERS_VERBOSITY", "warning") in key and kept.running == 0


def _probe_in_a_rank(tmp: str) -> dict:
    from tests.distributed.launcher import _live_children

    scripts = Path(tmp) / "scripts"
    scripts.mkdir(exist_ok=True)
    (scripts / "probe.py").write_text(PROBE.replace("REPO", repr(str(REPO))))
    done = warm_python.run([sys.executable, "scripts/probe.py"], cwd=tmp, env=_env(), capture_output=True, text=True,
                           timeout=300)
    return {**_record(done), "children": _live_children()}


def test_a_launcher_rank_runs_its_commands_fresh_and_keeps_no_warm_interpreter(tmp_path):
    """A rank's command runs fresh: a warm interpreter started there would be a child left alive after the body."""
    from tests.distributed.launcher import run_distributed

    [record] = run_distributed(_probe_in_a_rank, 1, str(tmp_path))
    assert record["warm"] is False and record["children"] == []
