"""The trainer's side of server mode: an HTTP client of engine/rollout/server.py (no vLLM import).

Owns: `RolloutClient` (one process's connection to one server: health, generate, prompt log-probs, the server's half
of a weight sync; the token, timeouts, retries of idempotent calls, errors naming URL, endpoint and cause),
`SharedRolloutClient` (rank 0 talks HTTP to every server and every rank gets the same result or the same error;
several servers split a round; a restarted server is waited for, re-synced through `on_restart` and asked again;
`generate_async` for asynchronous rollout), `connect_rollout_server` and the token (`read_token`, `TOKEN_HOWTO`).
Details: the class docstrings. The trainer's `RolloutEngine` in server mode is engine/rollout/server_rollout.py's,
around `SharedRolloutClient`.

Must not: import vLLM (engine/rollout/vllm_engine.py does, on the server), know Megatron's layout, or log the token.

Test: tests/integration/test_rollout_server.py (a real server in another process).
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from dataclasses import asdict

import torch.distributed as dist

from engine.config import GenerationConfig, RolloutConfig
from engine.rollout.vllm_engine import Rollout

TOKEN_ENV = "GRPO_ENGINE_TOKEN"
"""Environment variable holding the run's shared secret (launch/grpo_72b.slurm exports a random one per job)."""
_RETRY_STATUSES = (502, 503, 504)


class RolloutServerError(RuntimeError):
    """A request to the rollout server failed (the message names the URL, the endpoint and the cause)."""


class RolloutServerLost(RolloutServerError):
    """The server went away (connection refused or reset, or still loading, after every retry) or came back as a
    new process whose weights are the checkpoint's, not the trainer's: a restart, which `SharedRolloutClient`
    can recover from (wait for health, sync the weights again, repeat the request)."""


TOKEN_HOWTO = (f"generate one once, e.g. `export {TOKEN_ENV}=$(python -c 'import secrets; "
               f"print(secrets.token_hex(32))')`, and start the rollout server and the trainer with that same value "
               f"(under SLURM, export it before sbatch; launch/grpo_72b.slurm makes one per job)")
"""How to set the token, for every message about it."""


def read_token(side: str = "trainer") -> str:
    """The run's token from $GRPO_ENGINE_TOKEN; refuses a missing or short one, naming `side` ("trainer" or
    "rollout server": both sides call this)."""
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 16:
        state = f"too short ({len(token)} characters, 16+ needed)" if token else "unset"
        other = "rollout server" if side == "trainer" else "trainer"
        raise RolloutServerError(
            f"${TOKEN_ENV} is {state} in the {side}'s environment: it is the shared secret that authenticates the "
            f"trainer to the rollout server in server mode, and the {other} needs the same value; {TOKEN_HOWTO}"
        )
    return token


def _refused_token(server_said: str = "") -> str:
    return (f"the server refused this trainer's ${TOKEN_ENV}: the two sides hold different values; {TOKEN_HOWTO}, "
            "then restart the one whose value changed" + (f" (the server said: {server_said})" if server_said else ""))


def server_urls(rollout: RolloutConfig) -> list[str]:
    """`vllm_server_base_urls` if set (several servers), else `[server_url(rollout)]`."""
    if rollout.vllm_server_base_urls:
        return [url.rstrip("/") for url in rollout.vllm_server_base_urls]
    return [server_url(rollout)]


def server_url(rollout: RolloutConfig) -> str:
    """`vllm_server_base_url` if set, else http://<vllm_server_host>:<vllm_server_port> (0.0.0.0 = this host)."""
    if rollout.vllm_server_base_url:
        return rollout.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if rollout.vllm_server_host in ("0.0.0.0", "") else rollout.vllm_server_host
    return f"http://{host}:{rollout.vllm_server_port}"


