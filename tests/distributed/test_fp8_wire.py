"""Server-mode FP8 wire on gloo (engine/rollout/fp8_wire.py): trainer senders -> receiver processes over a
WeightTransferGroup, no Megatron, no vLLM (this CPU cannot run vLLM's FP8 layers).

Each sender process holds its trainer rank's Megatron shards, read by hf_convert's own reader from full bf16 HF
tensors (a tiny dense Qwen2-like model at trainer TP 2, a tiny Qwen3-MoE-like model at trainer TP 2 / expert TP 2),
and runs `send_fp8_weights`; each receiver process (engine rank 0, 1) runs `receive_fp8_weights` and keeps its box of
every tensor, as vLLM's FP8 layers hold them. Then, for engine TP 1 (an engine box spans both senders' pieces: they
pass between senders) and 2:
- every FP8 weight's payload and scales held equal the reference quantizer's of the rank's box, every other tensor
  the model's values;
- the digests of what each receiver holds equal the sum of the senders' digests (engine/rollout/sync_check.py
  `check_digests` finds nothing), and one corrupted scale is named, and only it.
"""

import io
import multiprocessing as mp
import queue

import pytest
import torch

from tests.unit.test_fp8_server_sync import FFN, _dense, _hf, _moe, _shards

TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 300.0
JOBS = [("dense", 2, 1, 1), ("dense", 2, 1, 2), ("moe", 2, 2, 1)]
"""(model, trainer TP, trainer expert TP, engine TP)."""
MODELS = {"dense": _dense, "moe": _moe}


def _plan(model, tp, etp, engine_tp):
    from engine.rollout.sync_plan import TrainerLayout, build_sync_plan

    dims = MODELS[model]()
    return dims, build_sync_plan(dims, TrainerLayout(tp, expert_tp_size=etp), engine_tp, ffn_hidden_size=FFN,
                                 dtype="bfloat16")


def _bytes(value) -> bytes:
    """A result as bytes (tensors in a queue would be shared memory that dies with the process)."""
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def _sender(sender, jobs, results):
    from engine.rollout.fp8_wire import send_fp8_weights
    from engine.rollout.weight_transport import WeightTransferGroup

    for port, job in jobs:
        dims, plan = _plan(*job)
        shards = _shards(_hf(dims), dims, job[1], job[2])
        params = {(t.piece.vp_chunk, t.piece.megatron): shards[(t.piece.pp_rank, t.piece.tp_rank, t.piece.vp_chunk,
                                                                 t.piece.megatron)]
                  for t in plan.transfers() if t.sender == sender}
        group = WeightTransferGroup.create("127.0.0.1", port, sender, plan.group_size, timeout_s=TIMEOUT_S,
                                           join_timeout_s=JOIN_TIMEOUT_S, host_store=False)
        try:
            stats, digests = send_fp8_weights(params, sender, group, plan, 0.25)
            results.put(_bytes((job, "sender", sender, stats, digests)))
        finally:
            group.close()


def _receiver(engine_rank, jobs, results):
    from engine.rollout.fp8_sync import fp8_engine_tensors
    from engine.rollout.fp8_wire import receive_fp8_weights
    from engine.rollout.sync_plan import box_slices
    from engine.rollout.weight_transport import WeightTransferGroup

    for port, job in jobs:
        _, plan = _plan(*job)
        if engine_rank >= plan.engine_tp:
            continue
        boxes = {name: ranks[engine_rank] for name, _, _, ranks in fp8_engine_tensors(plan)}
        group = WeightTransferGroup.create("127.0.0.1", port, plan.engine_group_rank(engine_rank), plan.group_size,
                                           timeout_s=TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S, host_store=False)
        held = {}
        try:
            for bucket in receive_fp8_weights(group, plan, 0.25, engine_rank):
                held |= {name: tensor[box_slices(boxes[name])].clone() for name, tensor in bucket}
            results.put(_bytes((job, "receiver", engine_rank, held, None)))
        finally:
            group.close()


@pytest.fixture(scope="module")
def wire():
    import torch.distributed as dist

    stores, jobs = [], []
    for job in JOBS:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        stores.append(store)
        jobs.append((store.port, job))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_sender, args=(s, jobs, results)) for s in range(2)]
    procs += [ctx.Process(target=_receiver, args=(r, jobs, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    expected = sum(2 + job[3] for job in JOBS)
    got = {}
    try:
        for _ in range(expected):
            job, role, rank, value, digests = torch.load(io.BytesIO(results.get(timeout=JOIN_TIMEOUT_S)))
            got[(job, role, rank)] = (value, digests)
    except queue.Empty:
        pytest.fail(f"{expected - len(got)} results missing; exit codes {[p.exitcode for p in procs]}")
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return got


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS, ids=[f"{m}_tp{a}_etp{b}_engine_tp{c}" for m, a, b, c in JOBS])
def test_receivers_hold_the_reference_fp8_and_the_digests_agree(wire, job):
    from engine.models.quantized import FP8_DTYPE
    from engine.rollout.fp8_sync import fp8_engine_tensors, quantize_shard
    from engine.rollout.sync_check import check_digests
    from engine.rollout.sync_plan import box_slices
    from engine.rollout.weight_digest import box_digest

    dims, plan = _plan(*job)
    hf = _hf(dims)
    tensors = fp8_engine_tensors(plan)
    senders = [wire[(job, "sender", s)][1] for s in range(plan.trainer.num_senders)]
    digests = sum(senders)
    assert any(d.any() for d in senders[1:]), "the second sender contributes"
    for rank in range(plan.engine_tp):
        held, _ = wire[(job, "receiver", rank)]
        assert set(held) == {name for name, *_ in tensors}
        for name, _, dtype, boxes in tensors:
            if dtype == FP8_DTYPE:
                payload, scales = quantize_shard(hf[name], boxes[rank])
                assert torch.equal(held[name].view(torch.int8), payload.view(torch.int8)), f"rank {rank}: {name}"
                assert torch.equal(held[name + "_scale_inv"], scales), f"rank {rank}: {name}'s scales"
            elif not name.endswith("_scale_inv"):
                assert torch.equal(held[name], hf[name][box_slices(boxes[rank])]), f"rank {rank}: {name}"
        expected = {name: int(digests[row, rank]) for row, (name, *_) in enumerate(tensors)}
        own = {name: [int(box_digest(tensor)), str(tensor.dtype)] for name, tensor in held.items()}
        assert check_digests(expected, own, "bfloat16", f"engine rank {rank}") == ""
        corrupted = "model.layers.1.self_attn.q_proj.weight_scale_inv"
        scales = held[corrupted].clone()
        scales.view(-1)[0] *= 2
        own[corrupted] = [int(box_digest(scales)), "torch.float32"]
        error = check_digests(expected, own, "bfloat16", f"engine rank {rank}")
        assert f"holds 1 of {len(tensors)} tensors" in error and f"{corrupted} (digest" in error, error
