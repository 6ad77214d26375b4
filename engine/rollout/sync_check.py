"""Weight-sync verification, exact: after every sync the engine's digests of what each of its ranks holds (engine/
rollout/weight_digest.py, computed inside the engine's workers after loading) against the trainer's digests of what it
meant each rank to hold (`check_digests`, `raise_on_every_rank`); and the log-prob probe, a logged health metric only
(`logprob_health`: the engine's log-probs of every token of the probe sequences against the trainer's, temperature 1,
`weight_sync/logprob_diff_p50/_p90/_max`). `WeightSyncError` is what every part of the weight sync raises.

Why digests gate and log-probs do not: two correct bf16 forwards (Megatron's, vLLM's) differ per token by a heavy-tailed
rounding amount (on the tiny Qwen2: p90 0.09-0.21 nats, single tokens up to 3.9), which grows with the weights'
scale, so a log-prob tolerance both lets a stale layer hide in the noise and fails correct transfers (bf16 at
lr 0.1); a digest is exact whatever the dtype and scale, and names the tensor and the engine rank.

Layouts: knows neither: the trainer's digests come keyed by plan tensor and engine rank (engine/rollout/
colocated_sync.py, weight_transport.py compute them from what they send), the engine's by HF name.

Must not: move weights, import vLLM (the engine's `prompt_logprobs` is called on the object passed in).

Test: tests/unit/test_weight_digest.py (`check_digests` messages), tests/integration/test_weight_sync.py (colocated:
a synced engine passes, a stale one, one stale decoder layer and one flipped bit in one tensor are caught and named,
float32 and bf16), tests/integration/test_rollout_server.py (server, several servers), tests/unit/test_sync_probe.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from engine.config import KernelsConfig
from engine.policy.microbatch import MicroBatch
from engine.policy.parallel import ParallelState
from engine.policy.step import LogprobSettings, forward_logprobs


class WeightSyncError(RuntimeError):
    """After a sync the engine does not hold what the trainer sent (a digest differs), or a transfer failed."""


def full_sequence_probe(probe: MicroBatch) -> tuple[MicroBatch, list[list[int]]]:
    """The probe micro-batch as a batch of every token after the first of each sequence (prompt and completion):
    the same model inputs (layout, packing, shape), `prompt_lengths` 1, `completion_ids` / `completion_mask` (k, L - 1)
    the next tokens. A token whose whole prefix (itself included) another row repeats is masked: a group's shared
    prompt is compared once, identical completions once. Also returns the sequences (token ids) for the engine.
    """
    tokens = probe.tokens  # (k, L) right-padded
    lengths = probe.lengths
    if lengths is None:
        lengths = probe.prompt_lengths + probe.completion_mask.sum(1).long()
    sequences = [row[: int(n)].tolist() for row, n in zip(tokens, lengths)]
    num_rows, width = tokens.shape
    mask = torch.arange(width - 1)[None, :] < (lengths[:, None].cpu() - 1)  # (k, L - 1): token j + 1 is real
    order = sorted(range(num_rows), key=lambda i: sequences[i])
    for prev, cur in zip(order, order[1:]):  # the longest shared prefix of a sorted row is with its predecessor
        a, b = sequences[prev], sequences[cur]
        n = min(len(a), len(b))
        differ = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
        shared = int(differ[0]) if differ.numel() else n  # tokens 0 .. shared - 1 are the same
        mask[cur, : max(shared - 1, 0)] = False
    device = probe.completion_mask.device
    full = replace(probe, prompt_lengths=torch.ones(num_rows, dtype=torch.long, device=device),
                   completion_ids=(tokens[:, 1:] * mask.to(tokens.device)).to(device),  # masked ids: 0, never read
                   completion_mask=mask.to(device=device, dtype=torch.float32))
    return full, sequences


def logprob_differences(chunks, ps: ParallelState, engine, probe: MicroBatch, vocab_size: int
                        ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per engine: the |trainer - engine| log-prob differences of the tokens of `full_sequence_probe(probe)`
    (float64, NaN -> inf), the mask of the compared ones, and the trainer's log-probs, (k, L - 1) each; token j + 1
    of row i at [i, j]. Every rank queries its engine(s); [] on ranks without the last pipeline stage.
    """
    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0, kernels=KernelsConfig())  # the defaults
    full, sequences = full_sequence_probe(probe)
    trainer = forward_logprobs(chunks, ps, [full], settings)
    # NOTE: every rank queries its engine, also where there is nothing to compare: the ranks of one vLLM TP group
    # must make the same engine calls, and a group may span pipeline stages.
    each = getattr(engine, "prompt_logprobs_each", None)  # several rollout servers: each one checks every probe
    per_engine = each(sequences, 1.0) if each is not None else [engine.prompt_logprobs(sequences, temperature=1.0)]
    if not trainer:
        return []
    logprobs = trainer[0][0].cpu()  # (k, L - 1)
    mask = full.completion_mask.bool().cpu()  # (k, L - 1)
    out = []
    for engine_logprobs in per_engine:
        diffs = torch.zeros(mask.shape, dtype=torch.float64)  # (k, L - 1); 0 where not compared
        for i, engine_lp in enumerate(engine_logprobs):
            ref = torch.tensor(engine_lp, dtype=torch.float64)  # (L_i - 1,)
            diffs[i, : ref.numel()] = (logprobs[i, : ref.numel()].double() - ref).abs().nan_to_num(nan=float("inf"))
        out.append((diffs, mask, logprobs))
    return out


