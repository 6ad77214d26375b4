"""engine.policy.parallel on gloo: ranks and groups match the layout; a world that does not fit is refused clearly."""

import pytest

from tests.distributed.launcher import run_distributed


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
