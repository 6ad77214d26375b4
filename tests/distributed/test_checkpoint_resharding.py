"""Megatron distributed checkpoints across layouts, on gloo (engine/train/checkpoint.py).

A run takes one optimizer step at a source layout, saves, and takes a second step (the reference trajectory). A
run at a target layout loads the checkpoint and takes the same second step. The loaded parameters must equal the
saved ones and the second step must land on the reference parameters bit for bit: that holds only if the Adam
moments, the optimizer step count and the LR schedule (linear warmup: the second step's learning rate depends on
it) were restored, at another TP x PP too. Gradients are fixed global tensors (the same at every layout) and small
enough that clipping never engages, so every update is elementwise and layout-independent.
"""

import zlib

import pytest
import torch

from tests.distributed.launcher import run_distributed

MODEL = "builtin:tiny-qwen2-arith"  # vocab 400: padded to 512 at TP 1 and TP 2 alike


def _build(tp: int, pp: int, use_distributed_optimizer: bool, cache_dir: str, dtype: str = "float32", model=MODEL,
           state_dtype: str = "float32"):
    from transformers import AutoConfig

    from engine.config import ModelConfig, OptimizerConfig, ParallelConfig
    from engine.models.tiny_model import resolve_builtin_model
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp_size=tp, pp_size=pp), seed=0)
    model_dir = resolve_builtin_model(model, cache_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(dtype=dtype)
    padded = policy_shape(hf_config, model_cfg, tp).padded_vocab_size
    dims = ModelDims.from_hf(hf_config, padded)
    chunks = build_policy(hf_config, model_cfg, ps)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    opt_cfg = OptimizerConfig(learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=3,
                              use_distributed_optimizer=use_distributed_optimizer, optimizer_state_dtype=state_dtype)
    popt = build_optimizer(opt_cfg, chunks, ps, total_steps=10)
    identity = {"model_type": hf_config.model_type, "padded_vocab_size": padded}
    return ps, dims, chunks, popt, identity


@torch.no_grad()
def _step_with_fixed_grads(chunks, popt, ps, seed: int) -> None:
    """One optimizer step whose gradient is a fixed function of (seed, global parameter name)."""
    from engine.policy.model import global_param_names, take_tp_shard

    popt.zero_grad()
    for chunk in chunks:
        for name, global_name in global_param_names(chunk).items():
            param = chunk.get_parameter(name)
            shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= ps.tp_size
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
            full = 1e-4 * torch.randn(shape, generator=gen)  # global norm << max_grad_norm: never clipped
            param.main_grad.copy_(take_tp_shard(full, param, ps.tp_rank, ps.tp_size))
    popt.step()


def _global_params(chunks, ps, dims) -> dict:
    """HF name -> full tensor of this rank's stage (every TP rank gathers; DP rank 0, TP rank 0 reports)."""
    from engine.policy.hf_checkpoint import iter_hf_tensors

    tensors = {name: t.clone() for chunk in chunks for name, t in iter_hf_tensors(chunk, ps, dims)}
    return tensors if ps.tp_rank == 0 and ps.dp_rank == 0 else {}


def _save_then_step(tp, pp, dist_opt, cache_dir, run_dir, dtype="float32", model=MODEL) -> dict:
    from engine.train.checkpoint import Progress, save_checkpoint

    ps, dims, chunks, popt, identity = _build(tp, pp, dist_opt, cache_dir, dtype, model)
    _step_with_fixed_grads(chunks, popt, ps, seed=1)
    saved = _global_params(chunks, ps, dims)
    save_checkpoint(run_dir, Progress(step=1, rounds_done=1), popt, ps, model=identity)
    draw = torch.rand(4)  # the generator state right after the save: restored at the same layout
    _step_with_fixed_grads(chunks, popt, ps, seed=2)
    return {"saved": saved, "next": _global_params(chunks, ps, dims), "lr": popt.optimizer.param_groups[0]["lr"],
            "draw": draw}


def _load_then_step(tp, pp, dist_opt, cache_dir, run_dir, dtype="float32", model=MODEL) -> dict:
    from engine.train.checkpoint import find_latest_checkpoint, load_checkpoint

    ps, dims, chunks, popt, identity = _build(tp, pp, dist_opt, cache_dir, dtype, model)
    torch.manual_seed(12345)  # a different stream: the restore must replace it
    progress = load_checkpoint(find_latest_checkpoint(run_dir), popt, ps, model=identity)
    loaded = _global_params(chunks, ps, dims)
    draw = torch.rand(4)
    _step_with_fixed_grads(chunks, popt, ps, seed=2)
    return {"loaded": loaded, "next": _global_params(chunks, ps, dims), "lr": popt.optimizer.param_groups[0]["lr"],
            "draw": draw, "progress": progress}


def _merge(results: list[dict], key: str) -> dict:
    merged = {}
    for r in results:
        merged |= r[key]
    return merged


def _assert_equal(actual: dict, expected: dict, what: str) -> None:
    assert sorted(actual) == sorted(expected), what
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), f"{what}: {name} differs (max {(actual[name] - tensor).abs().max()})"


SOURCES = {"tp1_pp1": (1, 1, False, "float32"), "dp2_distopt": (1, 1, True, "float32"), "tp2_pp2": (2, 2, False, "float32"),
           "dp2_distopt_bf16": (1, 1, True, "bfloat16"), "nemotron_h_tp2": (2, 1, False, "float32")}
