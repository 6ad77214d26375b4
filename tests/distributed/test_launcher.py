"""tests/distributed/launcher.py: a kept world runs body after body, each starting as a fresh rank would; a failed
body's world, or one a body left a child process in, is replaced; the failing rank's traceback is reported; a world
whose body started vLLM's groups (as every in-process engine does) is kept, with vLLM's state released.

Runs on the world of 2 that the distributed tier keeps anyway (under a second when it is warm) and, where a world
must be replaced, on worlds of 1 (the cheapest to start). The vLLM test stops its world of 2 after it (one restart,
about 10 s), so the rest of the tier runs on ranks that never imported vLLM."""

import glob
import os
import re

import pytest
import torch

from tests.distributed.launcher import close_worlds, run_distributed


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


_KEPT_GROUPS: list = []
"""A reference that outlives the body, as a module-level cache would keep one."""


def _keep_a_group_alive() -> int:
    """Join a process group, make a gloo subgroup and keep a reference to it past the body's teardown."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    _KEPT_GROUPS.append(dist.new_group(backend="gloo"))
    return os.getpid()


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



def test_a_world_whose_destroyed_groups_are_still_referenced_is_replaced():
    """Their gloo threads outlive the teardown and poll: an idle kept world would burn CPU."""
    kept = run_distributed(_keep_a_group_alive, 1)
    after = [s["pid"] for s in run_distributed(_fresh_state, 1, os.getcwd())]
    assert kept != after, "a world with live process-group threads was reused"
    again = [s["pid"] for s in run_distributed(_fresh_state, 1, os.getcwd())]
    assert again == after, "a clean world was replaced"


SHM_PREFIX = f"grpo-launcher-test-{os.getpid()}-"
"""VLLM_DIST_IDENT of the test's vLLM groups: their CPU shared memory is /dev/shm/<it><port>-tp:..-cpushm_<rank>.
The test process's pid in it: what another run left (or makes at the same time) is not this run's."""


def _start_vllm_groups(prefix: str) -> int:
    """What an engine of TP = world size leaves in a rank: vLLM imported, its world and TP groups on the trainer's
    process group (external_launcher's way) with their shared memory in /dev/shm (named `prefix` + the port), its
    VLLM_* cache frozen; one all-reduce through its TP group."""
    import vllm.envs
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as vps
    from vllm.platforms import current_platform

    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel

    # vLLM's ops (the CPU shared-memory communicator's among them) as vLLM loads them: the build for this CPU
    # (`import vllm._C` is the AVX-512 build: an illegal instruction on an AVX2-only CPU)
    current_platform.import_kernels()
    world = int(os.environ["WORLD_SIZE"])
    os.environ["VLLM_DIST_IDENT"] = prefix + os.environ["MASTER_PORT"]
    init_parallel(ParallelConfig(), seed=0)
    with set_current_vllm_config(VllmConfig()):
        vps.init_distributed_environment(world, int(os.environ["RANK"]), "env://", int(os.environ["LOCAL_RANK"]),
                                         "gloo")
        vps.ensure_model_parallel_initialized(world, 1)
    vllm.envs.enable_envs_cache()
    return int(vps.get_tp_group().all_reduce(torch.ones(1)).item())


def _vllm_state(prefix: str) -> dict:
    import torch.distributed as dist
    import vllm.envs
    from vllm.distributed import parallel_state as vps

    from tests.distributed import launcher

    return {"pid": os.getpid(), "released": list(launcher._vllm_releases), "pg_was_up": dist.is_initialized(),
            "vllm_world": vps._WORLD is not None, "vllm_groups": vps.model_parallel_is_initialized(),
            "envs_cached": vllm.envs._is_envs_cache_enabled(), "again": _start_vllm_groups(prefix),
            "shm": hasattr(torch.ops._C, "init_shm_manager")}


def test_a_world_that_ran_vllm_is_kept_with_vllms_state_released():
    """A body that imported vLLM and started its groups (as every colocated engine does) leaves a world the next
    body can use: the same processes (no 10-20 s restart per in-process-engine test), vLLM's groups, its frozen
    VLLM_* cache and the process group released, and vLLM's groups can be started again on the next rendezvous.
    The world is stopped after, so the rest of the tier runs on ranks that never imported vLLM, and stopping it
    unlinks the shared memory vLLM's TP groups made."""
    close_worlds()  # fresh ranks: the vLLM releases counted below are this test's, whatever ran before it
    try:
        pids = run_distributed(_dirty_the_rank, 2, False)
        assert run_distributed(_start_vllm_groups, 2, SHM_PREFIX) == [2, 2]
        states = run_distributed(_vllm_state, 2, SHM_PREFIX)
        made = glob.glob(f"/dev/shm/{SHM_PREFIX}*")
    finally:
        close_worlds()
    # vLLM's CPU builds without the shared-memory ops (its AVX2 build) run their groups on torch.distributed alone
    uses_shm = all(s["shm"] for s in states)
    assert len(made) >= 4 or not uses_shm, f"vLLM's TP groups made no shared memory of their own to check: {made}"
    left = glob.glob(f"/dev/shm/{SHM_PREFIX}*")
    assert not left, f"the stopped world left vLLM's shared memory behind (later engines would fail): {left}"
    assert [s["pid"] for s in states] == pids, "the world that ran vLLM was not kept"
    for s in states:
        assert s["released"] == [s["pid"]], s
        assert not (s["pg_was_up"] or s["vllm_world"] or s["vllm_groups"] or s["envs_cached"]), s
        assert s["again"] == 2, s
