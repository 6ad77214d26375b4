"""The FP8 engine's starting checkpoint is written once per machine and never left behind
(engine/rollout/fp8_checkpoint.py `acquire_fp8_engine_checkpoint`):

- two processes of one machine (two colocated ranks, or a server's nodes on one host) that start together get one
  copy, written by one of them, holding the reference quantizer's bytes; it stays while either uses it and is gone
  once both have released it (what the engine's close does);
- a failed write (a checkpoint that is already quantized) raises the cause and leaves nothing;
- a process that died without releasing (a killed run) does not keep the copy: the next user's release deletes it;
- a failed engine start releases the copy; a started one keeps it until it closes.
"""

import json
import multiprocessing as mp
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.models.quantized import quantize_fp8
from engine.rollout.fp8_checkpoint import acquire_fp8_engine_checkpoint, released_on_error
from engine.rollout.fp8_sync import FP8_BLOCK, scale_name


def _checkpoint(path) -> dict:
    path.mkdir()
    gen = torch.Generator().manual_seed(3)
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 200, generator=gen).to(torch.bfloat16),
               "model.layers.0.input_layernorm.weight": torch.randn(200, generator=gen).to(torch.bfloat16)}
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return tensors


def _context():
    """The processes' start method: a fork server that imports this module once, so each process below forks from a
    single-threaded interpreter that already has torch (a fresh `spawn` interpreter per process would import it
    again, seconds each); each is still its own process with its own pid, as two ranks of a machine are."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _rank(model_dir, root, start, release, out) -> None:
    start.wait()
    copy = acquire_fp8_engine_checkpoint(model_dir, root)
    out.put((str(copy.path), copy.wrote))
    release.wait()
    copy.release()


def _die_holding(model_dir, root) -> None:
    acquire_fp8_engine_checkpoint(model_dir, root)
    os._exit(0)  # no release, no interpreter exit handlers: a killed process


def test_two_processes_of_one_machine_share_one_copy_which_is_gone_after_both_close(tmp_path):
    original = _checkpoint(tmp_path / "policy")
    root = tmp_path / "tmp"
    root.mkdir()
    ctx = _context()
    start, release, out = ctx.Barrier(2), ctx.Event(), ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(tmp_path / "policy", root, start, release, out)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    try:
        got = [out.get(timeout=120) for _ in ranks]
        assert got[0][0] == got[1][0], "both ranks start from the same copy"
        assert sorted(wrote for _, wrote in got) == [False, True], "one rank writes it, the other waits for it"
        assert len(list(root.iterdir())) == 1
        written = load_file(os.path.join(got[0][0], "model.safetensors"))
        name = "model.layers.0.self_attn.q_proj.weight"
        payload, scales = quantize_fp8(original[name], FP8_BLOCK)
        assert torch.equal(written[name].view(torch.int8), payload.view(torch.int8))
        assert torch.equal(written[scale_name(name)], scales)
    finally:
        release.set()
        for rank in ranks:
            rank.join(timeout=60)
    assert [rank.exitcode for rank in ranks] == [0, 0]
    assert list(root.iterdir()) == [], "the copy is deleted once its last user closes"


def test_the_copy_stays_while_a_user_holds_it_and_is_gone_after_the_last_release(tmp_path):
    _checkpoint(tmp_path / "policy")
    first = acquire_fp8_engine_checkpoint(tmp_path / "policy", tmp_path)
    second = acquire_fp8_engine_checkpoint(tmp_path / "policy", tmp_path)
    assert first.wrote and not second.wrote and first.path == second.path
    first.release()
    first.release()  # idempotent: the engine's close and the interpreter's exit may both release
    assert (second.path / "model.safetensors").is_file()
    second.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_a_failed_write_raises_the_cause_and_leaves_nothing(tmp_path):
    _checkpoint(tmp_path / "policy")
    config = tmp_path / "policy" / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match="is already quantized"):
        acquire_fp8_engine_checkpoint(tmp_path / "policy", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_a_dead_users_copy_is_deleted_by_the_next_users_release(tmp_path):
    _checkpoint(tmp_path / "policy")
    root = tmp_path / "tmp"
    root.mkdir()
    dead = _context().Process(target=_die_holding, args=(tmp_path / "policy", root))
    dead.start()
    dead.join(timeout=120)
    assert dead.exitcode == 0 and len(list(root.iterdir())) == 1, "a killed process leaves its copy"
    copy = acquire_fp8_engine_checkpoint(tmp_path / "policy", root)
    assert not copy.wrote, "the complete copy is reused"
    copy.release()
    assert list(root.iterdir()) == []


def test_a_failed_start_releases_the_copy_and_a_finished_one_too(tmp_path):
    """What the engine does around vLLM's start (`released_on_error`) and a server node around its workers."""
    _checkpoint(tmp_path / "policy")
    copy = acquire_fp8_engine_checkpoint(tmp_path / "policy", tmp_path)
    with pytest.raises(RuntimeError, match="vLLM failed"), released_on_error(copy):
        raise RuntimeError("vLLM failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
    copy = acquire_fp8_engine_checkpoint(tmp_path / "policy", tmp_path)
    with released_on_error(copy):
        pass
    assert copy.path.is_dir(), "a started engine keeps its copy until it closes"
    with released_on_error(copy, always=True):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]