class RolloutClient:
    """HTTP client of one rollout server.

    `wait_until_healthy()` polls `/health` for up to `vllm_server_timeout`; `generate` / `prompt_logprobs` / `sleep` /
    `wake_up` have ColocatedEngine's signatures; `init_weight_group` / `update_weights` / `close_weight_group` drive
    the server's half of a weight sync and `weight_digests` asks what it holds (engine/rollout/server_sync.py
    `sync_server` drives the trainer's half). Every request carries the run's token (`Authorization: Bearer`, from
    $GRPO_ENGINE_TOKEN) and a timeout; idempotent calls (health, generate, prompt_logprobs, sleep, wake_up) are
    retried with exponential backoff on connection failures and 502/503/504; weight-group calls are never retried
    (half a transfer cannot be replayed). Every failure is a `RolloutServerError` naming the URL, the endpoint and
    the cause (connection refused, 401 token, the server's 5xx message, timeout). Token trouble says which side
    lacks it and how to set it; a token the server does not share fails the health wait at once (its `/health`
    answers `authorized: false`).
    """

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 240.0, request_timeout_s: float = 3600.0,
                 num_retries: int = 3, backoff_s: float = 1.0):
        """
        Args:
            timeout_s: how long `wait_until_healthy` waits, and the limit of one control request.
            request_timeout_s: the limit of one generate / prompt_logprobs / weight-update request.
            num_retries: extra attempts of an idempotent request, `backoff_s * 2**k` apart.
        """
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s
        self.num_retries = num_retries
        self.backoff_s = backoff_s
        self.last_instance: str | None = None
        """The server process that answered the last `generate` (its /health `instance_id`)."""
        self.lora_version: int | None = None
        """The LoRA adapter version last synced into the server (adapter-only sync): every generate and prompt
        log-prob request names it (None: the base weights alone)."""

    def __repr__(self) -> str:  # never the token
        return f"RolloutClient({self.base_url!r})"

    # --- transport ------------------------------------------------------------------------------------------------

    def _request_once(self, method: str, endpoint: str, payload: dict | None, timeout_s: float) -> dict:
        url = f"{self.base_url}{endpoint}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"}
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            try:
                message = json.loads(body).get("error", body)
            except ValueError:
                message = body
            cause = (f"401 Unauthorized: {_refused_token(message)}" if exc.code == 401
                     else f"HTTP {exc.code}: {message}")
            raise _Failure(cause, retry=exc.code in _RETRY_STATUSES, lost=exc.code == 410) from None
        except (TimeoutError, socket.timeout):
            raise _Failure(f"no answer within {timeout_s:g} s (timeout)", retry=False) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise _Failure(f"no answer within {timeout_s:g} s (timeout)", retry=False) from None
            raise _Failure(f"cannot connect ({_describe(reason)})", retry=True) from None
        except (ConnectionError, OSError) as exc:  # reset or closed mid-answer (a killed server)
            raise _Failure(f"connection lost ({_describe(exc)})", retry=True) from None

    def _request(self, method: str, endpoint: str, payload: dict | None = None, *, timeout_s: float | None = None,
                 idempotent: bool = True) -> dict:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        attempts = 1 + (self.num_retries if idempotent else 0)
        for attempt in range(attempts):
            try:
                return self._request_once(method, endpoint, payload, timeout_s)
            except _Failure as failure:
                if not failure.retry or attempt + 1 == attempts:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    # gone, or loading again, or without the adapter the trainer synced (410: restarted)
                    kind = RolloutServerLost if failure.retry or failure.lost else RolloutServerError
                    raise kind(
                        f"rollout server {self.base_url}: {method} {endpoint} failed{tries}: {failure.cause}"
                    ) from None
                time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    # --- health -----------------------------------------------------------------------------------------------------

    def health(self) -> dict:
        """The server's `/health` answer (`status`: "ok" once the engine is ready, "loading" before)."""
        return self._request_once("GET", "/health", None, min(self.timeout_s, 10.0))

    def check_health(self) -> dict:
        """`/health` with the idempotent retries; RolloutServerError unless the engine is ready."""
        info = self._request("GET", "/health", timeout_s=min(self.timeout_s, 10.0))
        if info.get("status") != "ok":
            raise RolloutServerError(f"rollout server {self.base_url}: GET /health: status {info.get('status')!r}")
        return info

    def wait_until_healthy(self) -> dict:
        """Poll `/health` until the engine is ready; RolloutServerError after `timeout_s` with the last cause, or at
        once when the server says this client's token is not its own (`authorized`: false)."""
        deadline, cause = time.monotonic() + self.timeout_s, "no answer yet"
        while True:
            try:
                info = self.health()
                if info.get("authorized") is False:
                    raise RolloutServerError(f"rollout server {self.base_url}: GET /health: {_refused_token()}")
                if info.get("status") == "ok":
                    return info
                cause = f"status {info.get('status')!r}"
            except _Failure as failure:
                cause = failure.cause
            if time.monotonic() > deadline:
                raise RolloutServerError(
                    f"rollout server {self.base_url}: GET /health not ready within {self.timeout_s:g} s "
                    f"(rollout.vllm_server_timeout): {cause}"
                )
            time.sleep(0.5)

    # --- ColocatedEngine's interface --------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None,
                 generation: GenerationConfig | None = None, structured_outputs_regex: str | None = None) -> Rollout:
        """G completions per prompt, prompt-major, sampled with `generation` (the trainer's settings), each matching
        `structured_outputs_regex` (None = unconstrained)."""
        payload = {"prompt_ids": prompt_ids, "num_generations": num_generations, "seeds": seeds,
                   "generation": asdict(generation) if generation is not None else None,
                   "structured_outputs_regex": structured_outputs_regex, **self._adapter()}
        out = self._request("POST", "/generate", payload, timeout_s=self.request_timeout_s)
        self.last_instance = out.get("instance_id")
        prompts = [list(p) for p in prompt_ids for _ in range(num_generations)]
        return Rollout.from_json(out, prompts)

    def prompt_logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        out = self._request("POST", "/prompt_logprobs", {"sequences": sequences, "temperature": temperature,
                                                         **self._adapter()}, timeout_s=self.request_timeout_s)
        return out["logprobs"]

    def _adapter(self) -> dict:
        return {} if self.lora_version is None else {"lora_version": self.lora_version}

    def sleep(self) -> None:
        self._request("POST", "/sleep", {})

    def wake_up(self) -> None:
        self._request("POST", "/wake_up", {})

    def close(self) -> None:
        """Nothing to release: the server outlives the trainer's connection (the launcher stops it)."""

    # --- weight sync (server half) ----------------------------------------------------------------------------------

    def init_weight_group(self, **group) -> dict:
        """The server's workers join the transfer group (blocks until the trainer's senders have joined)."""
        return self._request("POST", "/weights/init", group, timeout_s=self.request_timeout_s, idempotent=False)

    def update_weights(self, verify: bool = True) -> dict:
        """The server receives one sync and loads it (blocks until loaded); with `verify` each worker's answer
        holds the digests of what it then holds."""
        return self._request("POST", "/weights/update", {"verify": verify}, timeout_s=self.request_timeout_s,
                             idempotent=False)

    def update_adapter(self, **adapter) -> dict:
        """The server's workers receive the LoRA adapter over the transfer group and load it (adapter-only sync;
        `adapter`: version, names, shapes, dtype, peft_config, verify); each worker's answer holds, with verify,
        the digests of the adapter as held."""
        return self._request("POST", "/lora/update", adapter, timeout_s=self.request_timeout_s, idempotent=False)

    def weight_digests(self) -> dict:
        """{"workers": each engine rank's {"engine_rank", "digests"}} of the weights the server holds now."""
        return self._request("POST", "/weights/digests", {}, timeout_s=self.request_timeout_s)

    def close_weight_group(self) -> dict:
        return self._request("POST", "/weights/close", {}, idempotent=False)

    def shutdown(self) -> dict:
        return self._request("POST", "/shutdown", {}, idempotent=False)


