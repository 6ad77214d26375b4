"""The rollout server of server mode: one vLLM engine (engine/rollout.py `ServerEngine`) behind a small HTTP API.

    GRPO_ENGINE_TOKEN=... python -m engine.rollout_server CONFIG [section.key=value ...] [--host H] [--port P] \
        --num-nodes M --node-rank R

Reads the same config and overrides as the trainer (launch/grpo_72b.slurm passes both the same), builds the engine
at `rollout.vllm_tensor_parallel_size` from `model.name_or_path`, and serves on `--host`/`--port` (default
`rollout.vllm_server_host` / `rollout.vllm_server_port`). The socket is bound before the engine loads, so a port
clash fails at once and `/health` answers "loading" until the engine is ready.

Endpoints (JSON in and out; every one except `GET /health` needs `Authorization: Bearer $GRPO_ENGINE_TOKEN`,
compared in constant time; a request without it gets 401 and touches nothing):
| endpoint | body -> answer |
|---|---|
| GET /health | -> status ("loading" / "ok"), vllm_tensor_parallel_size, num_engine_calls, instance_id, num_weight_updates, replica, num_replicas (nothing secret) |
| POST /generate | prompt_ids, num_generations, seeds (one per prompt or null), generation (the trainer's sampling section or null) -> completion_ids, sampling_logprobs, is_truncated (prompt-major), instance_id, num_weight_updates |
| POST /prompt_logprobs | sequences, temperature -> logprobs (of every token after the first) |
| POST /weights/init | host, port, world_size, first_engine_rank, timeout_s, plan (SyncPlan.spec()), bucket_mb -> ranks; the workers join the trainer's transfer group (the call returns once the trainer's senders have joined) |
| POST /weights/update | -> per-worker stats, instance_id; the workers receive one sync and load it with vLLM's reload_weights |
| POST /weights/close | -> the workers leave the transfer group |
| POST /sleep, /wake_up | vLLM sleep mode where the engine supports it (GPU), otherwise no-ops |
| POST /shutdown | -> the server stops after answering |
Engine calls run one at a time (a lock); `/health` never waits for it. A failed call answers 500 with the error.

Must not: import vLLM (engine/rollout.py does), log or write the token (the config on disk never holds it; request
logs name the method, path and status only), or serve without a token (it refuses to start).

Several inference nodes: one independent server per node (vLLM TP within the node), `--num-nodes M --node-rank R`
naming it replica R of M (reported by /health); the trainer lists them all in `rollout.vllm_server_base_urls`,
splits each round's prompts among them and syncs the weights into each (launch/grpo_72b.slurm starts them).
Every process has a random `instance_id` (in /health and /generate answers): a trainer that finds a new one knows
the server restarted with the checkpoint's weights, and syncs again.

Test: tests/integration/test_rollout_server.py (the server in another process on loopback).
"""

from __future__ import annotations

import argparse
import hmac
import json
import secrets
import signal
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from engine.config import GenerationConfig, build_config, load_config
from engine.rollout_client import TOKEN_ENV, RolloutServerError, read_token

MAX_BODY_BYTES = 1 << 30  # 1 GiB: a round of token ids is far smaller; anything bigger is refused unread


