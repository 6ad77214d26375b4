"""Server-mode weight sync, the trainer's half: `build_server_sync` (the plan of this trainer layout into a rollout
server's engine TP, and where the transfer group meets) and `sync_server` (one sync: rank 0 checks the server's
health and asks engine/rollout/server.py over HTTP to join the group and to receive, each request in a background
thread, while the sender ranks (dp_rank 0; with expert parallelism also the expert-data-parallel-rank-0 ranks
holding the other experts) `send_weights` their shards; the outcome is then agreed over the trainer's world so
every rank returns, or raises, together; then the engine ranks' digests of what they hold, returned with the load,
against the sum of the senders' digests of what they sent: engine/rollout/sync_check.py `check_digests`) and
`verify_server` (the same check without a sync). With `rollout.vllm_weight_dtype: fp8` the senders use the FP8 wire
(engine/rollout/fp8_wire.py) and the check compares the digests they kept from the sync. The server's half is engine/rollout/vllm_engine.py's
`WeightReceiverExtension` (`receive_weights` in vLLM's workers).

Layouts: knows neither of its own: the plan (engine/rollout/sync_plan.py) is built from the trainer's
ParallelState and the server's engine TP, and executed by engine/rollout/weight_transport.py.

Must not: import vLLM, change the trainer's parameters (they are only read, so a failed sync leaves them exact),
retry a half-done transfer (a failed sync closes the group; the next one joins a fresh one).

Test: tests/integration/test_rollout_server.py (real vLLM server: trainer TP 1/2 into engine TP 1/2, the tiny
Qwen3-MoE at trainer EP2 into engine TP 1/2, a server killed mid-sync, a restarted server rejoined).
Benchmark: benchmarks/bench_weight_sync.py --vllm.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.policy.hf_map import FLOAT32_TENSORS, ModelDims
from engine.policy.parallel import ParallelState
from engine.rollout.fp8_server_sync import fp8_assemblies
from engine.rollout.fp8_sync import fp8_engine_tensors
from engine.rollout.fp8_wire import send_fp8_weights
from engine.rollout.server import model_mismatch
from engine.rollout.sync_check import WeightSyncError, check_digests, raise_on_every_rank
from engine.rollout.sync_plan import SyncPlan, TrainerLayout, build_sync_plan
from engine.rollout.weight_transport import (
    WeightTransferGroup,
    local_params,
    send_weights,
    sender_digests,
    sender_index,
)


@dataclass
class ServerSync:
    """The trainer's end of the weight-transfer group to a rollout server, kept from one sync to the next."""

    plan: SyncPlan
    host: str
    """Address of global rank 0 (sender 0, which hosts the group's store), as the server reaches it."""
    port: int
    timeout_s: float
    """Bounds joining, every transfer wait and the server's answers."""
    bucket_mb: float
    group: WeightTransferGroup | None = None
    """This rank's group (sender ranks, once joined)."""
    is_joined: bool = False
    """The same on every trainer rank: whether the group exists (False again after a failed sync)."""
    store: object = None
    """Rank 0: the group's TCPStore, listening before the server is asked to join (no connect back-off)."""
    server: int = 0
    """Which of the trainer's rollout servers (`SharedRolloutClient.clients[server]`) this link feeds."""
    instance: str | None = None
    """Rank 0: the server process (`instance_id`) the group was joined with; a new one has left the group."""
    base_instance: str | None = None
    """Adapter-only sync (engine/rollout/adapter_sync.py): the server process that holds the trainer's frozen base."""
    fp8: bool = False
    """`rollout.vllm_weight_dtype: fp8`: syncs go over the FP8 wire (engine/rollout/fp8_wire.py)."""
    fp8_digests: torch.Tensor | None = None
    """FP8: this sender's share of the digests of the last sync (they need the assembly, which only a sync does)."""


def build_server_sync(ps: ParallelState, dims: ModelDims, engine_tp: int, *, ffn_hidden_size: int, dtype: str,
                      group_port: int, timeout_s: float, bucket_mb: float, server: int = 0,
                      fp8: bool = False) -> ServerSync:
    """The plan of this trainer layout into the server's engine TP, and where the group meets; `fp8`: the server
    serves block-FP8 (layouts whose engine boxes cut a 128 x 128 block are refused here, naming the tensors).

    The group's store is hosted by global rank 0 on `group_port` at $MASTER_ADDR (torchrun's and srun's address of
    rank 0's node; the inference nodes reach it as the trainer nodes do), 127.0.0.1 without one.
    """
    layout = TrainerLayout(ps.tp_size, ps.pp_size, ps.vpp_size, ep_size=ps.ep_size, expert_tp_size=ps.etp_size)
    plan = build_sync_plan(dims, layout, engine_tp,
                           ffn_hidden_size=ffn_hidden_size, dtype=dtype)
    wide = [t.name for t in plan.tensors if t.name.endswith(FLOAT32_TENSORS)]
    if wide and dtype != "float32":  # NOTE: the transport sends one dtype; colocated sync keeps these float32
        raise ValueError(f"server-mode weight sync in {dtype}: the model's float32 tensors ({wide[0]} and "
                         f"{len(wide) - 1} more: GLM-4.5's router bias) would arrive rounded to {dtype}; use "
                         "rollout.vllm_mode: colocate or model.dtype: float32")
    sender_index(plan, ps)  # a rank order the plan does not know is refused here, before any server is asked
    if fp8:
        fp8_assemblies(plan)  # raises naming the tensors whose engine boxes cut a block
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    return ServerSync(plan, host, group_port, timeout_s, bucket_mb, server=server, fp8=fp8)


