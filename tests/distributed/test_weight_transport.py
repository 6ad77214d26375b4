"""Server-mode weight transport on gloo: real Megatron policy shards -> receiver processes over a WeightTransferGroup.

One world of 2 trainer ranks goes through the layouts (TP1, PP1, DP2: the dp_rank 1 rank must send nothing),
(TP2, PP1), (TP1, PP2, tied embeddings), and the tiny Qwen3-MoE at EP2 x DP2 (rank 1 is no dense sender but holds
experts 2-3: it sends those) and expert TP 2 x DP2 (each rank holds half of every expert; rank 1 sends that half),
and the tiny GPT-OSS at EP2 into engine TP 2 (stacked, interleaved experts cut from fc1 / fc2 views, one tensor per
expert; the experts' down_proj_bias to engine rank 0 only), and the tiny DeepSeek-V3 at EP2 into engine TP 2 (MLA:
q_a / kv_a whole on both engine ranks, q_b / kv_b split by head) in turn: it loads the checkpoint into the Megatron policy and
sends it with `send_weights` to engine TP 1 and to engine TP 2 (one WeightTransferGroup each, bucketed or
tensor-by-tensor). Two receiver processes started here (engine ranks 0 and 1; no Megatron, no vLLM) run
`receive_weights` for the same groups in the same order. Every receiver's filled box of every HF tensor (the box
vLLM's loader of its rank reads; tests/unit/test_sync_plan.py proves those boxes are vLLM's) equals the checkpoint's,
every tensor arrives exactly once, and no bucket splits a decoder layer. Last, engine rank 1 dies after its first
bucket: `send_weights` raises WeightSyncError naming the peer well within the group timeout instead of hanging.
(One world and two long-lived receivers, so Megatron and torch start only four times on a 2-core machine.)
"""

import os
import pickle
import queue
import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.launcher import run_distributed

BUCKET_MB = 0.25  # the tiny model's decoder layer is ~0.7 MiB: one layer per bucket, 7 buckets
TIMEOUT_S = 30.0
JOIN_TIMEOUT_S = 300.0  # receivers join long before the trainer ranks have imported Megatron

# (family, tp, pp, ep, expert_tp, [(engine_tp, tensor_by_tensor), ...]) in the order the trainer world runs them.
LAYOUTS = [
    ("qwen2", 1, 1, 1, 1, [(1, False), (2, True)]),
    ("qwen2", 2, 1, 1, 1, [(1, False), (2, False)]),
    ("qwen2_tied", 1, 2, 1, 1, [(2, False), (1, True)]),
    ("qwen3_moe", 1, 1, 2, 1, [(2, False)]),
    ("qwen3_moe", 1, 1, 1, 2, [(1, False)]),
    ("gpt_oss", 1, 1, 2, 1, [(2, False)]),
    ("deepseek_v3", 1, 1, 2, 1, [(2, False)]),
]
DEAD_PEER = ("qwen2_tied", 1, 2, 1, 1, 2)  # (family, tp, pp, ep, expert_tp, engine_tp): engine rank 1 dies after one
# bucket


def _host_store():
    """A TCPStore hosted by the test process, listening before any member starts (no connection back-off)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    return store.port, store


def _receiver(engine_rank, jobs, results):
    """One engine worker without vLLM: for each job (a group) in order, receive every bucket and keep the box this
    rank's loader reads."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from engine.rollout.sync_plan import build_sync_plan_from_spec
    from engine.rollout.weight_transport import WeightTransferGroup, receive_weights

    for job, (port, spec, tensor_by_tensor, die_after) in enumerate(jobs):
        try:
            plan = build_sync_plan_from_spec(spec)
            if engine_rank >= plan.engine_tp:
                continue
            group = WeightTransferGroup.create("127.0.0.1", port, plan.engine_group_rank(engine_rank),
                                               plan.group_size, timeout_s=TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S,
                                               host_store=False)
            boxes, buckets = {}, []
            index = {t.name: t for t in plan.tensors}
            for k, bucket in enumerate(receive_weights(group, plan, BUCKET_MB, engine_rank,
                                                       tensor_by_tensor=tensor_by_tensor)):
                if die_after is not None and k >= die_after:
                    results.close()
                    results.join_thread()  # flush the earlier jobs' results: os._exit skips the queue's feeder
                    os._exit(3)  # a crashed engine worker: no clean-up, the kernel closes its sockets
                buckets.append([name for name, _ in bucket])
                for name, tensor in bucket:
                    assert tuple(tensor.shape) == index[name].loader_shape and tensor.dtype == plan.torch_dtype
                    tensor = tensor.view(index[name].shape)  # GPT-OSS's gate / up: boxes of its (H, I, 2) view
                    box = tuple(slice(a, b) for a, b in index[name].engine_boxes[engine_rank])
                    boxes[name] = tensor[box].clone()
            group.close()
            results.put((job, engine_rank, "ok", pickle.dumps((boxes, buckets))))  # by value, not shared memory
        except BaseException as error:  # noqa: BLE001 - reported to the test
            results.put((job, engine_rank, "error", repr(error)))


