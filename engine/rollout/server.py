"""The rollout server of server mode: one vLLM engine (engine/rollout/vllm_engine.py `ServerEngine`) behind a small HTTP API.

    GRPO_ENGINE_TOKEN=... python -m engine.rollout.server CONFIG [section.key=value ...] [--host H] [--port P] \
        [--num-nodes M --node-rank R]
    GRPO_ENGINE_TOKEN=... grpo-engine vllm-serve --model Qwen/Qwen2.5-7B --tensor_parallel_size 2 \
        --host 0.0.0.0 --port 8000                     # `trl vllm-serve`'s flags, no config file

Owns: `RolloutServer` (the HTTP server: the token, the bounds, one engine call at a time; its docstring: the
token, several inference nodes, restarts), `_Handler` (the endpoints: its docstring holds the table), the command
line (`parse_serve_args`: a config and overrides as the trainer's, or TRL's `vllm-serve` flags; its docstring), and
`model_identity` / `model_mismatch` (what a weight sync's plan must agree with).

Must not: import vLLM (engine/rollout/vllm_engine.py does), log or write the token (the config on disk never holds it; request
logs name the method, path and status only), or serve without a token (it refuses to start).

Test: tests/unit/test_rollout_server_args.py (the command line, the token messages; no vLLM),
tests/integration/test_rollout_server.py (the server in another process on loopback),
tests/integration/test_bad_inputs_server.py (bad requests, bounds, binding, a load test during a weight sync).
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
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, GenerationConfig, build_config, config_to_dict, load_config
from engine.log_filters import quiet_library_logs
from engine.models.model_dir import resolve_model_dir
from engine.rollout.client import TOKEN_ENV, RolloutServerError, read_token
from engine.rollout.server_nodes import VLLM_MASTER_PORT, NodePlace, run_worker_node
from engine.rollout.vllm_lora import AdapterNotHeld, lora_engine_options, name_policy_adapter, receive_policy_adapter
from engine.validation import nodes_per_server_problems

MAX_BODY_MB = 256
"""Default `--max-body-mb`: a round of 1,024 prompts x 8 completions of 4,096 token ids is ~60 MiB of JSON."""
READ_TIMEOUT_S = 60.0
"""Default `--read-timeout-s`: the longest wait for a request's next bytes (headers, body) before a 408."""


