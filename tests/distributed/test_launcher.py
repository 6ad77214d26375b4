"""tests/distributed/launcher.py: a kept world runs body after body, each starting as a fresh rank would; a failed
body's world, or one a body left a child process in, is replaced; the failing rank's traceback is reported.

Runs on the world of 2 that the distributed tier keeps anyway (under a second when it is warm) and, where a world
must be replaced, on worlds of 1 (the cheapest to start)."""

import os
import re

import pytest
import torch

from tests.distributed.launcher import run_distributed


def _dirty_the_rank(leave_child: bool) -> int:
    """Change everything a body may change that the launcher restores; join a process group and leave it up."""
    import subprocess

    import torch.distributed as dist

    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel

    init_parallel(ParallelConfig(tp_size=int(os.environ["WORLD_SIZE"])), seed=0)
    os.environ["LAUNCHER_TEST_LEAK"] = "1"
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    dist.barrier()
    if leave_child:
        subprocess.Popen(["sleep", "20"])
    return os.getpid()


def _fresh_state(expected_cwd: str) -> dict:
    import torch.distributed as dist

    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel

    state = {"pid": os.getpid(), "pg_was_up": dist.is_initialized(), "leak": os.environ.get("LAUNCHER_TEST_LEAK"),
             "cwd_ok": os.getcwd() == expected_cwd, "dtype": torch.get_default_dtype(),
             "grad": torch.is_grad_enabled(), "threads": torch.get_num_threads()}
    ps = init_parallel(ParallelConfig(tp_size=int(os.environ["WORLD_SIZE"])), seed=0)  # the next rendezvous works (fresh MASTER_PORT)
    state["tp_rank"] = ps.tp_rank
    return state


def _fail() -> None:
    raise ValueError(f"pid {os.getpid()} says no")


def test_a_kept_world_runs_the_next_body_as_a_fresh_rank_would():
    pids = run_distributed(_dirty_the_rank, 2, False)
    states = run_distributed(_fresh_state, 2, os.getcwd())
    assert [s["pid"] for s in states] == pids, "the world of 2 was not kept"
    for s in states:
        assert not s["pg_was_up"] and s["leak"] is None and s["cwd_ok"], s
        assert s["dtype"] == torch.float32 and s["grad"] and s["threads"] == 1, s
    assert sorted(s["tp_rank"] for s in states) == [0, 1]


def test_a_world_left_with_a_child_process_or_a_failure_is_replaced():
    """On a world of 1 (the cheapest to replace); test_parallel_state checks the message names the failing rank."""
    left_child = run_distributed(_dirty_the_rank, 1, True)
    with pytest.raises(AssertionError, match=r"(?s)_fail failed on 1 ranks:\n--- rank 0: .*says no") as error:
        run_distributed(_fail, 1)
    failed_pid = int(re.search(r"pid (\d+) says no", str(error.value)).group(1))
    assert failed_pid not in left_child, "a world with a leftover child process was reused"
    after = [s["pid"] for s in run_distributed(_fresh_state, 1, os.getcwd())]
    assert failed_pid not in after, "a world whose body failed was reused"
