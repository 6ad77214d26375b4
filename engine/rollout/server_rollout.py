"""Server mode's `RolloutEngine` (engine/rollout/protocol.py): one or several rollout servers (engine/rollout/
server.py) on other processes or nodes.

Owns: `ServerRollout`: the shared HTTP handle (engine/rollout/client.py `SharedRolloutClient`: rank 0 asks, every
rank gets the round; several servers split it), one weight-transfer link per server (engine/rollout/server_sync.py
`ServerSync`, shard to shard) with the first sync at connection (the servers outlive trainer runs: whatever they
hold, the first round samples from the trainer's weights), the restart recovery (a lost server is waited for, synced
again with the weights last pushed, and asked again), and one sample's next turn as its own request (a bounded pool
of rank 0's threads, servers taken in turn). LoRA: adapters merged into the base, or (`lora.lora_weight_sync=adapter`)
alone as a new vLLM adapter version each sync, which every request names (engine/rollout/adapter_sync.py).

Must not: import vLLM, or read Megatron's global parallel state (it gets `ps`).

Test: tests/integration/test_rollout_server.py (two servers: split rounds, a stale one named, a restart recovered,
turns), tests/integration/test_async_rollout.py (`generate_async`), tests/integration/test_lora_adapter_sync.py
(adapter-only sync); tests/unit/test_rollout_protocol.py.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace

import torch

from engine.config import GenerationConfig, RolloutConfig
from engine.lora_settings import LoraSettings
from engine.policy.hf_map import ModelDims
from engine.policy.lora import merged_lora
from engine.policy.parallel import ParallelState
from engine.rollout.adapter_sync import sync_adapter_server
from engine.rollout.client import PendingGenerate, RolloutServerLost, SharedRolloutClient, connect_rollout_server
from engine.rollout.protocol import TurnRequest, TurnResult
from engine.rollout.rollouts import Rollout
from engine.rollout.server_sync import build_server_sync, sync_server

MAX_TURNS_IN_FLIGHT = 64
"""Rank 0's threads for turn requests (each holds one HTTP request open)."""