class RolloutServer(ThreadingHTTPServer):
    """The HTTP server; `engine` is set once it has loaded (None while loading).

    The token: without $GRPO_ENGINE_TOKEN (16+ characters) the server refuses to start, on loopback too (a weight
    update replaces the model, and loopback is shared by every user and job of the machine); the trainer refuses to
    connect without it. A request without the header, or with another token, gets 401 with a message naming what is
    missing; `/health` tells a client that presents a token whether it is this server's (`authorized`), so a trainer
    started with another token fails when it connects, with the fix (the same value on both sides), not at its first
    weight sync.

    Several inference nodes: one independent server per node (vLLM TP within the node), `--num-nodes M --node-rank R`
    naming it replica R of M (reported by /health), or with `rollout.vllm_nodes_per_server` K one server per K nodes
    (vLLM TP over them, engine/rollout/server_nodes.py; replica R // K); the trainer lists them all in
    `rollout.vllm_server_base_urls`, splits each round's prompts among them and syncs the weights into each
    (launch/grpo_72b.slurm starts them).
    Every process has a random `instance_id` (in /health and /generate answers): a trainer that finds a new one knows
    the server restarted with the checkpoint's weights, and syncs again.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], token: str, *, max_body_mb: float = MAX_BODY_MB,
                 read_timeout_s: float = READ_TIMEOUT_S):
        super().__init__(address, _Handler)
        self._token = token.encode()
        self.max_body_bytes = int(max_body_mb * (1 << 20))
        """A POST body longer than this is answered 413 unread."""
        self.read_timeout_s = read_timeout_s
        """A request whose next bytes take longer is answered 408 (body) or dropped (headers): a stalled or slow
        client holds a thread, never the engine."""
        self.model: dict | None = None
        """The served model's identity (model_type, name and the shape facts the weight sync depends on; /health)."""
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
        """(replica, replicas): which of the run's rollout servers this is (reported by /health)."""
        self.nodes = 1
        """Inference nodes its engine spans (`rollout.vllm_nodes_per_server`; /health's `vllm_nodes`)."""
        self.log_requests = True
        """One stderr line per request (`--log_level` info and below)."""

    def is_authorized(self, header: str | None) -> bool:
        scheme, _, value = (header or "").partition(" ")
        return scheme == "Bearer" and hmac.compare_digest(value.strip().encode(), self._token)

    @staticmethod
    def refusal(header: str | None) -> str:
        """The 401 message: which side lacks the token, and how to set it."""
        if not header:
            return (f"this rollout server requires `Authorization: Bearer <token>` and the request had none: set "
                    f"${TOKEN_ENV} in the client's (the trainer's) environment to the value the server was started "
                    "with; the engine's trainer sends it")
        return (f"the bearer token differs from this rollout server's ${TOKEN_ENV}: start the server and the trainer "
                f"with the same value of ${TOKEN_ENV}")

    # --- the endpoints' work (called with the engine lock held) -------------------------------------------------

    def generate(self, body: dict) -> dict:
        name_policy_adapter(self.engine, body.get("lora_version"))  # AdapterNotHeld (410) when another is held
        gen = body.get("generation")
        generation = build_config(gen, GenerationConfig, "generation") if gen is not None else None
        regex = body.get("structured_outputs_regex", self.engine.structured_outputs_regex)  # the trainer's
        rollout = self.engine.generate(body["prompt_ids"], int(body["num_generations"]), body.get("seeds"), generation,
                                       structured_outputs_regex=regex)
        return rollout.to_json(with_prompts=False) | {"instance_id": self.instance_id,
                                                      "num_weight_updates": self.num_weight_updates}

    def prompt_logprobs(self, body: dict) -> dict:
        name_policy_adapter(self.engine, body.get("lora_version"))
        return {"logprobs": self.engine.prompt_logprobs(body["sequences"], float(body["temperature"]))}

    def init_weights(self, body: dict) -> dict:
        keys = ("host", "port", "world_size", "first_engine_rank", "timeout_s", "plan", "bucket_mb")
        mismatch = model_mismatch(self.model, {**body["plan"]["dims"], "ffn_hidden_size": body["plan"]["ffn_hidden_size"]})
        if mismatch:
            raise _Conflict(f"the trainer's weights are for another model than this server's: {mismatch}")
        return {"ranks": self.engine.init_weight_group(**{k: body[k] for k in keys})}

    def update_weights(self, body: dict) -> dict:
        workers = self.engine.receive_weights(verify=bool(body.get("verify", True)))
        self.num_weight_updates += 1
        return {"workers": workers, "instance_id": self.instance_id}

    def update_adapter(self, body: dict) -> dict:
        keys = ("version", "names", "shapes", "dtype", "peft_config")
        workers = receive_policy_adapter(self.engine, **{k: body[k] for k in keys}, verify=bool(body.get("verify", True)))
        return {"workers": workers, "instance_id": self.instance_id}

    def weight_digests(self, body: dict) -> dict:
        return {"workers": self.engine.weight_digests()}

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
           "/weights/digests": RolloutServer.weight_digests, "/lora/update": RolloutServer.update_adapter,
           "/weights/close": RolloutServer.close_weights, "/sleep": RolloutServer.sleep,
           "/wake_up": RolloutServer.wake_up}


class _Conflict(ValueError):
    """A request the engine must not run (answered 409): e.g. a weight sync of another model."""


def model_identity(model_dir: Path, name: str, trust_remote_code: bool = False) -> dict:
    """What /health says about the served model: its name, model_type and the shape facts a trainer's weight-sync
    plan is built from (engine/policy/hf_convert.py ModelDims, without the padded vocabulary, which is the trainer's
    own, plus the MLP width)."""
    from dataclasses import asdict

    from transformers import AutoConfig

    from engine.policy.hf_map import ModelDims

    hf_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    dims = asdict(ModelDims.from_hf(hf_config, hf_config.vocab_size))
    dims.pop("padded_vocab")
    return {"name": name, "model_type": hf_config.model_type, **dims, "ffn_hidden_size": hf_config.intermediate_size}