def _trainer(model_dirs, sends):
    """Trainer rank: for each layout in turn, load the checkpoint into the Megatron policy and send it once per
    (port, engine_tp, tensor_by_tensor); returns (status, stats or error message, seconds) per send."""
    from megatron.core import parallel_state as mpu
    from transformers import AutoConfig

    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.parallel import init_parallel
    from engine.rollout.sync_check import WeightSyncError
    from engine.rollout.sync_plan import TrainerLayout, build_sync_plan
    from engine.rollout.weight_transport import WeightTransferGroup, send_weights, sender_index

    out = []
    for family, tp, pp, ep, etp, layout_sends in sends:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()  # the next layout in the same world
        ps = init_parallel(ParallelConfig(tp_size=tp, pp_size=pp, ep_size=ep, expert_tp_size=etp), seed=0)
        hf_config = AutoConfig.from_pretrained(model_dirs[family])
        model_cfg = ModelConfig(dtype="float32")
        dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, tp).padded_vocab_size)
        chunks = build_policy(hf_config, model_cfg, ps)
        load_hf_checkpoint(chunks, ps, model_dirs[family], dims)
        for port, engine_tp, tensor_by_tensor in layout_sends:
            plan = build_sync_plan(dims, TrainerLayout(tp, pp, ep_size=ep, expert_tp_size=etp), engine_tp,
                                   ffn_hidden_size=hf_config.intermediate_size)
            group, sender = None, sender_index(plan, ps)
            if sender is not None:
                group = WeightTransferGroup.create("127.0.0.1", port, sender, plan.group_size, timeout_s=TIMEOUT_S,
                                                   join_timeout_s=JOIN_TIMEOUT_S, host_store=False)
            start = time.monotonic()
            try:
                stats = send_weights(chunks, ps, dims, group, plan, BUCKET_MB, tensor_by_tensor=tensor_by_tensor)
                out.append(("ok", stats, time.monotonic() - start))
            except WeightSyncError as error:
                out.append(("WeightSyncError", str(error), time.monotonic() - start))
            finally:
                if group is not None:
                    group.close()
    return out


def _plan(model_dir, tp, pp, ep, etp, engine_tp):
    from transformers import AutoConfig

    from engine.config import ModelConfig
    from engine.policy.hf_map import ModelDims
    from engine.policy.model import policy_shape
    from engine.rollout.sync_plan import TrainerLayout, build_sync_plan

    hf_config = AutoConfig.from_pretrained(model_dir)
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, ModelConfig(dtype="float32"), tp).padded_vocab_size)
    return build_sync_plan(dims, TrainerLayout(tp, pp, ep_size=ep, expert_tp_size=etp), engine_tp,
                           ffn_hidden_size=hf_config.intermediate_size)