def _in_background(call):
    """Run `call` in a thread; returns (thread, outcome dict with 'value' or 'error')."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome["error"] = error

    thread = threading.Thread(target=run, name="weight-sync-http", daemon=True)
    thread.start()
    return thread, outcome


def _result(background, timeout_s: float, what: str):
    """Wait for a background HTTP call (None = not this rank's); raise its error."""
    if background is None:
        return None
    thread, outcome = background
    thread.join(timeout_s)
    if thread.is_alive():
        raise WeightSyncError(f"{what}: the server did not answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _check_server(ps: ParallelState, client, link: ServerSync) -> bool:
    """Rank 0 checks the server's health; every rank raises if it failed (collective). Returns, on every rank,
    whether the server is another process than the one `link` joined (restarted: it has left the group)."""
    flag = torch.tensor([1.0, 0.0], device=ps.device)  # (ok, restarted); on the backend's device (NCCL)
    if ps.rank == 0:
        try:
            health = client.check_health()
            instance = health.get("instance_id")
            mismatch = model_mismatch(health.get("model"), asdict(link.plan.dims) | {
                "ffn_hidden_size": link.plan.ffn_hidden_size})
            if mismatch:  # before any group is joined: a clear error now, not a failed load or a join timeout
                raise WeightSyncError(f"rollout server {client.base_url} serves another model than this trainer's: "
                                      f"{mismatch}")
        except Exception:
            flag[0] = 0.0
            dist.broadcast(flag, src=0)
            raise
        flag[1] = float(link.instance is not None and instance != link.instance)
        link.instance = instance
    dist.broadcast(flag, src=0)
    if not float(flag[0]):
        raise WeightSyncError("the rollout server's health check failed on trainer rank 0")
    return bool(float(flag[1]))


def sync_server(chunks, ps: ParallelState, dims: ModelDims, engine, link: ServerSync, *,
                verify: bool = True) -> dict[str, float]:
    """Push the policy's current weights into the rollout server (collective: every trainer rank calls it).

    Rank 0 asks the server over HTTP to join the group (first sync, or after a failure) and to receive one sync,
    each request in a background thread, while the sender ranks join and `send_weights` their own shards; the
    outcome is then agreed over the trainer's world so every rank returns, or raises, together.

    Args:
        engine: the trainer's SharedRolloutClient (rank 0 holds the HTTP clients, `engine.clients`).
        link: from `build_server_sync`; its group is kept for the next sync. The server is asked for its health
            first (one GET): a dead one fails at once, a restarted one (new `instance_id`) is joined afresh
            (stats then hold `weight_sync/rejoined`).
        verify: the server's workers digest what they hold after loading, and the trainer compares them with the
            digests of what it sent (`verify_server`'s check).
    Returns:
        {"weight_sync/seconds", "weight_sync/gib" (sent by rank 0), "weight_sync/messages", "weight_sync/buckets"},
        with `verify` "weight_sync/digest_s" (the trainer's digests and the comparison).
    Raises:
        WeightSyncError on every rank when any part failed (a dead or unreachable server, a broken group, a
        timeout, an engine rank holding other values than were sent: the tensors named), naming the cause; the group
        is then closed on this side (the next sync joins a fresh one). The
        trainer's parameters are only read, so they are exactly as before the sync whatever happened.
    """
    start = time.perf_counter()
    client = engine.clients[link.server] if ps.rank == 0 else None
    stats, error, answer = {}, None, None
    try:
        stats |= join_server(ps, client, link)
        http = _in_background(lambda: client.update_weights(verify=verify)) if ps.rank == 0 else None
        try:
            if link.fp8:
                stats |= _send_fp8(chunks, ps, link)
            else:
                stats |= send_weights(chunks, ps, dims, link.group, link.plan, link.bucket_mb)
        finally:
            answer = _result(http, link.timeout_s, "loading the weights")
        if ps.rank == 0:  # generate() checks that it is still this process that answers
            engine.synced_instance[link.server] = answer.get("instance_id", link.instance)
    except Exception as exc:  # noqa: BLE001 - every rank learns of any rank's failure below
        error = f"{type(exc).__name__}: {exc}"
    agree_on_failure(ps, link, error, "the server's weights are not known to be current")
    if verify:
        began = time.perf_counter()
        _check_held(chunks, ps, link, lambda: answer["workers"], client)
        stats["weight_sync/digest_s"] = time.perf_counter() - began
    return stats | {"weight_sync/seconds": time.perf_counter() - start}


def _send_fp8(chunks, ps: ParallelState, link: ServerSync) -> dict[str, float]:
    """This rank's part of an FP8 sync (senders only) and its share of the digests, kept on `link`."""
    rows = len(fp8_engine_tensors(link.plan))
    link.fp8_digests = torch.zeros(rows, link.plan.engine_tp, dtype=torch.int64)
    sender = sender_index(link.plan, ps)
    if sender is None:
        return {}
    stats, link.fp8_digests = send_fp8_weights(local_params(chunks), sender, link.group, link.plan, link.bucket_mb)
    return stats


def join_server(ps: ParallelState, client, link: ServerSync) -> dict[str, float]:
    """Check the server's health and join its transfer group where `link` is not joined (first sync, after a
    failure, or a restarted server: then {"weight_sync/rejoined": 1.0}). Collective; raises on this rank's failure
    (callers agree on it with `agree_on_failure`)."""
    plan, stats = link.plan, {}
    # a dead server fails here at once, not after the group's join timeout; a restarted one (a new process,
    # its checkpoint's weights, outside the group) is joined afresh
    if _check_server(ps, client, link) and link.is_joined:
        if link.group is not None:
            link.group.close()
        link.group, link.store, link.is_joined = None, None, False
        stats["weight_sync/rejoined"] = 1.0
    if not link.is_joined:
        request = dict(host=link.host, port=link.port, world_size=plan.group_size,
                       first_engine_rank=plan.trainer.num_senders, timeout_s=link.timeout_s,
                       plan=plan.spec() | {"fp8": link.fp8},
                       bucket_mb=link.bucket_mb)
        if ps.rank == 0:  # the store listens first: members that connect early back off for up to ~20 s
            link.store = dist.TCPStore(link.host, link.port, plan.group_size, is_master=True,
                                       timeout=timedelta(seconds=link.timeout_s), wait_for_workers=False)
        http = _in_background(lambda: client.init_weight_group(**request)) if ps.rank == 0 else None
        try:
            sender = sender_index(plan, ps)
            if sender is not None:
                link.group = WeightTransferGroup.create(link.host, link.port, sender, plan.group_size,
                                                        link.timeout_s, host_store=False)
        finally:
            _result(http, link.timeout_s, "joining the weight-transfer group")
        link.is_joined = True
    return stats


def agree_on_failure(ps: ParallelState, link: ServerSync, error: str | None, unknown: str) -> None:
    """Every rank learns whether any rank's part of a sync failed (`error`: this rank's, None = none); if one did,
    the group is closed (the next sync joins a fresh one) and every rank raises WeightSyncError naming the first
    failure and saying what is `unknown` now. Collective."""
    failed = torch.tensor([0.0 if error is None else 1.0], device=ps.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if float(failed) == 0:
        return
    if link.group is not None:
        link.group.close()
    link.group, link.store, link.is_joined = None, None, False
    errors: list = [None] * ps.world_size
    dist.all_gather_object(errors, error)
    first = next((rank, e) for rank, e in enumerate(errors) if e is not None)
    raise WeightSyncError(f"weight sync into the rollout server failed (first error on trainer rank {first[0]}: "
                          f"{first[1]}); the trainer's weights and optimizer state are unchanged, {unknown}")


def verify_server(chunks, ps: ParallelState, engine, link: ServerSync) -> None:
    """Check, without syncing, that the server's engine ranks hold what the trainer holds now, bit for bit
    (collective; the server's `/weights/digests`). Raises WeightSyncError on every rank naming what differs."""
    client = engine.clients[link.server] if ps.rank == 0 else None
    _check_held(chunks, ps, link, lambda: client.weight_digests()["workers"], client)


def _check_held(chunks, ps: ParallelState, link: ServerSync, workers, client) -> None:
    """The trainer's digests of what each engine rank must hold (summed over the senders) against the engine ranks'
    own (`workers()`, called on rank 0: each worker's {"engine_rank", "digests"}); every rank raises together."""
    plan = link.plan
    if link.fp8:  # FP8: the digests of the last sync's payload and scales (the assembly happens only in a sync)
        names = [name for name, *_ in fp8_engine_tensors(plan)]
        expected = (link.fp8_digests if link.fp8_digests is not None else
                    torch.zeros(len(names), plan.engine_tp, dtype=torch.int64)).to(ps.device)
    else:
        names = [t.name for t in plan.tensors]
        expected = sender_digests(chunks, ps, plan)
    dist.all_reduce(expected)  # int64 sums wrap mod 2**64, as the digests do
    error = ""
    if ps.rank == 0:
        table = expected.cpu().tolist()  # (tensors, engine ranks)
        try:
            for worker in workers():
                rank = int(worker["engine_rank"])
                error += check_digests({name: table[i][rank] for i, name in enumerate(names)},
                                       worker["digests"], plan.dtype, f"engine rank {rank} of {client.base_url}")
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = f"asking {client.base_url} for its digests failed: {type(exc).__name__}: {exc}"
    raise_on_every_rank(ps, error)