def model_mismatch(served: dict | None, trainer: dict) -> str:
    """The fields where the served model differs from the trainer's shape facts ("" when none, or when the server
    did not say), e.g. "hidden_size: server 128, trainer 256"."""
    if not served:
        return ""
    # both sides as JSON carries them (tuples such as ModelDims.layer_kinds as lists): the trainer compares /health's
    # JSON with its own dims, the server its own dims with /weights/init's JSON
    served, trainer = json.loads(json.dumps(served)), json.loads(json.dumps(trainer))
    diffs = [f"{key}: server {served[key]!r}, trainer {value!r}" for key, value in trainer.items()
             if key in served and key != "padded_vocab" and served[key] != value]
    return (f"{'; '.join(diffs)} (the server serves {served.get('name')!r}, model_type {served.get('model_type')!r}); "
            "start the server with the trainer's model.name_or_path") if diffs else ""


class _Handler(BaseHTTPRequestHandler):
    """The endpoints.

    Endpoints (JSON in and out; every one except `GET /health` needs `Authorization: Bearer $GRPO_ENGINE_TOKEN`,
    compared in constant time; a request without it gets 401 and touches nothing):
    | endpoint | body -> answer |
    |---|---|
    | GET /health | -> status ("loading" / "ok"), vllm_tensor_parallel_size, vllm_nodes (nodes it spans), max_lora_rank (None: no LoRA support), num_engine_calls, instance_id, num_weight_updates, replica, num_replicas, model (name, model_type and the shape facts a weight sync depends on; nothing secret), logprobs_mode (the vLLM log-prob mode its generation settings chose; a trainer whose sampling needs another is refused at connection); authorized (whether the request's bearer token is this server's; only when it has one) |
    | POST /generate | prompt_ids, num_generations, seeds (one per prompt or null), generation (the trainer's sampling section or null), structured_outputs_regex (the trainer's `rollout.vllm_structured_outputs_regex`; absent = the server's own), lora_version (the LoRA adapter to sample with; absent = the base) -> completion_ids, sampling_logprobs, is_truncated (prompt-major), instance_id, num_weight_updates |
    | POST /prompt_logprobs | sequences, temperature, lora_version (as /generate) -> logprobs (of every token after the first) |
    | POST /weights/init | host, port, world_size, first_engine_rank, timeout_s, plan (SyncPlan.spec(), with "fp8": the FP8 wire), bucket_mb -> ranks; the workers join the trainer's transfer group (the call returns once the trainer's senders have joined) |
    | POST /weights/update | verify (default true) -> per-worker stats (with verify: engine_rank and digests of what the worker then holds), instance_id; the workers receive one sync and load it with vLLM's reload_weights |
    | POST /lora/update | version, names, shapes, dtype, peft_config, verify -> workers (tensors; with verify engine_rank and digests of the adapter as held), instance_id; the workers receive the LoRA adapter's tensors over the transfer group and load it as vLLM adapter `version` (engine/rollout/vllm_lora.py); a /generate or /prompt_logprobs naming `lora_version` runs with it (410 when another is held) |
    | POST /weights/digests | -> workers: each engine rank's engine_rank and digests ({HF name: [digest, dtype]}, engine/rollout/weight_digest.py) of the weights it holds |
    | POST /weights/close | -> the workers leave the transfer group |
    | POST /sleep, /wake_up | vLLM sleep mode where the engine supports it (GPU), otherwise no-ops |
    | POST /shutdown | -> the server stops after answering |
    Engine calls run one at a time (a lock); `/health` never waits for it. A failed call answers 500 with the error.
    Bounds, each answered before the engine is touched: the token first (401, body unread); a body over `--max-body-mb`
    (default 256) gets 413 unread, a chunked one 411, one whose bytes stall longer than `--read-timeout-s` (default 60
    s, every read of the connection) 408, and one that is not a JSON object 400; a weight sync whose plan is for another
    model (its shape facts differ from /health's `model`) 409. The socket binds only `--host`
    (`rollout.vllm_server_host`; TRL's default 0.0.0.0 is every interface: give the inference node's address, or
    127.0.0.1 on one machine).
    """  # noqa: E501 - the endpoint table keeps one row per endpoint

    server: RolloutServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s  # StreamRequestHandler: every read and write of this connection
        super().setup()

    def log_message(self, format, *args) -> None:  # method, path, status: never headers (the token)
        if self.server.log_requests:
            sys.stderr.write(f"rollout_server: {self.address_string()} {format % args}\n")

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        if self.close_connection:
            self.send_header("Connection", "close")
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
        answer = {"status": "ok" if ready else "loading",
                  "vllm_tensor_parallel_size": self.server.tensor_parallel_size, "vllm_nodes": self.server.nodes,
                  "num_engine_calls": self.server.num_engine_calls, "instance_id": self.server.instance_id,
                  "num_weight_updates": self.server.num_weight_updates,
                  "replica": self.server.replica[0], "num_replicas": self.server.replica[1], "model": self.server.model,
                  "logprobs_mode": self.server.engine.logprobs_mode if ready else None,
                  "max_lora_rank": self.server.engine.max_lora_rank if ready else None}
        header = self.headers.get("Authorization")
        if header:  # the client learns at connection whether its token is this server's (what a 401 would say)
            answer["authorized"] = self.server.is_authorized(header)
        self._send(200, answer)

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        if not self.server.is_authorized(self.headers.get("Authorization")):
            self.close_connection = True  # the body is not read: the connection cannot be reused
            self._send(401, {"error": self.server.refusal(self.headers.get("Authorization"))})
            return
        body = self._read_body(path)
        if body is None:
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
        except _Conflict as exc:
            self._send(409, {"error": f"{path}: {exc}"})
            return
        except AdapterNotHeld as exc:  # the LoRA adapter version a request names is not held (vllm_lora.py)
            self._send(410, {"error": f"{path}: {exc}"})
            return
        except (KeyError, TypeError, ValueError) as exc:
            self._send(400, {"error": f"bad request to {path}: {type(exc).__name__}: {exc}"})
            return
        except Exception as exc:  # noqa: BLE001 - the client gets the server's message, the log the traceback
            traceback.print_exc()
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(200, result)

    def _read_body(self, path: str) -> dict | None:
        """The request's JSON object, or None after answering why not: 411 (chunked), 400 (a bad Content-Length,
        not JSON, not an object), 413 (over --max-body-mb: refused unread), 408 (slower than --read-timeout-s)."""
        limit = self.server.max_body_bytes
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            self._send(411, {"error": f"{path}: chunked bodies are not accepted: send Content-Length"})
            return None
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.close_connection = True
            self._send(400, {"error": f"{path}: Content-Length {self.headers.get('Content-Length')!r} is not a size"})
            return None
        if length > limit:
            self.close_connection = True  # the body is not read: the connection cannot be reused
            self._send(413, {"error": f"{path}: body of {length} bytes > the server's limit of {limit} bytes "
                                      f"(--max-body-mb={limit / (1 << 20):g}); send fewer prompts per request"})
            return None
        try:
            raw = self.rfile.read(length)
            if len(raw) < length:
                raise TimeoutError(f"{len(raw)} of {length} bytes, then the client closed")
        except (TimeoutError, OSError) as exc:
            self.close_connection = True
            self._send(408, {"error": f"{path}: the body did not arrive within --read-timeout-s="
                                      f"{self.server.read_timeout_s:g} s ({exc})"})
            return None
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            self._send(400, {"error": f"{path}: body is not JSON: {exc}"})
            return None
        if not isinstance(body, dict):
            self._send(400, {"error": f"{path}: body is a JSON {type(body).__name__}, not an object"})
            return None
        return body

    def _refuse_or(self, status: int, message: str) -> None:
        if not self.server.is_authorized(self.headers.get("Authorization")):
            self._send(401, {"error": self.server.refusal(self.headers.get("Authorization"))})
        else:
            self._send(status, {"error": message})