def logprob_health(chunks, ps: ParallelState, engine, probe: MicroBatch, vocab_size: int) -> dict[str, float]:
    """The probe's per-token |trainer - engine| log-prob differences over every engine (`logprob_differences`), as
    health metrics: {"weight_sync/logprob_diff_p50", "_p90", "_max"}, each the largest over ranks (collective).

    Not a check: in float32 a synced engine agrees to ~1e-5, in bf16 two correct forwards differ by a heavy-tailed
    rounding amount (see the module docstring); the digests (`check_digests`) decide whether a sync is right.
    """
    stats = torch.zeros(3, dtype=torch.float64)  # p50, p90, max of the worst engine on this rank
    for diffs, mask, _ in logprob_differences(chunks, ps, engine, probe, vocab_size):
        flat = diffs[mask]  # (N,)
        if flat.numel():
            here = torch.stack([torch.quantile(flat, 0.5), torch.quantile(flat, 0.9), flat.max()])
            stats = torch.maximum(stats, here)
    stats = stats.to(ps.device)  # NCCL reduces device tensors only
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    p50, p90, largest = (float(v) for v in stats.cpu())
    return {"weight_sync/logprob_diff_p50": p50, "weight_sync/logprob_diff_p90": p90,
            "weight_sync/logprob_diff_max": largest}


MAX_NAMED = 8
"""Differing tensors named in one message (the count says how many more)."""


def check_digests(expected: dict[str, int], held: dict[str, list], sent_dtype: str, where: str) -> str:
    """Compare the trainer's digests of one engine rank's boxes with that rank's own; "" when they all agree.

    Args:
        expected: {HF name: digest} of what the trainer sent this engine rank (weight_digest.py `box_digest` of the
            rank's box of each tensor, summed over the senders' pieces).
        held: the engine rank's `grpo_weight_digests()["digests"]`: {HF name: [digest, dtype it holds]}.
        sent_dtype: the dtype the trainer sent ("bfloat16", ...), for the message.
        where: the engine rank, and server, for the message ("engine rank 1 of http://host:8000").
    Returns:
        a message naming every differing or missing tensor (the first `MAX_NAMED`) and what differs, or "".
    """
    wrong = []
    for name, digest in expected.items():
        if name not in held:
            wrong.append(f"{name} (the engine holds no such tensor)")
        elif int(held[name][0]) != int(digest):
            dtype = held[name][1].replace("torch.", "")
            cast = f", held as {dtype}" if dtype != sent_dtype.replace("torch.", "") else ""
            wrong.append(f"{name} (digest {int(held[name][0]) & (2**64 - 1):#018x}, sent {int(digest) & (2**64 - 1):#018x}"
                         f"{cast})")
    if not wrong:
        return ""
    more = f" and {len(wrong) - MAX_NAMED} more" if len(wrong) > MAX_NAMED else ""
    return (f"after the weight sync {where} holds {len(wrong)} of {len(expected)} tensors other than the trainer sent "
            f"(bit-exact digests, engine/rollout/weight_digest.py): {'; '.join(wrong[:MAX_NAMED])}{more}")


def raise_on_every_rank(ps: ParallelState, error: str) -> None:
    """Collective: every rank learns whether any rank found an error ("" = none) and raises the same
    WeightSyncError, with each failing rank's message."""
    failed = torch.tensor([1.0 if error else 0.0], device=ps.device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not float(failed):
        return
    errors: list = [None] * ps.world_size
    dist.all_gather_object(errors, error)
    distinct = list(dict.fromkeys(e for e in errors if e))
    raise WeightSyncError("; ".join(f"trainer rank {errors.index(e)}: {e}" for e in distinct)
                          + ": the engine is not running the trainer's weights")
