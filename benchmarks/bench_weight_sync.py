"""Weight-sync benchmark (server mode): Megatron policy shards -> engine receiver processes over a WeightTransferGroup,
bucketed (1, 8, 64, 512 MiB) against one message per piece (tensor by tensor), for three model sizes and trainer
TP1 / TP2, writing sync time and GB/s to `benchmarks/results/weight_sync.csv` and redrawing its plots.

What is timed: one `send_weights` call on trainer rank 0, from its start until every engine rank has acknowledged
the last bucket, i.e. pack on the senders -> gloo (or NCCL) transfer -> the receiver (`receive_weights`) assembling
every bucket's HF tensors for its vLLM rank. No vLLM here: the receivers stand in for the engine's workers and drop
each bucket after assembling it (loading into vLLM is timed by the server-mode integration, not here). The
variants of one model run interleaved, round by round (`schedule`), so a slow spell of the machine hits all alike.

Models: Qwen2-shaped with random weights (`init_weights_by_name`), 8 layers, head_dim 32, KV heads = heads / 2,
MLP 3 * hidden, vocabulary 16 * hidden, float32; hidden 128 / 256 / 512, so the parameter bytes grow 4x per step
(8 layers * 12 * H^2 + 2 * 16H * H params: 8.4 / 33.6 / 134 MB).
Baseline `tensor_by_tensor_acked`: the per-tensor protocol of TRL's server mode (`update_named_param`: per parameter an
HTTP call, a broadcast, a barrier with the vLLM workers) and OpenRLHF (`broadcast_to_vllm`: per parameter a Ray
call, a broadcast, `ray.get`), on the same plan, group and receivers: every HF tensor is a transfer of its own
(a header and one message per piece: a QKV tensor from a TP rank is one piece per query group), and every engine
rank acknowledges it before the next tensor starts (`send_weights(..., tensor_by_tensor=True)`). The HTTP call per
tensor is left out, so the baseline is, if anything, faster than TRL's. (Rows named `tensor_by_tensor`, from
before 2026-11-22 08:30, are an earlier baseline: one message per piece, one bucket per decoder layer, no
per-tensor acknowledgement.)

Measured (benchmarks/results/weight_sync.csv, the shared 2-core CPU, gloo over loopback, trainer TP1 -> one
receiver): 0.47 GB/s at 8 MiB and 1.09 GB/s at 128 MiB with one bucket; there copies and pages, not message counts,
dominate: one message per piece was 2.1x slower at 8 MiB but 10% faster at 128 MiB. Into the real vLLM server
(`--vllm`), 512 MiB buckets beat one reload per layer 1.6-3.1x. (Moved here from engine/rollout/weight_transport.py.)

Row `round_trip`: before each model size, trainer rank 0 and engine rank 0 time a 40-byte message and its answer
on the same group (30 times): the per-message latency of this run, which a per-tensor protocol pays per tensor.

Processes: 2 trainer ranks (TP1 runs as TP1 x DP2, where the dp_rank-1 rank sends nothing, then TP2) + `engine_tp`
receivers, started here. Absolute numbers on CPU are loopback-TCP numbers on a shared machine; compare variants of
one run.

`--vllm`: the same bucketed syncs (verified, the default since the digests: rows before 2026-11-24 are unverified
syncs), plus one bucket per decoder layer (`vllm_per_layer`), (trainer TP1) into the real
vLLM engine of `python -m engine.rollout.server`
(engine TP 1, one server per model size, started here on a saved random checkpoint): the trainer's `sync_server`
call, i.e. the HTTP requests, the transfer and vLLM's in-place `reload_weights` of every bucket. No
tensor-by-tensor row there: vLLM's layer-wise reload on CPU cannot take a decoder layer in several calls (see
engine/rollout/colocated_sync.py `_stage_buckets`), so per-tensor loading is not a correct baseline to time.
What the exact verification costs (`_time_verification`, 512 MiB buckets, interleaved): `vllm_512MiB_verified`
against `vllm_512MiB_unverified` (the difference: both sides' digests, the engine's answer and the comparison), and
`vllm_512MiB_trainer_digest` (the trainer's digests and the comparison alone).

    python -m benchmarks.bench_weight_sync                      # CPU, ~2-4 minutes
    python -m benchmarks.bench_weight_sync --engine-tp 2 --iters 3
    python -m benchmarks.bench_weight_sync --vllm               # CPU, ~3 vLLM start-ups
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from benchmarks.harness import RESULTS_DIR, Timing, append_rows, capture_env, make_row, percentiles, time_fn

SIZES = (128, 256, 512)
BUCKETS_MB = (1, 8, 64, 512)
LAYOUTS = (1, 2)  # trainer TP; PP 1
NUM_LAYERS = 8
JOIN_TIMEOUT_S = 600.0
PING_WARMUP, PING_ITERS, PING_TAG = 5, 30, 7 << 23  # the round-trip row: trainer rank 0 <-> engine rank 0
TIMEOUT_S = 300.0
CPU_NOTE = ("2-core CPU VM shared with other jobs (CPU steal seen); gloo over loopback TCP; ->engine_tp modes: "
            "receivers assemble HF tensors, no vLLM; ->vllm_tp1: sync_server into engine/rollout/server.py's vLLM, "
            "HTTP calls and reload_weights included")


def hf_config(hidden: int):
    from transformers import Qwen2Config

    heads = hidden // 32
    return Qwen2Config(hidden_size=hidden, num_hidden_layers=NUM_LAYERS, num_attention_heads=heads,
                       num_key_value_heads=heads // 2, intermediate_size=3 * hidden, vocab_size=16 * hidden,
                       max_position_embeddings=256, tie_word_embeddings=False, dtype="float32")


def variants() -> list[tuple[str, float, bool]]:
    """(name, bucket_mb, tensor_by_tensor) in the order both sides run them."""
    return [(f"bucketed_{b}MiB", float(b), False) for b in BUCKETS_MB] + [("tensor_by_tensor_acked", 0.0, True)]


def schedule(args) -> list[tuple[int, bool]]:
    """(variant index, timed) in the order both sides run the syncs of one model: `warmup` untimed rounds, then
    `iters` timed rounds, each round every variant once. Interleaved, so a slow spell of a shared machine falls on
    every variant alike instead of on whichever variant was running."""
    rounds = [False] * args.warmup + [True] * args.iters
    return [(v, timed) for timed in rounds for v in range(len(variants()))]


def build_plan(hidden: int, trainer_tp: int, engine_tp: int):
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import padded_vocab_size
    from engine.rollout.sync_plan import TrainerLayout, build_sync_plan

    config = hf_config(hidden)
    dims = ModelDims.from_hf(config, padded_vocab_size(config.vocab_size, 128, trainer_tp))
    return build_sync_plan(dims, TrainerLayout(trainer_tp, 1), engine_tp, ffn_hidden_size=config.intermediate_size)


def _trainer(rank: int, master_port: int, store_ports: list[int], args, results) -> None:
    """Trainer rank of a 2-process world: every layout, size and variant in order; rank 0 reports timings."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(master_port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.model import build_policy, init_weights_by_name
    from engine.policy.parallel import destroy_parallel, init_parallel
    from engine.rollout.weight_transport import WeightTransferGroup, send_weights

    out = {}
    try:
        for tp, port in zip(LAYOUTS, store_ports):
            if mpu.model_parallel_is_initialized():
                mpu.destroy_model_parallel()
            ps = init_parallel(ParallelConfig(tp_size=tp), seed=0)
            group = None
            if ps.dp_rank == 0:
                group = WeightTransferGroup.create("127.0.0.1", port, ps.tp_rank, tp + args.engine_tp,
                                                   timeout_s=TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S,
                                                   host_store=False)
            for hidden in args.sizes:
                plan = build_plan(hidden, tp, args.engine_tp)
                if rank == 0:  # the per-message latency this run has (what per-tensor protocols pay per tensor)
                    out[(tp, hidden, "round_trip")] = (time_fn(lambda: _ping(group, tp), warmup=PING_WARMUP,
                                                               n_iters=PING_ITERS), {})
                chunks = build_policy(hf_config(hidden), ModelConfig(dtype="float32"), ps)
                init_weights_by_name(chunks, ps, seed=0)
                samples, stats = {}, {}
                for v, timed in schedule(args):
                    name, bucket_mb, tensor_by_tensor = variants()[v]
                    start = time.perf_counter()
                    stats[name] = send_weights(chunks, ps, plan.dims, group, plan, bucket_mb,
                                               tensor_by_tensor=tensor_by_tensor)
                    if timed:
                        samples.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
                dist.barrier()  # the idle dp_rank-1 rank must not build the next model meanwhile
                if rank == 0:
                    for name, ms in samples.items():
                        p20, p50, p80 = percentiles(ms)
                        out[(tp, hidden, name)] = (Timing(p20, p50, p80, len(ms), tuple(ms)), stats[name])
                        print(f"trainer tp{tp} hidden {hidden} {name}: p50 {p50:.1f} ms", flush=True)
                del chunks
            if group is not None:
                group.close()
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException as error:  # noqa: BLE001 - reported to the main process
        results.put((rank, "error", repr(error)))
        raise
    finally:
        destroy_parallel()