class ServerRollout:
    """The rollout server(s) as the trainer's engine (module docstring)."""

    runs_apart = True

    def __init__(self, rollout: RolloutConfig, generation: GenerationConfig, ps: ParallelState, dims: ModelDims,
                 chunks: list, *, ffn_hidden_size: int, dtype: str, verify: bool, adapter: LoraSettings | None = None):
        """Connect (waits up to `rollout.vllm_server_timeout` for every server's health check), join one transfer
        group per server and push `chunks` (the policy's Megatron chunks), verified with `verify`. Collective.
        `adapter`: the LoRA setting when only adapters are synced (`lora.lora_weight_sync=adapter`: each server
        must have been started with vLLM's LoRA support, i.e. with the trainer's lora settings)."""
        self.ps, self.dims, self.generation = ps, dims, generation
        self.adapter, self.dtype, self.adapter_version = adapter, getattr(torch, dtype), 0
        self.client = connect_rollout_server(rollout, generation, ps.rank, on_restart=self._resync)
        if adapter is not None:
            _check_lora_support(self.client, adapter)
        self.links = [build_server_sync(ps, dims, health["vllm_tensor_parallel_size"], ffn_hidden_size=ffn_hidden_size,
                                        dtype=dtype, group_port=rollout.vllm_group_port + i,
                                        timeout_s=rollout.vllm_server_timeout, bucket_mb=rollout.weight_sync_bucket_mb,
                                        server=i, fp8=rollout.vllm_weight_dtype == "fp8")
                      for i, health in enumerate(self.client.healths)]
        self._pushed: tuple[list, bool] | None = None  # the chunks last pushed and whether that sync was verified
        self.last_sync: dict[str, float] = {}
        """The last sync's metrics, summed over the servers."""
        self.last_sync_each: list[dict[str, float]] = []
        """The last sync's metrics per server (`weight_sync/rejoined`: joined afresh after a restart)."""
        self._turn_pool: ThreadPoolExecutor | None = None
        self._turn_lock = threading.Lock()
        self._next_server = 0
        self._channel = TurnChannel(self)
        self.sync_weights(chunks, verify=verify)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None) -> Rollout:
        """Rank 0 asks the server(s), every rank gets the round (collective)."""
        return self.client.generate(prompt_ids, num_generations, seeds=seeds)

    def generate_async(self, prompt_ids: list[list[int]], num_generations: int,
                       seeds: list[int] | None = None) -> PendingGenerate:
        """The requests run on rank 0's background thread while the trainer trains; `result()` is collective."""
        return self.client.generate_async(prompt_ids, num_generations, seeds=seeds)

    def prompt_logprobs(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        return self.client.prompt_logprobs(sequences, temperature)

    def prompt_logprobs_each(self, sequences: list[list[int]], temperature: float) -> list[list[list[float]]]:
        """Every server's log-probs (each holds its own copy of the weights)."""
        return self.client.prompt_logprobs_each(sequences, temperature)

    def sync_weights(self, chunks: list, *, verify: bool) -> dict[str, float]:
        """One sync into each server in turn, each through its own transfer group (collective); the stats summed.
        A failure raises WeightSyncError on every rank and leaves the trainer untouched. LoRA adapters are sent
        merged into their base weights (engine/policy/lora.py), or alone as a new vLLM adapter version each sync
        (`adapter`: engine/rollout/adapter_sync.py; requests then name it)."""
        if self.adapter is not None:
            from engine.policy.peft_adapter import peft_config_of

            config, self.adapter_version = peft_config_of(self.adapter).to_dict(), self.adapter_version + 1
            self.last_sync_each = [sync_adapter_server(chunks, self.ps, self.dims, self.client, link, self.adapter,
                                                       config, self.dtype, self.adapter_version, verify=verify)
                                   for link in self.links]
        else:
            with merged_lora(chunks):
                self.last_sync_each = [sync_server(chunks, self.ps, self.dims, self.client, link, verify=verify)
                                       for link in self.links]
        total: dict[str, float] = {}
        for key, value in (item for stats in self.last_sync_each for item in stats.items()):
            total[key] = total.get(key, 0.0) + value
        self._pushed = (chunks, verify)
        self.last_sync = total | {"weight_sync/servers": float(len(self.links)),
                                  "weight_sync/server_restarts": float(self.client.num_restarts)}
        return self.last_sync

    def _resync(self) -> None:
        """A restarted server: push the weights last pushed again, as that sync did (collective)."""
        chunks, verify = self._pushed
        self.sync_weights(chunks, verify=verify)

    def submit_turn(self, request: TurnRequest) -> None:
        """Rank 0 only: the turn goes to the next server as its own request (one completion, `max_tokens` at most,
        the trainer's sampling settings), on a background thread (the engine's own turn channel)."""
        self._channel.submit_turn(request)

    def collect_turns(self, timeout_s: float | None = None) -> list[TurnResult]:
        """The engine's own channel's finished turns (`TurnChannel.collect_turns`)."""
        return self._channel.collect_turns(timeout_s)

    def turn_channel(self) -> TurnChannel:
        """A turn channel of its own (a multi-turn round generated ahead while the trainer's thread drives another
        round's turns, DAPO's further attempts): its `collect_turns` returns its own turns only."""
        return TurnChannel(self)

    def _send_turn(self, request: TurnRequest) -> Future:
        if not self.client.clients:
            raise RuntimeError(f"rank {self.ps.rank}: turns are asked by rank {self.client.src}, which holds the "
                               "HTTP clients")
        with self._turn_lock:  # channels in two threads
            if self._turn_pool is None:
                self._turn_pool = ThreadPoolExecutor(MAX_TURNS_IN_FLIGHT, thread_name_prefix="rollout-turn")
            server = self._next_server % len(self.client.clients)
            self._next_server += 1
        generation = replace(self.generation, max_completion_length=request.max_tokens)
        seeds = None if request.seed is None else [request.seed]
        return self._turn_pool.submit(self._turn, server, list(request.prompt_ids), seeds, generation)

    def _turn(self, server: int, prompt_ids: list[int], seeds: list[int] | None,
              generation: GenerationConfig) -> Rollout:
        """One turn's request (a turn thread); RolloutServerLost when a process other than the one last synced
        answered it (a restarted server samples from its checkpoint, not the trainer's weights)."""
        client = self.client.clients[server]
        rollout = client.generate([prompt_ids], 1, seeds, generation, self.client.structured_outputs_regex)
        synced = self.client.synced_instance[server]
        if synced is not None and client.last_instance not in (None, synced):
            raise RolloutServerLost(f"rollout server {client.base_url} restarted since the last weight sync (process "
                                    f"{synced} -> {client.last_instance}): a turn would sample from its checkpoint")
        return rollout

    def driven_turns(self) -> contextlib.AbstractContextManager:
        """Itself (rank 0 holds the HTTP clients: nothing runs on the other ranks)."""
        return contextlib.nullcontext(self)

    def follow_turns(self) -> None:
        """Nothing: the servers run the turns."""

    def recover(self, lost: Exception) -> None:
        """A lost server (collective): wait for every server, push the weights last pushed again."""
        self.client.recover(lost)

    def sleep(self) -> None:
        """No-op: the servers have accelerators of their own."""

    def wake_up(self) -> None:
        """No-op (see `sleep`)."""

    def close(self) -> None:
        """Turns not yet sent are dropped; those in flight are waited for (their HTTP answers), then the clients."""
        if self._turn_pool is not None:
            self._turn_pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()


class TurnChannel:
    """One driver's turns (rank 0): its requests in flight, sent through the servers' shared pool of turn threads;
    `collect_turns` sees only them, so two multi-turn rounds can be driven at once (one from the trainer's thread,
    one ahead in the background) without taking each other's answers."""

    def __init__(self, rollout: ServerRollout):
        self.rollout = rollout
        self._turns: dict[Future, TurnRequest] = {}

    def submit_turn(self, request: TurnRequest) -> None:
        self._turns[self.rollout._send_turn(request)] = request

    def collect_turns(self, timeout_s: float | None = None) -> list[TurnResult]:
        """The turns whose requests have answered (at least one, unless `timeout_s` passes or none is in flight); a
        failed request raises its RolloutServerError here (RolloutServerLost: a server gone or restarted), and the
        other turns in flight are dropped with it (their round failed: the caller recovers and asks again)."""
        if not self._turns:
            return []
        finished, _ = wait(list(self._turns), timeout=timeout_s, return_when=FIRST_COMPLETED)
        done = []
        for future in finished:
            request = self._turns.pop(future)
            try:
                rollout = future.result()
            except BaseException:
                self._turns.clear()
                raise
            done.append(TurnResult(request.key, rollout.completion_ids[0], rollout.sampling_logprobs[0],
                                   rollout.is_truncated[0]))
        return done

    def wake_up(self) -> None:
        """No-op (the servers' accelerators are their own)."""

    def sleep(self) -> None:
        """No-op (see `wake_up`)."""


def _check_lora_support(client: SharedRolloutClient, adapter: LoraSettings) -> None:
    """Adapter-only sync needs every server's vLLM started with LoRA support of rank >= lora.lora_r (/health's
    max_lora_rank); ValueError naming the server and the fix otherwise (every rank: they all hold the healths)."""
    for server, health in enumerate(client.healths):
        held, url = health.get("max_lora_rank"), client.describe(server)
        if not held or held < adapter.r:
            raise ValueError(
                f"lora.lora_weight_sync=adapter: rollout server {url} runs vLLM "
                f"{'without LoRA support' if not held else f'with max_lora_rank {held} < lora.lora_r={adapter.r}'}: "
                f"start it with the trainer's config (lora.use_peft=true lora.lora_weight_sync=adapter "
                f"lora.lora_r={adapter.r}), or use lora.lora_weight_sync=merged")
