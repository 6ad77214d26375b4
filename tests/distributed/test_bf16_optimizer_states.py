"""optimizer.optimizer_state_dtype=bfloat16 under Megatron's distributed optimizer, on gloo (TP1 x DP2).

The Adam moments of each DP rank's main-parameter shard are bfloat16 (2 bytes per element); three steps land within
bf16's rounding of the float32-moment steps (bound in tests/unit/test_state_dtype_adam.py: steps * lr * 2**-5) and
not on them; DP2 equals one process (the update is elementwise); a checkpoint (fully reshardable: the moments
travel as float32, exact for bf16 values) resumes the bf16 moments exactly, so the next step is bit for bit the one
the saving run took. Gradients are fixed global tensors, the same at every layout (test_checkpoint_resharding.py).
"""

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.distributed.test_checkpoint_resharding import _build, _global_params, _merge, _step_with_fixed_grads

LR, STEPS = 1e-2, 3


def _moment_bytes(popt) -> tuple[int, int, set]:
    """(bytes of exp_avg + exp_avg_sq, elements of the main-parameter shards, moment dtypes) on this rank."""
    nbytes, numel, dtypes = 0, 0, set()
    for sub in getattr(popt.optimizer, "chained_optimizers", [popt.optimizer]):
        for param, state in sub.optimizer.state.items():
            numel += param.numel()
            for key in ("exp_avg", "exp_avg_sq"):
                nbytes += state[key].numel() * state[key].element_size()
                dtypes.add(state[key].dtype)
    return nbytes, numel, dtypes


def _steps_then_save(cache_dir, run_dir, state_dtype) -> dict:
    from engine.train.checkpoint import Progress, save_checkpoint

    ps, dims, chunks, popt, identity = _build(1, 1, True, cache_dir, state_dtype=state_dtype)
    for seed in range(1, STEPS + 1):
        _step_with_fixed_grads(chunks, popt, ps, seed=seed)
    after = _global_params(chunks, ps, dims)
    if run_dir:
        save_checkpoint(run_dir, Progress(step=STEPS, rounds_done=STEPS), popt, ps, model=identity)
    _step_with_fixed_grads(chunks, popt, ps, seed=STEPS + 1)
    return {"after": after, "next": _global_params(chunks, ps, dims), "moments": _moment_bytes(popt)}


def _load_then_step(cache_dir, run_dir) -> dict:
    from engine.train.checkpoint import find_latest_checkpoint, load_checkpoint

    ps, dims, chunks, popt, identity = _build(1, 1, True, cache_dir, state_dtype="bfloat16")
    load_checkpoint(find_latest_checkpoint(run_dir), popt, ps, model=identity)
    loaded_moments = _moment_bytes(popt)
    _step_with_fixed_grads(chunks, popt, ps, seed=STEPS + 1)
    return {"next": _global_params(chunks, ps, dims), "moments": loaded_moments}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from engine.models.tiny_model import resolve_builtin_model
    from tests.distributed.test_checkpoint_resharding import MODEL

    root = tmp_path_factory.mktemp("bf16_states")
    cache = str(root / "models")
    resolve_builtin_model(MODEL, cache)
    return {"bf16": run_distributed(_steps_then_save, 2, cache, str(root / "run"), "bfloat16"),
            "fp32": run_distributed(_steps_then_save, 2, cache, "", "float32"), "cache": cache, "run": str(root / "run")}


@pytest.mark.slow
def test_dp2_moments_are_bf16_and_steps_stay_within_bf16_rounding_of_fp32(runs):
    for rank in runs["bf16"]:
        nbytes, numel, dtypes = rank["moments"]
        assert dtypes == {torch.bfloat16} and numel > 0 and nbytes == 2 * 2 * numel  # m and v, 2 B each
    for rank in runs["fp32"]:
        nbytes, numel, dtypes = rank["moments"]
        assert dtypes == {torch.float32} and nbytes == 2 * 4 * numel
    bf16, fp32 = _merge(runs["bf16"], "after"), _merge(runs["fp32"], "after")
    assert sorted(bf16) == sorted(fp32)
    for name, tensor in fp32.items():
        assert (bf16[name] - tensor).abs().max() <= STEPS * LR * 2**-5, name
    assert any(not torch.equal(bf16[n], fp32[n]) for n in fp32), "bf16 moments must change the trajectory"


@pytest.mark.slow
def test_dp2_bf16_moments_equal_one_process(runs):
    single = run_distributed(_steps_then_save, 1, runs["cache"], "", "bfloat16")
    for name, tensor in _merge(single, "after").items():
        assert torch.equal(_merge(runs["bf16"], "after")[name], tensor), name


@pytest.mark.slow
def test_checkpoint_resumes_bf16_moments_exactly(runs):
    loaded = run_distributed(_load_then_step, 2, runs["cache"], runs["run"])
    for rank in loaded:
        assert rank["moments"][2] == {torch.bfloat16}, "loaded moments must be bf16 again"
    expected = _merge(runs["bf16"], "next")
    for name, tensor in _merge(loaded, "next").items():
        assert torch.equal(tensor, expected[name]), f"{name}: max {(tensor - expected[name]).abs().max()}"
