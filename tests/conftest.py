"""Shared test set-up: the gpu marker skips without CUDA (and gpu-marked tests live in tests/gpu); the Triton interpreter is on without a GPU; a full run
fails if a tier collected no tests (so an import error or a misnamed file cannot make a tier vanish silently).
Plugins: tests/timings.py (where the suite's time goes) and tests/helpers/replica_servers.py (one pair of rollout
servers for the session); tests/distributed/launcher.py keeps one gloo world per size for the session."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: must be set before triton is imported anywhere; kernels then run under the numpy interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests.timings: --timings-file, where the suite's time goes (python -m tests.timings FILE);
# tests.helpers.replica_servers: the session's pair of rollout servers (fixture `replica_servers`)
pytest_plugins = ["tests.timings", "tests.helpers.replica_servers"]

TIERS = ("unit", "distributed", "kernels", "integration")


SHARED_FIXTURE_FILES = {
    "replica_servers": (
        "tests/integration/test_async_rollout.py", "tests/integration/test_bad_inputs_server.py",
        "tests/integration/test_rollout_server.py",
    ),
}
"""Session fixtures that several test files share (fixture name: the files using it). Under xdist the files using
one form one unit of work, so one worker starts the fixture once; collection fails if another file uses it."""


SHARED_WORLD_FILES = {
    "tp2_world": ("tests/kernels/test_vocab_parallel.py", "tests/kernels/test_onepass_tp.py"),
}
"""Files of the fast tiers whose tests run on the launcher's kept gloo world of one size (tests/distributed/launcher.py)
(world name: the files). One unit of work under xdist, so one worker starts that world (two ranks importing torch and
Megatron) once for them instead of each worker once."""


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under `make test`'s xdist run: its file, or the shared fixture's (world's)
    name for the files of `SHARED_FIXTURE_FILES` (`SHARED_WORLD_FILES`): a file's module fixtures, a kept world, are
    then set up once, in one worker."""
    path = nodeid.split("::")[0]
    shared = {**SHARED_FIXTURE_FILES, **SHARED_WORLD_FILES}
    return next((name for name, files in shared.items() if path in files), path)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` schedules by `work_unit`.

    NOTE: pytest-xdist 3.8 with pytest 9.2: xdist's loadgroup writes the group into `item._nodeid`, which pytest 9.2's
    node ids no longer read, so every test became its own unit (a file's module fixtures set up in both workers).
    The scheduler here groups by `work_unit` from the node id itself and needs no marks."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, files in SHARED_FIXTURE_FILES.items():
            path = item.nodeid.split("::")[0]
            if name in getattr(item, "fixturenames", ()) and path not in files:
                raise pytest.UsageError(f"{path} uses the session fixture {name!r}: add it to SHARED_FIXTURE_FILES in tests/conftest.py")
    stray = [item.nodeid for item in items if "gpu" in item.keywords and not item.nodeid.startswith("tests/gpu/")]
    if stray:  # `make test-gpu` and the GPU suite run tests/gpu: a gpu-marked test elsewhere would never run there
        raise pytest.UsageError(f"gpu-marked tests must live in tests/gpu: {stray}")
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (gpu-marked)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_collection_finish(session):
    args = [os.path.normpath(str(a)) for a in session.config.args]
    if args not in (["tests"], ["."]) or session.config.getoption("-k") or session.config.getoption("-m"):
        return  # a partial run: no tier check
    counts = {tier: 0 for tier in TIERS}
    for item in session.items:
        parts = item.nodeid.split("/")
        if len(parts) > 2 and parts[1] in counts:
            counts[parts[1]] += 1
    empty = [tier for tier, n in counts.items() if n == 0]
    if empty:
        raise pytest.UsageError(f"test tiers with no collected tests: {empty} (counts {counts})")