# ---------------------------------------------------------------------------------------------------------------
# the command line: the run's config (the trainer's YAML), or TRL's `vllm-serve` flags, or both


@dataclass
class TrlServeFlag:
    """One of `trl vllm-serve`'s flags (TRL 1.16 `trl/scripts/vllm_serve.py` ScriptArguments)."""

    name: str
    type: Any
    default: Any
    """With no config file (TRL's default); with one, None = the config's value."""
    help: str


_TRUE, _FALSE = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


def _to_bool(text: str) -> bool:
    """TRL's (HfArgumentParser's) `string_to_bool`: `--enforce_eager`, `--enforce_eager true` or `false`."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"truthy value expected, got {text!r}")


TRL_FLAGS = [
    TrlServeFlag("model", str, None, "model: a local Hugging Face checkpoint, a hub name (the local cache, else a "
                 "download) or a builtin: name; the trainer's model.name_or_path"),
    TrlServeFlag("revision", str, None, "refused: download that revision and pass its directory as --model"),
    TrlServeFlag("tensor_parallel_size", int, 1, "vLLM tensor-parallel size (rollout.vllm_tensor_parallel_size)"),
    TrlServeFlag("data_parallel_size", int, 1, "1 only: run one server per replica (one per inference node) and "
                 "list them all in the trainer's rollout.vllm_server_base_urls"),
    TrlServeFlag("host", str, "0.0.0.0", "interface to bind (rollout.vllm_server_host)"),
    TrlServeFlag("port", int, 8000, "port (rollout.vllm_server_port)"),
    TrlServeFlag("gpu_memory_utilization", float, 0.9, "fraction of accelerator memory vLLM takes "
                 "(rollout.vllm_gpu_memory_utilization)"),
    TrlServeFlag("dtype", str, "auto", "auto (the checkpoint's dtype), bfloat16, float16 or float32 (model.dtype)"),
    TrlServeFlag("max_model_len", int, None, "tokens of prompt + completion (rollout.vllm_max_model_length)"),
    TrlServeFlag("enable_prefix_caching", _to_bool, None, "vLLM prefix caching (dropped after every weight sync)"),
    TrlServeFlag("enforce_eager", _to_bool, False, "no CUDA graphs (always eager on CPU)"),
    TrlServeFlag("kv_cache_dtype", str, "auto", "vLLM KV-cache dtype"),
    TrlServeFlag("trust_remote_code", _to_bool, False, "let the checkpoint run its own code (model.trust_remote_code)"),
    TrlServeFlag("log_level", str, "info", "info, debug or trace: one log line per request; warning, error or "
                 "critical: none"),
    TrlServeFlag("vllm_model_impl", str, "vllm", "vllm or transformers (rollout.vllm_model_impl)"),
    TrlServeFlag("distributed_executor_backend", str, None, "mp only; ray is refused (TP across nodes: "
                 "rollout.vllm_nodes_per_server, or one server per inference node)"),
    TrlServeFlag("speculative_config", str, None, "refused: speculative decoding is not supported here"),
]
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16",
           "float32": "float32", "float": "float32", "fp32": "float32"}
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass
class ServeSettings:
    """What the command line resolves to: the config, where to listen, and vLLM options outside the config."""

    cfg: EngineConfig
    host: str
    port: int
    num_nodes: int = 1
    node_rank: int = 0
    dtype: str | None = None
    """`--dtype` as given ("auto" = the checkpoint's, resolved once the model is found); None = model.dtype."""
    engine_options: dict = field(default_factory=dict)
    """Extra `vllm.LLM` keywords (enforce_eager, enable_prefix_caching, kv_cache_dtype, trust_remote_code)."""
    log_requests: bool = True
    max_body_mb: float = MAX_BODY_MB
    read_timeout_s: float = READ_TIMEOUT_S
    place: NodePlace = NodePlace(0, 1)
    """Which replica (and node of it, `rollout.vllm_nodes_per_server` > 1) this process is (server_nodes.py)."""
    master_addr: str = "127.0.0.1"
    master_port: int = VLLM_MASTER_PORT


def build_parser(prog: str = "python -m engine.rollout.server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     epilog="Flags also take dashes (--tensor-parallel-size) as TRL's do.")
    parser.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]",
                        help="the run's YAML config (the trainer's) and dotted overrides; optional with --model")
    for flag in TRL_FLAGS:
        dashed = "--" + flag.name.replace("_", "-")
        names = [f"--{flag.name}"] + ([dashed] if dashed != f"--{flag.name}" else [])
        extra = {"nargs": "?", "const": True} if flag.type is _to_bool else {}
        parser.add_argument(*names, dest=flag.name, type=flag.type, default=None,
                            help=f"{flag.help}; without a config: {flag.default}", **extra)
    parser.add_argument("--num-nodes", "--num_nodes", type=int, default=1, help="inference nodes of the job")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's rank among them")
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="rollout.vllm_nodes_per_server "
                        "> 1: the address of node 0 of this node's rollout server (vLLM's --master-addr)")
    parser.add_argument("--master-port", "--master_port", type=int, default=VLLM_MASTER_PORT,
                        help="rollout.vllm_nodes_per_server > 1: node 0's torch.distributed port (vLLM's --master-port)")
    parser.add_argument("--max-body-mb", "--max_body_mb", type=float, default=MAX_BODY_MB,
                        help="largest POST body accepted (larger: 413, unread)")
    parser.add_argument("--read-timeout-s", "--read_timeout_s", type=float, default=READ_TIMEOUT_S,
                        help="longest wait for a request's next bytes (a slower body: 408)")
    return parser


