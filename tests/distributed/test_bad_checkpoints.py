"""The bad-input catalogue's checkpoint classes (table in tests/unit/test_bad_inputs.py), with a real
Megatron checkpoint on one gloo process: one Adam step of the tiny Qwen2 saved with the distributed optimizer, then
loaded by runs it does not belong to. Each load fails with a CheckpointError that names the cause, and the
checkpoint's files are byte for byte as before the attempt (a failed load never writes), so the right run can still
resume from it.

- another optimizer: a run without the distributed optimizer, and a run with SGD (both wrapped in Megatron's
  FP32Optimizer when not distributed: the torch optimizer inside is recorded too);
- another model: the identity stored at save (hidden size, layers, vocab, ...) differs;
- a torn file: a data file cut to half its length is named with its expected size.

Saving itself leaves no process behind: Megatron's writers are forked per save and joined, and no results process is
spawned (engine/train/checkpoint.py `_use_in_process_results_queue`).

Run: `pytest tests/distributed/test_bad_checkpoints.py` (one process, ~15 s).
"""

import hashlib
from pathlib import Path

import pytest

from tests.distributed.launcher import _live_children, run_distributed

MODEL = "builtin:tiny-qwen2-arith"


def _digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _attempt(load) -> str:
    from engine.train.checkpoint import CheckpointError

    try:
        load()
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def _bad_loads(cache_dir: str, run_dir: str) -> dict:
    from transformers import AutoConfig

    from engine.config import ModelConfig, OptimizerConfig, ParallelConfig
    from engine.models.tiny_model import resolve_builtin_model
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.parallel import init_parallel
    from engine.train.checkpoint import Progress, describe_model, load_checkpoint, save_checkpoint

    ps = init_parallel(ParallelConfig(), seed=0)
    model_dir = resolve_builtin_model(MODEL, cache_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(dtype="float32")
    padded = policy_shape(hf_config, model_cfg, 1).padded_vocab_size
    dims = ModelDims.from_hf(hf_config, padded)
    identity = describe_model(hf_config, padded)

    def build(optim: str = "adam", distributed: bool = True):
        chunks = build_policy(hf_config, model_cfg, ps)
        load_hf_checkpoint(chunks, ps, model_dir, dims)
        return build_optimizer(OptimizerConfig(optim=optim, learning_rate=1e-2, use_distributed_optimizer=distributed),
                               chunks, ps, total_steps=10)

    def one_step(popt):
        for chunk in popt.model:
            for param in chunk.parameters():
                param.main_grad.fill_(1e-4)
        popt.step()

    popt = build()
    one_step(popt)
    path = save_checkpoint(Path(run_dir) / "dist", Progress(step=1, rounds_done=1), popt, ps, model=identity)
    plain = build("adam", distributed=False)
    one_step(plain)
    plain_path = save_checkpoint(Path(run_dir) / "plain", Progress(step=1, rounds_done=1), plain, ps, model=identity)
    before = _digest(path)
    out = {"path": str(path), "children_after_saves": _live_children()}
    out["not_distributed"] = _attempt(lambda: load_checkpoint(path, build("adam", distributed=False), ps,
                                                              model=identity))
    out["sgd"] = _attempt(lambda: load_checkpoint(plain_path, build("sgd", distributed=False), ps, model=identity))
    other = identity | {"hidden_size": 256, "num_hidden_layers": 8}
    out["other_model"] = _attempt(lambda: load_checkpoint(path, build(), ps, model=other))
    out["unchanged_after_refusals"] = _digest(path) == before
    target = build()
    torn = sorted(path.glob("*.distcp"))[-1]
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    torn_digest = _digest(path)
    out["torn_file"] = torn.name
    out["torn"] = _attempt(lambda: load_checkpoint(path, target, ps, model=identity))
    out["unchanged_after_torn"] = _digest(path) == torn_digest
    out["good_still_loads"] = _attempt(lambda: load_checkpoint(plain_path, build("adam", distributed=False), ps,
                                                               model=identity))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_checkpoints")
    [out] = run_distributed(_bad_loads, 1, str(tmp / "cache"), str(tmp / "run"), timeout_s=300)
    return out


def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(results):
    assert ("holds a DistributedOptimizer(AdamW) state, this run builds a FP32Optimizer(AdamW) (optimizer.optim and "
            "optimizer.use_distributed_optimizer must be the same") in results["not_distributed"]
    assert "holds a FP32Optimizer(AdamW) state, this run builds a FP32Optimizer(SGD)" in results["sgd"]
    assert results["unchanged_after_refusals"], "a refused load must not touch the checkpoint"
    assert results["good_still_loads"] == "loaded", "the right run still resumes from it"


def test_a_real_checkpoint_of_another_model_is_refused_naming_the_fields(results):
    message = results["other_model"]
    assert "was written for another model" in message
    assert "hidden_size: checkpoint 128, this run 256" in message and "num_hidden_layers: checkpoint 4, this run 8" in message


def test_a_torn_checkpoint_file_is_named_and_left_as_it_was(results):
    message = results["torn"]
    assert f"cannot load the model / optimizer state: damaged files: {results['torn_file']} has " in message
    assert "(torn); resume from an earlier checkpoint" in message
    assert results["unchanged_after_torn"], "a failed load must not write into the checkpoint"


def test_saving_leaves_no_process_behind(results):
    assert results["children_after_saves"] == []
