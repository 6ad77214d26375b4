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


SHARED_FIXTURE_GROUPS = {"replica_servers": "replica_servers"}
"""Session fixtures that several test files share (fixture name: xdist group): under `--dist loadgroup` the files
using one run in the same worker, which starts it once."""


def pytest_collection_modifyitems(config, items):
    # pytest-xdist `--dist loadgroup` (make test): a test file is one unit of work, as under `loadfile` (its module
    # fixtures are set up once), except that files sharing a session fixture form one unit.
    groups: dict[str, str] = {}
    for item in items if config.pluginmanager.hasplugin("xdist") else ():
        shared = [g for name, g in SHARED_FIXTURE_GROUPS.items() if name in getattr(item, "fixturenames", ())]
        if shared:
            groups[item.nodeid.split("::")[0]] = shared[0]
    for item in items if config.pluginmanager.hasplugin("xdist") else ():
        path = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(groups.get(path, path)))
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