def parse_serve_args(argv: list[str], prog: str = "python -m engine.rollout.server") -> ServeSettings:
    """The server's settings from its command line: `CONFIG [overrides]` (the trainer's config), `--model M [TRL
    flags] [overrides]` (TRL's `vllm-serve`: the engine's defaults, TRL's server defaults for the flags not given),
    or both (the flags given override the config). Raises ValueError (ConfigError) with what to change.

    With a config: the same config and overrides as the trainer (launch/grpo_72b.slurm passes both the same). Without
    one: `--model` and TRL 1.16's `vllm-serve` flags (`TRL_FLAGS`, spelt with underscores or dashes, at TRL's server
    defaults: 0.0.0.0:8000, gpu_memory_utilization 0.9, dtype auto = the checkpoint's) over the engine's defaults;
    flags given next to a config override it. TRL flags this server cannot honour (--data_parallel_size > 1,
    --revision, --distributed_executor_backend ray, --speculative_config) and the flags TRL would pass on to
    `vllm serve` are refused with what to do instead. The engine runs at `rollout.vllm_tensor_parallel_size` from
    `model.name_or_path` (a hub name: the local cache, else a download, as the trainer resolves it) and serves on
    `rollout.vllm_server_host` / `rollout.vllm_server_port` (TRL's 0.0.0.0:8000; the trainer's
    `rollout.vllm_server_base_url`, or host + port). The socket is bound before the engine loads, so a port clash fails
    at once and `/health` answers "loading" until the engine is ready.
    """
    argv = [a[2:] if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0] else a for a in argv]
    args, unknown = build_parser(prog).parse_known_intermixed_args(_explicit_switches(argv))
    if unknown:
        flags = ", ".join("--" + f.name for f in TRL_FLAGS)
        raise ValueError(
            f"unknown flag(s) {' '.join(unknown)}: `trl vllm-serve` passes unknown flags on to `vllm serve`; this "
            f"server builds its vLLM engine itself and takes {flags}, --num-nodes, --node-rank, and dotted config "
            "overrides (section.key=value, e.g. rollout.weight_sync_bucket_mb=256)")
    config = next((a for a in args.args[:1] if "=" not in a), None)
    overrides = args.args[1:] if config is not None else args.args
    if config is None and args.model is None:
        raise ValueError("give the run's config (python -m engine.rollout.server CONFIG [overrides]) or the model, "
                         "as with TRL (grpo-engine vllm-serve --model Qwen/Qwen2.5-7B --tensor_parallel_size 2)")
    given = {f.name: getattr(args, f.name) for f in TRL_FLAGS}
    if config is None:  # TRL's vllm-serve: its defaults for what is not given
        given = {f.name: f.default if given[f.name] is None else given[f.name] for f in TRL_FLAGS}
    _refuse_unsupported_flags(given)
    data = config_to_dict(load_config(config, overrides))
    model, rollout = data["model"], data["rollout"]
    rollout["vllm_mode"] = "server"
    for flag, (section, key) in {"model": (model, "name_or_path"), "trust_remote_code": (model, "trust_remote_code"),
                                 "tensor_parallel_size": (rollout, "vllm_tensor_parallel_size"),
                                 "gpu_memory_utilization": (rollout, "vllm_gpu_memory_utilization"),
                                 "max_model_len": (rollout, "vllm_max_model_length"),
                                 "vllm_model_impl": (rollout, "vllm_model_impl"),
                                 "host": (rollout, "vllm_server_host"), "port": (rollout, "vllm_server_port")}.items():
        if given[flag] is not None:
            section[key] = given[flag]
    cfg = build_config(data)
    options = {"enforce_eager": given["enforce_eager"] or None, "enable_prefix_caching": given["enable_prefix_caching"],
               "trust_remote_code": cfg.model.trust_remote_code or None,
               "kv_cache_dtype": None if given["kv_cache_dtype"] in (None, "auto") else given["kv_cache_dtype"]}
    if given["log_level"] is not None and given["log_level"] not in _LOG_LEVELS:
        raise ValueError(f"--log_level={given['log_level']!r}: expected one of {', '.join(_LOG_LEVELS)}")
    for problem in nodes_per_server_problems(cfg.rollout):
        raise ValueError(problem)
    place = NodePlace.of(args.num_nodes, args.node_rank, cfg.rollout.vllm_nodes_per_server)
    if args.max_body_mb <= 0 or args.read_timeout_s <= 0:
        raise ValueError(f"--max-body-mb={args.max_body_mb:g} and --read-timeout-s={args.read_timeout_s:g} must be > 0")
    return ServeSettings(cfg, cfg.rollout.vllm_server_host, cfg.rollout.vllm_server_port, args.num_nodes,
                         args.node_rank, given["dtype"], {k: v for k, v in options.items() if v is not None},
                         given["log_level"] not in ("critical", "error", "warning"), args.max_body_mb,
                         args.read_timeout_s, place, args.master_addr, args.master_port)