class RolloutServer(ThreadingHTTPServer):
    """The HTTP server; `engine` is set once it has loaded (None while loading)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], token: str):
        super().__init__(address, _Handler)
        self._token = token.encode()
        self.engine = None
        self.engine_lock = threading.Lock()
        self.tensor_parallel_size = None
        self.num_engine_calls = 0
        """Authorized requests that reached the engine (reported by /health: a refused request never counts)."""
        self.instance_id = secrets.token_hex(8)
        """This process (a restarted server has a new one: the trainer then knows its weights are the checkpoint's)."""
        self.num_weight_updates = 0
        """Weight syncs received and loaded since this process started."""
        self.replica = (0, 1)
        """(--node-rank, --num-nodes): which of the run's rollout servers this is (reported by /health)."""

    def is_authorized(self, header: str | None) -> bool:
        scheme, _, value = (header or "").partition(" ")
        return scheme == "Bearer" and hmac.compare_digest(value.strip().encode(), self._token)

    # --- the endpoints' work (called with the engine lock held) -------------------------------------------------

    def generate(self, body: dict) -> dict:
        gen = body.get("generation")
        generation = build_config(gen, GenerationConfig, "generation") if gen is not None else None
        rollout = self.engine.generate(body["prompt_ids"], int(body["num_generations"]), body.get("seeds"), generation)
        return {"completion_ids": rollout.completion_ids, "sampling_logprobs": rollout.sampling_logprobs,
                "is_truncated": rollout.is_truncated, "instance_id": self.instance_id,
                "num_weight_updates": self.num_weight_updates}

    def prompt_logprobs(self, body: dict) -> dict:
        return {"logprobs": self.engine.prompt_logprobs(body["sequences"], float(body["temperature"]))}

    def init_weights(self, body: dict) -> dict:
        keys = ("host", "port", "world_size", "first_engine_rank", "timeout_s", "plan", "bucket_mb")
        return {"ranks": self.engine.init_weight_group(**{k: body[k] for k in keys})}

    def update_weights(self, body: dict) -> dict:
        workers = self.engine.receive_weights()
        self.num_weight_updates += 1
        return {"workers": workers, "instance_id": self.instance_id}

    def close_weights(self, body: dict) -> dict:
        self.engine.close_weight_group()
        return {}

    def sleep(self, body: dict) -> dict:
        self.engine.sleep()
        return {}

    def wake_up(self, body: dict) -> dict:
        self.engine.wake_up()
        return {}


_ROUTES = {"/generate": RolloutServer.generate, "/prompt_logprobs": RolloutServer.prompt_logprobs,
           "/weights/init": RolloutServer.init_weights, "/weights/update": RolloutServer.update_weights,
           "/weights/close": RolloutServer.close_weights, "/sleep": RolloutServer.sleep,
           "/wake_up": RolloutServer.wake_up}


class _Handler(BaseHTTPRequestHandler):
    server: RolloutServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # method, path, status: never headers (the token)
        sys.stderr.write(f"rollout_server: {self.address_string()} {format % args}\n")

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="grpo-rollout"')
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/health":
            self._refuse_or(404, f"no GET endpoint {self.path}")
            return
        ready = self.server.engine is not None
        self._send(200, {"status": "ok" if ready else "loading",
                         "vllm_tensor_parallel_size": self.server.tensor_parallel_size,
                         "num_engine_calls": self.server.num_engine_calls, "instance_id": self.server.instance_id,
                         "num_weight_updates": self.server.num_weight_updates,
                         "replica": self.server.replica[0], "num_replicas": self.server.replica[1]})

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        if not self.server.is_authorized(self.headers.get("Authorization")):
            self.close_connection = True  # the body is not read: the connection cannot be reused
            self._send(401, {"error": "missing or wrong bearer token"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(413, {"error": f"body of {length} bytes > {MAX_BODY_BYTES}"})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError as exc:
            self._send(400, {"error": f"body is not JSON: {exc}"})
            return
        if path == "/shutdown":
            self._send(200, {"status": "stopping"})
            threading.Thread(target=self.server.shutdown, daemon=True).start()
            return
        route = _ROUTES.get(path)
        if route is None:
            self._send(404, {"error": f"no POST endpoint {self.path}"})
            return
        if self.server.engine is None:
            self._send(503, {"error": "the engine is still loading"})
            return
        try:
            with self.server.engine_lock:
                self.server.num_engine_calls += 1
                result = route(self.server, body)
        except (KeyError, TypeError, ValueError) as exc:
            self._send(400, {"error": f"bad request to {path}: {type(exc).__name__}: {exc}"})
            return
        except Exception as exc:  # noqa: BLE001 - the client gets the server's message, the log the traceback
            traceback.print_exc()
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(200, result)

    def _refuse_or(self, status: int, message: str) -> None:
        if not self.server.is_authorized(self.headers.get("Authorization")):
            self._send(401, {"error": "missing or wrong bearer token"})
        else:
            self._send(status, {"error": message})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.rollout_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the run's YAML config (the trainer's)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, section.key=value (the trainer's)")
    parser.add_argument("--host", default=None, help="interface to bind (default rollout.vllm_server_host)")
    parser.add_argument("--port", type=int, default=None, help="port (default rollout.vllm_server_port)")
    parser.add_argument("--num-nodes", type=int, default=1, help="inference nodes of the job")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank among them")
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine.tiny_model import resolve_builtin_model

    args = build_parser().parse_args(argv)
    try:
        token = read_token()
    except RolloutServerError as exc:
        print(f"rollout_server: refusing to start: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.node_rank < args.num_nodes:
        print(f"rollout_server: --node-rank={args.node_rank} must be in [0, --num-nodes={args.num_nodes})",
              file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)
    ro = cfg.rollout
    host, port = args.host or ro.vllm_server_host, args.port or ro.vllm_server_port
    server = RolloutServer((host, port), token)
    server.tensor_parallel_size = ro.vllm_tensor_parallel_size
    server.replica = (args.node_rank, args.num_nodes)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    thread = threading.Thread(target=server.serve_forever, name="rollout-http", daemon=True)
    thread.start()
    print(f"rollout_server: replica {args.node_rank} of {args.num_nodes} listening on "
          f"http://{host}:{server.server_address[1]} (token from ${TOKEN_ENV}); loading {cfg.model.name_or_path}",
          file=sys.stderr, flush=True)
    engine = None
    try:
        from engine.rollout import ServerEngine

        name = cfg.model.name_or_path
        model_dir = (resolve_builtin_model(name, Path(cfg.train.output_dir) / "models") if name.startswith("builtin:")
                     else Path(name))
        engine = ServerEngine(model_dir, ro, cfg.generation, seed=cfg.train.seed, dtype=cfg.model.dtype)
        server.engine = engine
        print("rollout_server: engine ready", file=sys.stderr, flush=True)
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        if thread.is_alive():
            server.shutdown()
        server.server_close()
        if engine is not None:
            engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