class SharedRolloutClient:
    """The trainer's engine in server mode: rank `src` talks HTTP to every server, every rank gets the result or
    the same error.

    With several servers (`rollout.vllm_server_base_urls`) a round's prompts are split among them in contiguous
    shares, in list order, requested concurrently and put back together prompt-major: with per-prompt seeds the
    round is the one a single server would sample. Each server gets its own weight sync (engine/rollout/
    server_rollout.py keeps one `ServerSync` link per server).

    Restarts: a server that stops answering (after the client's retries), or that answers as a new process
    (`instance_id`) since its last sync, raises `RolloutServerLost`. With `on_restart` (a collective callable that
    syncs, and verifies, the weights into every server), `generate` then waits up to `vllm_server_timeout` for every
    server's health check, calls it (the weight links rejoin the restarted servers) and asks once more; a second
    failure is raised.

    `prompt_logprobs` (weight-sync verification) is per rank: every rank's sequences are gathered first, rank src
    asks for them all, each rank gets its own (data-parallel ranks verify different probes). `generate_async` starts
    a generate on a background thread of rank src and returns a `PendingGenerate`, whose `result()` (collective)
    shares the rollout or the error like `generate`: the caller keeps at most one in flight and never syncs weights
    while one is.

    Collective: every rank of `group` (None = the default world) must make the same calls in the same order.
    """

    def __init__(self, clients: RolloutClient | list[RolloutClient] | None, rank: int, generation: GenerationConfig,
                 *, group=None, src: int = 0, num_servers: int | None = None, on_restart=None):
        clients = [clients] if isinstance(clients, RolloutClient) else clients
        if (rank == src) != bool(clients):
            raise ValueError(f"rank {rank}: exactly rank {src} holds the HTTP clients")
        self.clients = clients or []
        self.num_servers = num_servers or len(self.clients) or 1
        """The same on every rank."""
        if self.clients and len(self.clients) != self.num_servers:
            raise ValueError(f"{len(self.clients)} clients for {self.num_servers} servers")
        self.rank, self.generation, self.group, self.src = rank, generation, group, src
        self.structured_outputs_regex: str | None = None
        """The trainer's `rollout.vllm_structured_outputs_regex`, sent with every generate request."""
        self.can_sleep = False
        self.healths: list[dict] = []
        """Every server's /health answer at connection (`vllm_tensor_parallel_size` sizes its weight sync)."""
        self.synced_instance: list[str | None] = [None] * self.num_servers
        """Rank src: per server, the process (`instance_id`) that holds the trainer's last synced weights."""
        self.on_restart = on_restart
        """A collective callable that syncs (and verifies) the weights into every server; None = a lost server is
        an error."""
        self.num_restarts = 0
        """Restarts recovered from (the same on every rank)."""
        self._executor = None
        """Rank src: the background thread of `generate_async` (made on first use)."""

    def describe(self, server: int) -> str:
        return self.clients[server].base_url if self.clients else f"rollout server {server}"

    def _shared(self, call):
        box = [None]
        if self.rank == self.src:
            try:
                box[0] = ("ok", call(), False)
            except RolloutServerError as exc:
                box[0] = ("error", str(exc), isinstance(exc, RolloutServerLost))
            except Exception as exc:  # noqa: BLE001 - e.g. a malformed answer: the other ranks must not hang
                box[0] = ("error", f"rollout server {self.describe(0)}: {type(exc).__name__}: {exc}", False)
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=self.src, group=self.group)
        status, value, lost = box[0]
        if status == "error":
            raise (RolloutServerLost if lost else RolloutServerError)(value)
        return value

    def _on_every_server(self, call, items: list) -> list:
        """`call(client, share)` for each server's contiguous share of `items`, concurrently; the answers in order
        (servers with an empty share are not asked). Rank src only."""
        from concurrent.futures import ThreadPoolExecutor

        size = -(-len(items) // self.num_servers) if items else 0
        shares = [(i, items[i * size : (i + 1) * size]) for i in range(self.num_servers)]
        shares = [(i, share) for i, share in shares if share]
        if len(shares) <= 1:
            return [call(self.clients[i], share) for i, share in shares]
        with ThreadPoolExecutor(max_workers=len(shares), thread_name_prefix="rollout-request") as pool:
            futures = [pool.submit(call, self.clients[i], share) for i, share in shares]
            return [future.result() for future in futures]  # the first failure (in server order) is raised

    def _generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None) -> Rollout:
        rows = list(zip(prompt_ids, seeds if seeds is not None else [None] * len(prompt_ids)))

        def ask(client: RolloutClient, share: list) -> Rollout:
            ids = [p for p, _ in share]
            return client.generate(ids, num_generations, None if seeds is None else [s for _, s in share],
                                   self.generation, self.structured_outputs_regex)

        parts = self._on_every_server(ask, rows)
        for server, client in enumerate(self.clients):
            synced = self.synced_instance[server]
            if synced is not None and client.last_instance not in (None, synced):
                raise RolloutServerLost(
                    f"rollout server {client.base_url} restarted since the last weight sync (process {synced} -> "
                    f"{client.last_instance}): it samples from its checkpoint, not the trainer's weights")
        return Rollout.concat(parts)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None) -> Rollout:
        try:
            return self._shared(lambda: self._generate(prompt_ids, num_generations, seeds))
        except RolloutServerLost as lost:
            return self._recover(lost, prompt_ids, num_generations, seeds)

    def _recover(self, lost: RolloutServerLost, prompt_ids: list[list[int]], num_generations: int,
                 seeds: list[int] | None) -> Rollout:
        """After a lost server: wait for every server, resync (collective), ask once more; else re-raise."""
        self.recover(lost, stacklevel=4)
        return self._shared(lambda: self._generate(prompt_ids, num_generations, seeds))

    def recover(self, lost: RolloutServerLost, *, stacklevel: int = 3) -> None:
        """After a lost server (collective, `lost` raised on every rank): wait up to `vllm_server_timeout` for every
        server's health check and sync the weights again (`on_restart`); re-raises `lost` without `on_restart`. The
        caller then asks again what the lost server did not answer."""
        if self.on_restart is None:
            raise lost
        import warnings

        warnings.warn(f"{lost}; waiting up to rollout.vllm_server_timeout for the server(s), then syncing the "
                      "weights again and repeating the request", RuntimeWarning, stacklevel=stacklevel)
        self.reconnect()
        self.on_restart()
        self.num_restarts += 1

    def generate_async(self, prompt_ids: list[list[int]], num_generations: int,
                       seeds: list[int] | None = None) -> PendingGenerate:
        """Start `generate` without waiting: rank `src` makes the HTTP requests on a background thread (they overlap
        the caller's work); `PendingGenerate.result()` (collective, in the caller's thread) hands every rank the
        rollout, or the same error, with the restart recovery of `generate`. Not collective itself."""
        return PendingGenerate(self, (prompt_ids, num_generations, seeds))

    def _every_ranks(self, sequences: list[list[int]]) -> tuple[list[list[int]], int]:
        """Every rank's `sequences` (collective): the distinct lists of the group concatenated, and where this rank's
        start in it. The ranks may ask about different sequences (data-parallel ranks verify their own probes)."""
        if not dist.is_initialized():
            return sequences, 0
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, sequences, group=self.group)
        distinct: list = []
        for seqs in every:
            if seqs not in distinct:
                distinct.append(seqs)
        mine = distinct.index(sequences)
        return [s for seqs in distinct for s in seqs], sum(len(seqs) for seqs in distinct[:mine])

    def prompt_logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """Log-probs of this rank's `sequences`, shared out among the servers (collective; each rank its own)."""
        every, start = self._every_ranks(sequences)

        def ask(client: RolloutClient, share: list) -> list:
            return client.prompt_logprobs(share, temperature)

        answers = self._shared(lambda: [lp for part in self._on_every_server(ask, every) for lp in part])
        return answers[start : start + len(sequences)]

    def prompt_logprobs_each(self, sequences: list[list[int]], temperature: float) -> list[list[list[float]]]:
        """Every server's log-probs of all of this rank's `sequences` (verification checks each server's weights;
        collective, each rank its own sequences: rank src asks for every rank's at once)."""
        every, start = self._every_ranks(sequences)

        def ask(client: RolloutClient, share: list) -> list:
            return client.prompt_logprobs(every, temperature)

        answers = self._shared(lambda: self._on_every_server(ask, list(range(self.num_servers))))
        return [per_server[start : start + len(sequences)] for per_server in answers]

    def reconnect(self) -> list[dict]:
        """Wait (up to each client's `timeout_s`) until every server answers its health check; collective."""
        self.healths = self._shared(lambda: [client.wait_until_healthy() for client in self.clients])
        return self.healths

    def sleep(self) -> None:
        """No-op: the server's engine has its own accelerators; nothing to free for training."""

    def wake_up(self) -> None:
        """No-op (see `sleep`)."""

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for client in self.clients:
            client.close()


