"""engine.policy.parallel on gloo: ranks and groups match the layout; a world that does not fit is refused clearly;
rebuilding layouts holds what one build holds; the process group started again on one port (in a kept world and
under torchrun) meets only its own start."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launcher import _free_port, run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _state(tp: int, pp: int) -> dict:
    import torch.distributed as dist

    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp_size=tp, pp_size=pp), seed=0)
    tp_members = dist.get_process_group_ranks(ps.groups.tp)
    pp_members = dist.get_process_group_ranks(ps.groups.pp)
    return {"rank": ps.rank, "tp_rank": ps.tp_rank, "pp_rank": ps.pp_rank, "dp_size": ps.dp_size,
            "tp_members": tp_members, "pp_members": pp_members, "first": ps.is_first_stage, "last": ps.is_last_stage}


def _refused(tp: int, pp: int) -> None:
    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel

    init_parallel(ParallelConfig(tp_size=tp, pp_size=pp), seed=0)


def test_parallel_state_tp2_pp2_ranks_and_groups():
    states = run_distributed(_state, 4, 2, 2)
    for s in states:
        assert s["dp_size"] == 1 and len(s["tp_members"]) == 2 and len(s["pp_members"]) == 2
        assert s["rank"] in s["tp_members"] and s["rank"] in s["pp_members"]
        assert s["first"] == (s["pp_rank"] == 0) and s["last"] == (s["pp_rank"] == 1)
    # Megatron's default order tp-cp-ep-dp-pp: TP neighbours are adjacent ranks, stages are tp_size apart.
    assert [s["tp_members"] for s in states] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [s["pp_members"] for s in states] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert sorted((s["tp_rank"], s["pp_rank"]) for s in states) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_parallel_state_refuses_world_that_does_not_fit_layout():
    with pytest.raises(AssertionError, match=r"world size 2 is not divisible by tp_size\*pp_size = 2\*2 = 4"):
        run_distributed(_refused, 2, 2, 2)


REBUILD_LAYOUTS = [(2, 1, 1), (1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1)]
"""(tp, pp, ep) of the layouts built one after another on the same two processes."""


def _held_after_rebuilds(model_dir: str, out_root: str) -> list[tuple[int, int]]:
    """Per layout of `REBUILD_LAYOUTS`: a GRPO step (model, optimizer, forward and backward), then the layout torn down
    with the process group kept; (threads of this process, live process groups) after each teardown."""
    import gc
    import os

    import torch.distributed as dist

    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel
    from tests.helpers.policy import grpo_step_and_export

    held = []
    for i, (tp, pp, ep) in enumerate(REBUILD_LAYOUTS):
        parallel = ParallelConfig(tp_size=tp, pp_size=pp, ep_size=ep, sequence_parallel=tp > 1)
        grpo_step_and_export(model_dir, parallel, ModelConfig(dtype="float32"), f"{out_root}/{i}", width_multiple=2)
        destroy_parallel(keep_process_group=True)
        gc.collect()
        held.append((len(os.listdir("/proc/self/task")), len(dist.distributed_c10d._world.pg_map)))
    return held


@pytest.mark.slow
def test_rebuilding_layouts_on_kept_processes_holds_what_one_build_holds(tmp_path):
    """Tearing a layout down destroys every group made for it (Megatron's included) and lets its model go: after five
    layouts (a GRPO step each) every rank holds the threads and process groups it held after the first."""
    from engine.models.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "model", "qwen3_moe", seed=3))
    for rank, held in enumerate(run_distributed(_held_after_rebuilds, 2, model_dir, str(tmp_path / "out"))):
        assert held[0][1] == 1, f"rank {rank}: only the world group outlives a teardown, not {held[0][1]} groups"
        assert all(h == held[0] for h in held), f"rank {rank}: (threads, live groups) per rebuild {held}"


def _start_three_times() -> list[float]:
    """Start the process group and a TP 2 layout, all-reduce over the world and over the TP group, tear it all down;
    three times in this process on the same MASTER_PORT. Rank 0 lingers a second before each teardown (as a rank 0
    that writes the checkpoint does), so rank 1 always starts again first. Then the user's own process group on the
    same port (rank 0's kept store shares its server with it)."""
    import time

    import torch
    import torch.distributed as dist

    from engine.config import ParallelConfig
    from engine.policy.parallel import destroy_parallel, init_parallel

    sums = []
    for start in range(3):
        ps = init_parallel(ParallelConfig(tp_size=2), seed=0, timeout_min=1)  # a stuck start fails in a minute
        value = torch.tensor([ps.rank + 1.0 + 10 * start])
        dist.all_reduce(value)
        dist.all_reduce(value, group=ps.groups.tp)
        sums.append(value.item())
        if ps.rank == 0:
            time.sleep(1.0)
        destroy_parallel()
    dist.init_process_group("gloo")  # then a group of the user's own, torch's env:// rendezvous on the same port
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return [*sums, value.item()]


EXPECTED_SUMS = [2 * (3.0 + 20 * start) for start in range(3)] + [2.0]


@pytest.mark.slow
def test_starting_the_process_group_again_on_the_same_port_meets_only_this_starts_ranks():
    """A process that trains, evaluates and trains again starts the process group three times on one MASTER_PORT.
    Each start meets the other rank's same start, also when rank 0 is the last to leave the previous one (its store
    of that start still up where rank 0 hosts the store)."""
    assert run_distributed(_start_three_times, 2) == [EXPECTED_SUMS] * 2


@pytest.mark.slow
def test_starting_the_process_group_again_under_torchrun_meets_only_this_starts_ranks(tmp_path):
    """The same under torchrun, where every rank uses the agent's store, which outlives every start: what an earlier
    start published there (rank 0's address) must not be what a later start reads."""
    script = tmp_path / "three_starts.py"
    script.write_text("import json\nfrom tests.distributed.test_parallel_state import _start_three_times\n"
                      "print('sums', json.dumps(_start_three_times()), flush=True)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                 f"--master-port={_free_port()}", str(script)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = torchrun.communicate(timeout=120)
    finally:  # torchrun stops its workers (each in a session of its own) on SIGTERM
        if torchrun.poll() is None:
            torchrun.terminate()
            torchrun.communicate(timeout=60)
    assert torchrun.returncode == 0, err[-3000:]
    sums = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("sums ")]
    assert sums == [EXPECTED_SUMS] * 2


def test_ranks_with_nowhere_to_meet_are_told_which_variables_are_missing(monkeypatch):
    import torch.distributed as dist

    from engine.policy.parallel import start_process_group

    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT not set"):
        start_process_group("gloo")
    assert not dist.is_initialized()