def _receiver(engine_rank: int, store_ports: list[int], args, results) -> None:
    """One engine worker: receive and assemble every sync of every layout, size and variant, dropping the tensors."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from engine.rollout.weight_transport import WeightTransferGroup, receive_weights

    try:
        for tp, port in zip(LAYOUTS, store_ports):
            group = WeightTransferGroup.create("127.0.0.1", port, tp + engine_rank, tp + args.engine_tp,
                                               timeout_s=TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S, host_store=False)
            for hidden in args.sizes:
                plan = build_plan(hidden, tp, args.engine_tp)
                if engine_rank == 0:
                    for _ in range(PING_WARMUP + PING_ITERS):
                        _pong(group)
                for v, _ in schedule(args):
                    _, bucket_mb, tensor_by_tensor = variants()[v]
                    for bucket in receive_weights(group, plan, bucket_mb, engine_rank,
                                                  tensor_by_tensor=tensor_by_tensor):
                        del bucket
            group.close()
        results.put((-1 - engine_rank, "ok", b""))
    except BaseException as error:  # noqa: BLE001 - reported to the main process
        results.put((-1 - engine_rank, "error", repr(error)))
        raise


def _ping(group, first_engine_rank: int) -> None:
    """Trainer rank 0: one header-sized message to engine rank 0 and its answer (a round trip on the group)."""
    message = torch.zeros(5, dtype=torch.int64)
    group.send(message, first_engine_rank, PING_TAG).wait()
    group.recv(message, first_engine_rank, PING_TAG).wait()


def _pong(group) -> None:
    message = torch.zeros(5, dtype=torch.int64)
    group.recv(message, 0, PING_TAG).wait()
    group.send(message, 0, PING_TAG).wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args) -> dict:
    """Start the trainer world and the receivers; returns rank 0's {(tp, hidden, variant): (Timing, stats)}."""
    import torch.distributed as dist

    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=JOIN_TIMEOUT_S)) for _ in LAYOUTS]
    ports = [store.port for store in stores]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    master_port = _free_port()
    procs = [ctx.Process(target=_trainer, args=(r, master_port, ports, args, results)) for r in range(2)]
    procs += [ctx.Process(target=_receiver, args=(e, ports, args, results)) for e in range(args.engine_tp)]
    for proc in procs:
        proc.start()
    outcome = {}
    try:
        for _ in procs:
            who, status, payload = results.get(timeout=3600)
            if status != "ok":
                raise RuntimeError(f"process {who} failed: {payload}")
            outcome[who] = payload
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
    return pickle.loads(outcome[0])