class PendingGenerate:
    """A `generate` in flight (`SharedRolloutClient.generate_async`)."""

    def __init__(self, shared: SharedRolloutClient, request: tuple):
        self.shared, self.request = shared, request
        self.done_at: float | None = None
        """Rank src: when the servers answered (time.perf_counter), for the servers' idle time."""
        self.regenerated = False
        """True when a lost server forced the recovery path: the round was asked again after a resync."""
        self._future = None
        if shared.rank == shared.src:
            if shared._executor is None:
                from concurrent.futures import ThreadPoolExecutor

                shared._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-async")
            self._future = shared._executor.submit(self._run)

    def _run(self) -> Rollout:
        try:
            return self.shared._generate(*self.request)
        finally:
            self.done_at = time.perf_counter()

    def result(self) -> Rollout:
        """The rollout on every rank (collective)."""
        future = self._future
        try:
            return self.shared._shared(lambda: future.result())
        except RolloutServerLost as lost:
            self.regenerated = True
            return self.shared._recover(lost, *self.request)


def connect_rollout_server(rollout: RolloutConfig, generation: GenerationConfig, rank: int,
                           on_restart=None) -> SharedRolloutClient:
    """The trainer's handle on the server(s) (collective): every rank checks the token, rank 0 waits for health.
    `on_restart`: see `SharedRolloutClient`."""
    token = read_token()
    urls = server_urls(rollout)
    clients = None
    if rank == 0:
        clients = [RolloutClient(url, token, timeout_s=rollout.vllm_server_timeout,
                                 request_timeout_s=rollout.vllm_request_timeout) for url in urls]
    shared = SharedRolloutClient(clients, rank, generation, num_servers=len(urls), on_restart=on_restart)
    shared.structured_outputs_regex = rollout.vllm_structured_outputs_regex
    shared.reconnect()
    for server, health in enumerate(shared.healths):
        problem = logprobs_mode_mismatch(health.get("logprobs_mode"), generation)
        if problem:
            raise RolloutServerError(f"rollout server {shared.describe(server)}: {problem}")
    return shared