"""Source layouts: (tp, pp, distributed optimizer, dtype); dp2_distopt* run on 2 ranks (TP1 x DP2), so the
distributed optimizer's state is sharded over the two DP ranks. In bf16 (TRL's default) the optimizer holds float32
main parameters and Adam states; restored exactly, the next step (elementwise, from fixed float32 gradients) lands
on the same bf16 weights bit for bit at another layout too. nemotron_h_tp2: the tiny Nemotron-H ('M*-M', one Mamba
group per TP rank), whose Mamba-2 in_proj / conv blocks are saved as tensors of their own and whose layers are keyed
one by one (engine/models/nemotron_h/layers.py), loaded at TP1 x PP2."""
SOURCE_MODELS = {"nemotron_h_tp2": "builtin:tiny-nemotron_h"}
"""A source's model when not `MODEL`."""


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """name -> (run dir, per-rank results of the source run, model cache); each source is saved on first use."""
    from engine.models.tiny_model import resolve_builtin_model

    root = tmp_path_factory.mktemp("ckpt")
    cache = {}

    def get(name):
        if name not in cache:
            tp, pp, dist_opt, dtype = SOURCES[name]
            world = 2 if name.startswith("dp2_distopt") else tp * pp
            resolve_builtin_model(SOURCE_MODELS.get(name, MODEL), str(root / "models"))  # built once, not per rank
            results = run_distributed(_save_then_step, world, tp, pp, dist_opt, str(root / "models"), str(root / name),
                                      dtype, SOURCE_MODELS.get(name, MODEL))
            cache[name] = (root / name, results, str(root / "models"))
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,tp,pp,dist_opt",
    [("tp1_pp1", 1, 1, False), ("tp1_pp1", 2, 1, False), ("tp1_pp1", 1, 2, False), ("dp2_distopt", 2, 1, True),
     ("dp2_distopt", 1, 1, True), ("tp2_pp2", 1, 1, False), ("dp2_distopt_bf16", 2, 1, True),
     ("dp2_distopt_bf16", 1, 2, True), ("nemotron_h_tp2", 1, 2, False)],
    ids=["tp1_pp1-to-tp1_pp1", "tp1_pp1-to-tp2_pp1", "tp1_pp1-to-tp1_pp2", "dp2_distopt-to-tp2_distopt",
         "dp2_distopt-to-tp1_dp1_distopt", "tp2_pp2-to-tp1_pp1", "bf16-dp2_distopt-to-tp2_distopt",
         "bf16-dp2_distopt-to-pp2_distopt", "nemotron_h-tp2-to-pp2"],
)
def test_checkpoint_loads_at_another_layout_and_continues_the_same_trajectory(saved_runs, source, tp, pp, dist_opt):
    run_dir, saved, cache_dir = saved_runs(source)
    dtype = SOURCES[source][3]
    loaded = run_distributed(_load_then_step, tp * pp, tp, pp, dist_opt, cache_dir, str(run_dir), dtype,
                             SOURCE_MODELS.get(source, MODEL))
    _assert_equal(_merge(loaded, "loaded"), _merge(saved, "saved"), "parameters after loading")
    _assert_equal(_merge(loaded, "next"), _merge(saved, "next"), "parameters after the next optimizer step")
    assert loaded[0]["lr"] == saved[0]["lr"], "the LR schedule must continue where it stopped"
    assert loaded[0]["progress"].step == 1 and loaded[0]["progress"].rounds_done == 1
    if source == "tp1_pp1" and tp == 1 and pp == 1:
        assert torch.equal(loaded[0]["draw"], saved[0]["draw"]), "the torch generator must be restored"


def _load_with_other_optimizer(cache_dir, run_dir) -> str:
    from engine.train.checkpoint import CheckpointError, find_latest_checkpoint, load_checkpoint

    ps, _, _, popt, identity = _build(1, 1, False, cache_dir)
    try:
        load_checkpoint(find_latest_checkpoint(run_dir), popt, ps, model=identity)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
def test_switching_the_optimizer_kind_is_a_clear_error(saved_runs):
    run_dir, _, cache_dir = saved_runs("dp2_distopt")
    message = run_distributed(_load_with_other_optimizer, 1, cache_dir, str(run_dir))[0]
    assert "use_distributed_optimizer" in message and "DistributedOptimizer" in message


def _load_errors(cache_dir, corrupt_dir) -> dict:
    from engine.train.checkpoint import CheckpointError, load_checkpoint

    ps, _, _, popt, identity = _build(1, 1, False, cache_dir)
    messages = {}
    for name, model in {"corrupt": identity, "other_model": identity | {"padded_vocab_size": 1024}}.items():
        try:
            load_checkpoint(corrupt_dir, popt, ps, model=model)
            messages[name] = "loaded"
        except CheckpointError as exc:
            messages[name] = str(exc)
    return messages


@pytest.mark.slow
def test_corrupt_tensor_file_or_another_model_is_a_clear_error(saved_runs, tmp_path):
    import shutil

    run_dir, _, cache_dir = saved_runs("tp1_pp1")
    corrupt = tmp_path / "checkpoint-1"
    shutil.copytree(run_dir / "checkpoint-1", corrupt)
    for shard in corrupt.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn write
    messages = run_distributed(_load_errors, 1, cache_dir, str(corrupt))[0]
    assert str(corrupt) in messages["corrupt"] and "cannot load the model / optimizer state" in messages["corrupt"]
    assert "another model" in messages["other_model"] and "padded_vocab_size" in messages["other_model"]