def _explicit_switches(argv: list[str]) -> list[str]:
    """`--enforce_eager CONFIG` -> `--enforce_eager true CONFIG`: a bare switch must not take the next word."""
    switches = {f"--{name}" for f in TRL_FLAGS if f.type is _to_bool for name in (f.name, f.name.replace("_", "-"))}
    out = []
    for i, word in enumerate(argv):
        out.append(word)
        if word in switches and (i + 1 == len(argv) or argv[i + 1].lower() not in _TRUE + _FALSE):
            out.append("true")
    return out


def _refuse_unsupported_flags(given: dict) -> None:
    """ValueError for the TRL flags this server cannot honour, each with what to do instead."""
    if given["revision"] is not None:
        raise ValueError(f"--revision={given['revision']} is not supported: download that revision "
                         "(`huggingface-cli download NAME --revision REV --local-dir DIR`) and pass --model DIR")
    if given["data_parallel_size"] not in (None, 1):
        raise ValueError(f"--data_parallel_size={given['data_parallel_size']} is not supported: run one server per "
                         "data-parallel replica (one per inference node, each with --tensor_parallel_size) and give "
                         "the trainer all of them: rollout.vllm_server_base_urls=[http://HOST1:PORT,http://HOST2:PORT]")
    if given["distributed_executor_backend"] not in (None, "mp"):
        raise ValueError(f"--distributed_executor_backend={given['distributed_executor_backend']} is not supported: "
                         "vLLM runs its mp executor (the default): across nodes with rollout.vllm_nodes_per_server=K "
                         "(K nodes per server), or start one server per node and list them in "
                         "rollout.vllm_server_base_urls")
    if given["speculative_config"] is not None:
        raise ValueError("--speculative_config is not supported: the trainer's importance-sampling correction uses "
                         "the sampler's own log-probs, which speculative decoding does not return here")
    if given["dtype"] is not None and given["dtype"] != "auto" and given["dtype"] not in _DTYPES:
        raise ValueError(f"--dtype={given['dtype']}: expected auto, {', '.join(sorted(set(_DTYPES.values())))}")