def logprobs_mode_mismatch(server_mode: str | None, generation: GenerationConfig) -> str:
    """Why a server whose vLLM engine reports `server_mode` log-probs (its /health `logprobs_mode`, fixed by the
    generation section it was started with) cannot give this trainer the log-probs of its sampled tokens under
    `generation` (they would come back NaN and the vLLM IS correction would silently act as 1); "" when it can, or
    when no vLLM mode can (T != 1 with truncation: engine/validation.py handles that) or the server does not say."""
    from engine.sampling_settings import reports_trainer_logprobs, reshaping_settings, sampling_logprobs_mode

    needed = sampling_logprobs_mode(generation)
    if server_mode is None or needed is None or reports_trainer_logprobs(server_mode, generation):
        return ""
    settings = ", ".join(reshaping_settings(generation)) or "temperature only"
    return (f"its vLLM engine reports {server_mode} of the sampled tokens, but this run samples with {settings}, "
            f"whose log-probs the trainer compares with need {needed} (engine/sampling_settings.py): they would be "
            "NaN and the vLLM importance-sampling correction would act as 1. Start the server with the run's "
            "generation settings (its config, or the same generation.* overrides)")


class _Failure(Exception):
    """One failed attempt: the cause in words and whether an idempotent request may try again."""

    def __init__(self, cause: str, retry: bool, lost: bool = False):
        super().__init__(cause)
        self.cause, self.retry, self.lost = cause, retry, lost
        """lost: the server answered that it lost this trainer's state (410: the LoRA adapter version asked for)."""


def _describe(reason) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return (f"connection refused: is the server running and listening on this host and port? A rollout server "
                f"without ${TOKEN_ENV} in its environment exits at once: see its log")
    return f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)