# ---------------------------------------------------------------------------------------------------------------
# --vllm: the same syncs into the real vLLM engine of engine/rollout/server.py (server mode, engine TP 1)
# ---------------------------------------------------------------------------------------------------------------


def save_model(hidden: int, out_dir) -> str:
    """A random-weight HF checkpoint of the benchmark shape, with the tiny tokenizer (its rows past 400 unused)."""
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import build_tiny_tokenizer

    model = AutoModelForCausalLM.from_config(hf_config(hidden), dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return str(out_dir)


def _vllm_trainer(url: str, model_dir: str, hidden: int, args, results) -> None:
    """World of one trainer rank: time `sync_server` (HTTP + transfer + vLLM reload) per bucket size."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from engine.config import GenerationConfig, ModelConfig, ParallelConfig
    from engine.policy.model import build_policy, init_weights_by_name
    from engine.policy.parallel import destroy_parallel, init_parallel
    from engine.rollout.client import RolloutClient, SharedRolloutClient, read_token
    from engine.rollout.server_sync import build_server_sync, sync_server

    try:
        ps = init_parallel(ParallelConfig(), seed=0)
        plan = build_plan(hidden, 1, 1)
        chunks = build_policy(hf_config(hidden), ModelConfig(dtype="float32"), ps)
        init_weights_by_name(chunks, ps, seed=0)
        engine = SharedRolloutClient(RolloutClient(url, read_token()), 0, GenerationConfig())
        out = {}
        for bucket_mb in (0,) + BUCKETS_MB:  # 0: one reload per decoder layer, the finest vLLM's CPU reload takes
            link = build_server_sync(ps, plan.dims, 1, ffn_hidden_size=plan.ffn_hidden_size, dtype="float32",
                                     group_port=_free_port(), timeout_s=TIMEOUT_S, bucket_mb=bucket_mb)
            timing = time_fn(lambda: sync_server(chunks, ps, plan.dims, engine, link), warmup=args.warmup,
                             n_iters=args.iters)
            out[(1, hidden, f"vllm_bucketed_{bucket_mb}MiB" if bucket_mb else "vllm_per_layer")] = (timing, {})
            print(f"vllm: hidden {hidden} bucket {bucket_mb} MiB: p50 {timing.p50_ms:.1f} ms", flush=True)
        out |= _time_verification(chunks, ps, plan, engine, hidden, args)
        engine.close()
        results.put((0, "ok", pickle.dumps(out)))
    except BaseException as error:  # noqa: BLE001 - reported to the main process
        results.put((0, "error", repr(error)))
        raise
    finally:
        destroy_parallel()


def _time_verification(chunks, ps, plan, engine, hidden: int, args) -> dict:
    """512 MiB buckets, interleaved: the sync verified (digests on both sides and the comparison: the default), the
    same sync unverified, and the trainer's share of the verified one (its digests and the comparison, from the
    sync's `weight_sync/digest_s`; the engine's digests are inside the verified sync's time)."""
    from engine.rollout.server_sync import build_server_sync, sync_server

    link = build_server_sync(ps, plan.dims, 1, ffn_hidden_size=plan.ffn_hidden_size, dtype="float32",
                             group_port=_free_port(), timeout_s=TIMEOUT_S, bucket_mb=512)
    verified, unverified, digest = [], [], []
    for i in range(args.warmup + args.iters):
        for verify, times in ((True, verified), (False, unverified)):
            start = time.perf_counter()
            stats = sync_server(chunks, ps, plan.dims, engine, link, verify=verify)
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
                if verify:
                    digest.append(stats["weight_sync/digest_s"] * 1e3)
    out = {}
    for name, samples in (("vllm_512MiB_verified", verified), ("vllm_512MiB_unverified", unverified),
                          ("vllm_512MiB_trainer_digest", digest)):
        p20, p50, p80 = percentiles(samples)
        out[(1, hidden, name)] = (Timing(p20, p50, p80, len(samples), tuple(samples)), {})
        print(f"vllm: hidden {hidden} {name}: p50 {p50:.1f} ms", flush=True)
    return out


def run_vllm(args) -> dict:
    """For each size: start a rollout server on a saved checkpoint, run `_vllm_trainer` against it, stop it."""
    import secrets
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from engine.rollout.client import RolloutClient

    measured = {}
    os.environ["GRPO_ENGINE_TOKEN"] = secrets.token_hex(32)
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        for hidden in args.sizes:
            model_dir = save_model(hidden, Path(tmp) / f"h{hidden}")
            port = _free_port()
            log = open(Path(tmp) / f"server-{hidden}.log", "w")
            server = subprocess.Popen(
                [sys.executable, "-m", "engine.rollout.server", "configs/tiny_cpu.yaml", f"model.name_or_path={model_dir}",
                 "rollout.vllm_mode=server", "rollout.vllm_gpu_memory_utilization=0.1",
                 "rollout.vllm_max_model_length=128", f"train.output_dir={tmp}", "--host", "127.0.0.1",
                 f"--port={port}"], env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}"
                RolloutClient(url, os.environ["GRPO_ENGINE_TOKEN"]).wait_until_healthy()
                ctx = mp.get_context("spawn")
                results = ctx.Queue()
                proc = ctx.Process(target=_vllm_trainer, args=(url, model_dir, hidden, args, results))
                proc.start()
                _, status, payload = results.get(timeout=3600)
                proc.join(timeout=60)
                if status != "ok":
                    raise RuntimeError(f"vLLM sync at hidden {hidden} failed: {payload}")
                measured |= pickle.loads(payload)
            finally:
                server.terminate()
                server.wait(timeout=60)
                log.close()
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="weight sync into engine receivers -> benchmarks/results/weight_sync.csv")
    parser.add_argument("--engine-tp", type=int, default=1)
    parser.add_argument("--vllm", action="store_true", help="sync into the real vLLM server instead (trainer TP1)")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES),
                        help="hidden sizes, comma-separated")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--csv", default=str(RESULTS_DIR / "weight_sync.csv"))
    args = parser.parse_args(argv)

    measured = run_vllm(args) if args.vllm else run(args)
    env = capture_env("cpu")
    engine = "vllm_tp1" if args.vllm else f"engine_tp{args.engine_tp}"
    rows = []
    for (tp, hidden, name), (timing, stats) in sorted(measured.items()):
        plan = build_plan(hidden, tp, 1 if args.vllm else args.engine_tp)
        model_bytes = sum(torch.Size(t.shape).numel() for t in plan.tensors) * plan.torch_dtype.itemsize
        moved = sum(t.numel for t in plan.transfers()) * plan.torch_dtype.itemsize  # every sender, every engine rank
        # NOTE: only what is fixed along a line goes in config (it is part of the key and of the plot's lines);
        # hidden = 128 / 256 / 512 follows from x (see the module docstring).
        config = {"layers": NUM_LAYERS, "dtype": plan.dtype, "backend": "gloo", "note": CPU_NOTE}
        key = dict(bench="weight_sync", variant=name, mode=f"trainer_tp{tp}->{engine}",
                   x_name="model_mib", x_value=round(model_bytes / 2**20, 2), config=config)
        rows.append(make_row(env, **key, metric="time", unit="ms", p20=timing.p20_ms, p50=timing.p50_ms,
                             p80=timing.p80_ms, n_iters=timing.n_iters))
        if name == "round_trip":
            print(f"trainer tp{tp} -> {engine}, {model_bytes / 2**20:7.1f} MiB, one round trip of a 40-byte message: "
                  f"p50 {timing.p50_ms:.3f} ms (p20 {timing.p20_ms:.3f}, p80 {timing.p80_ms:.3f})")
            continue
        if name.endswith("_digest"):
            continue  # a share of the verified sync's time, not a transfer
        rows.append(make_row(env, **key, metric="throughput", unit="GB/s", p20=moved / timing.p80_ms / 1e6,
                             p50=moved / timing.p50_ms / 1e6, p80=moved / timing.p20_ms / 1e6,
                             n_iters=timing.n_iters))
        print(f"trainer tp{tp} -> {engine}, {model_bytes / 2**20:7.1f} MiB, {name:>18}: "
              f"p50 {timing.p50_ms:8.1f} ms, {moved / timing.p50_ms / 1e6:6.2f} GB/s, {moved / 1e6:.1f} MB moved"
              + (f", rank 0: {stats['weight_sync/messages']} messages, {stats['weight_sync/buckets']} buckets"
                 if stats else ""))
    path = append_rows(args.csv, rows, overwrite=args.overwrite)
    from benchmarks.plot import redraw

    for png in redraw(path):
        print(png)


if __name__ == "__main__":
    main()
