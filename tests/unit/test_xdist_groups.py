"""`make test` runs the unit and kernel tiers under pytest-xdist with `--dist loadgroup`: tests/conftest.py marks
every test with its file's group, so a file is one unit of work and its module fixtures are set up once."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ("tests/unit/test_timings.py", "tests/unit/test_lint.py")


def test_a_files_tests_run_in_one_worker():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *FILES, "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, path in re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+?)::", done.stdout, flags=re.M):
        workers.setdefault(path, set()).add(worker)
    assert set(workers) == set(FILES), done.stdout[-3000:]
    split = {path: sorted(w) for path, w in workers.items() if len(w) > 1}
    assert not split, f"a file's tests ran in more than one worker: {split}"


def test_the_files_sharing_the_rollout_servers_or_a_world_are_one_unit_and_other_files_their_own():
    from tests.conftest import SHARED_FIXTURE_FILES, SHARED_WORLD_FILES, work_unit

    shared = SHARED_FIXTURE_FILES["replica_servers"]
    assert {work_unit(f"{path}::test_x[a]") for path in shared} == {"replica_servers"}
    tp2 = ("tests/kernels/test_vocab_parallel.py", "tests/kernels/test_onepass_tp.py")  # both run a kept TP-2 world
    assert set(SHARED_WORLD_FILES["tp2_world"]) == set(tp2)
    assert {work_unit(f"{path}::test_x") for path in tp2} == {"tp2_world"}
    assert work_unit("tests/unit/test_lint.py::test_ruff_finds_nothing") == "tests/unit/test_lint.py"