def _checkpoint(model_dir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors; GPT-OSS's stacked experts as one tensor per expert, under vLLM's per-expert names
    (`...mlp.experts.<e>.gate_up_proj`)."""
    from engine.policy.hf_checkpoint import SafetensorsSource

    src = SafetensorsSource(model_dir)
    out = {}
    for name in src.names():
        tensor = src.read(name, (slice(None),))
        if ".mlp.experts.gate_up_proj" in name or ".mlp.experts.down_proj" in name:  # GPT-OSS: (E, ...) stacked
            prefix, _, leaf = name.rpartition(".")
            out |= {f"{prefix}.{e}.{leaf}": tensor[e] for e in range(tensor.shape[0])}
        else:
            out[name] = tensor
    return out


@pytest.fixture(scope="module")
def transfers(tmp_path_factory):
    """Run every send: returns (per job: plan, tensor_by_tensor, {engine rank: payload}), trainer outcomes."""
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    model_dirs = {"qwen2": str(build_tiny_model(root / "qwen2", "qwen2", seed=1)),
                  "qwen2_tied": str(build_tiny_model(root / "qwen2_tied", "qwen2", seed=2, tie_word_embeddings=True)),
                  "qwen3_moe": str(build_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=3)),
                  "gpt_oss": str(build_tiny_model(root / "gpt_oss", "gpt_oss", seed=4)),
                  "deepseek_v3": str(build_tiny_model(root / "deepseek_v3", "deepseek_v3", seed=5))}
    jobs, sends, stores, plans = [], [], [], []
    for family, tp, pp, ep, etp, modes in LAYOUTS + [(*DEAD_PEER[:5], [(DEAD_PEER[5], False)])]:
        layout_sends = []
        for engine_tp, tensor_by_tensor in modes:
            port, store = _host_store()
            stores.append(store)
            plan = _plan(model_dirs[family], tp, pp, ep, etp, engine_tp)
            plans.append((family, plan, tensor_by_tensor))
            jobs.append((port, plan.spec(), tensor_by_tensor))
            layout_sends.append((port, engine_tp, tensor_by_tensor))
        sends.append((family, tp, pp, ep, etp, layout_sends))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    dead = len(jobs) - 1
    procs = [ctx.Process(target=_receiver, args=(rank, [(*job, 1 if (rank == 1 and j == dead) else None)
                                                        for j, job in enumerate(jobs)], results))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        outcomes = run_distributed(_trainer, 2, model_dirs, sends, timeout_s=600)
        received: dict[int, dict] = {j: {} for j in range(len(jobs))}
        expected = sum(plan.engine_tp for _, plan, _ in plans[:dead]) + 1  # + engine rank 0 of the dead-peer job
        for _ in range(expected):
            try:
                job, rank, status, payload = results.get(timeout=2 * TIMEOUT_S)
            except queue.Empty:
                got = {j: {r: v[0] for r, v in per.items()} for j, per in received.items()}
                raise AssertionError(f"a receiver did not report; got {got}; trainer outcomes {outcomes}") from None
            received[job][rank] = (status, pickle.loads(payload) if status == "ok" else payload)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    return [(family, plan, tbt, received[j]) for j, (family, plan, tbt) in enumerate(plans)], outcomes, model_dirs


@pytest.mark.parametrize("job", range(10), ids=[f"{f}-tp{tp}_pp{pp}_ep{ep}_etp{etp}-vllm_tp{e}"
                                                f"{'-tensor_by_tensor' if t else ''}"
                                                for f, tp, pp, ep, etp, modes in LAYOUTS for e, t in modes])
def test_receivers_get_exactly_the_checkpoint_slices_their_vllm_rank_loads(transfers, job):
    jobs, outcomes, model_dirs = transfers
    family, plan, tensor_by_tensor, received = jobs[job]
    checkpoint = _checkpoint(model_dirs[family])
    assert sorted(received) == list(range(plan.engine_tp))
    for rank, (status, payload) in received.items():
        assert status == "ok", f"engine rank {rank}: {payload}"
        boxes, buckets = payload
        assert sorted(boxes) == sorted(checkpoint), "every HF tensor arrives, and nothing else"
        names = [name for bucket in buckets for name in bucket]
        assert len(names) == len(set(names)), "every tensor arrives once"
        if tensor_by_tensor:  # the per-tensor baseline: one HF tensor per transfer, in plan order
            assert names == [t.name for t in plan.tensors] and all(len(bucket) == 1 for bucket in buckets)
        else:
            layers = [{n.split(".")[2] for n in bucket if n.startswith("model.layers.")} for bucket in buckets]
            for a, b in zip(layers, layers[1:]):
                assert not (a & b), f"a decoder layer is split over two buckets: {a & b}"
            assert len(buckets) > 3, "small buckets: the schedule has several"
        for tensor in plan.tensors:
            box = tuple(slice(a, b) for a, b in tensor.engine_boxes[rank])
            held = checkpoint[tensor.name].view(tensor.shape)[box]
            assert torch.equal(boxes[tensor.name], held), f"engine rank {rank}: {tensor.name}"
    # Senders: dp_rank 1 sends nothing (unless it holds experts); together they move exactly what the engines read.
    per_rank = [out[job] for out in outcomes]
    assert all(status == "ok" for status, _, _ in per_rank), per_rank
    stats = [s for _, s, _ in per_rank if s]
    assert len(stats) == plan.trainer.num_senders
    read = sum(t.numel for t in plan.transfers()) * 4 / 2**30
    assert sum(s["weight_sync/gib"] for s in stats) == pytest.approx(read)
    if tensor_by_tensor:  # per tensor: a header and a message per box to each engine rank, an ack from each
        assert all(s["weight_sync/buckets"] == len(plan.tensors) for s in stats)
        assert all(s["weight_sync/messages"] > (1 + plan.engine_tp) * len(plan.tensors) for s in stats)


def test_a_receiver_that_dies_mid_transfer_makes_send_weights_raise_not_hang(transfers):
    _, outcomes, _ = transfers
    for rank_outcomes in outcomes:
        status, message, seconds = rank_outcomes[-1]
        assert status == "WeightSyncError", rank_outcomes[-1]
        assert "engine worker" in message and "bucket" in message, message
        assert seconds < TIMEOUT_S + 10, f"send_weights took {seconds:.1f} s to fail (timeout {TIMEOUT_S} s)"