def resolve_dtype(flag: str | None, model_dir: Path, config_dtype: str) -> str:
    """`--dtype`: None = the config's model.dtype; "auto" = the checkpoint's (config.json `dtype` / `torch_dtype`,
    float32 when it names none; vLLM's own "auto" would serve a float32 checkpoint in 16 bits on a GPU, which the
    trainer's float32 weights and the sync's tolerance do not expect)."""
    if flag is None:
        return config_dtype
    if flag != "auto":
        return _DTYPES[flag]
    hf_config = json.loads((model_dir / "config.json").read_text())
    return _DTYPES.get(str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"), "float32")


def main(argv: list[str] | None = None, prog: str = "python -m engine.rollout.server") -> int:
    try:
        settings = parse_serve_args(sys.argv[1:] if argv is None else argv, prog)
        token = read_token(side="rollout server")
    except (ValueError, RolloutServerError) as exc:
        print(f"rollout_server: refusing to start: {exc}", file=sys.stderr)
        return 2
    cfg, rollout, place = settings.cfg, settings.cfg.rollout, settings.place
    quiet_library_logs(cfg.logging.verbose)  # before vLLM is imported (engine/log_filters.py)
    if place.node:  # a multi-node server's other nodes: vLLM workers only, no HTTP
        model_dir = resolve_model_dir(cfg.model.name_or_path, cfg.train.output_dir, download=True,
                                      trust_remote_code=cfg.model.trust_remote_code)
        return run_worker_node(settings, place, model_dir, resolve_dtype(settings.dtype, model_dir, cfg.model.dtype))
    server = RolloutServer((settings.host, settings.port), token, max_body_mb=settings.max_body_mb,
                           read_timeout_s=settings.read_timeout_s)
    server.tensor_parallel_size = rollout.vllm_tensor_parallel_size
    server.replica = (place.replica, place.num_replicas)
    server.nodes = place.nodes
    server.log_requests = settings.log_requests
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    thread = threading.Thread(target=server.serve_forever, name="rollout-http", daemon=True)
    thread.start()
    where = " (every interface)" if settings.host in ("0.0.0.0", "::", "") else " (this interface only)"
    print(f"rollout_server: {place.describe()} listening on "
          f"http://{settings.host}:{server.server_address[1]}{where} (token from ${TOKEN_ENV}); loading "
          f"{cfg.model.name_or_path} at vLLM TP {rollout.vllm_tensor_parallel_size}", file=sys.stderr, flush=True)
    engine = None
    try:
        from engine.rollout.vllm_engine import ServerEngine

        model_dir = resolve_model_dir(cfg.model.name_or_path, cfg.train.output_dir, download=True,
                                      trust_remote_code=cfg.model.trust_remote_code)
        server.model = model_identity(model_dir, cfg.model.name_or_path, cfg.model.trust_remote_code)
        dtype = resolve_dtype(settings.dtype, model_dir, cfg.model.dtype)
        lora = cfg.lora.use_peft and cfg.lora.lora_weight_sync == "adapter"  # adapter-only sync: vLLM's LoRA on
        engine = ServerEngine(model_dir, rollout, cfg.generation, seed=cfg.train.seed, dtype=dtype,
                              **settings.engine_options, **(lora_engine_options(cfg.lora.lora_r) if lora else {}),
                              **place.engine_options(settings.master_addr, settings.master_port))
        server.engine = engine
        print(f"rollout_server: engine ready ({dtype})", file=sys.stderr, flush=True)
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
