"""Weight-sync verification: after a sync, the engine's log-probs of probe sequences against the trainer's
(temperature 1, both fp32 accumulation), every sync by default (`verify_sync`), and `WeightSyncError`, which every
part of the weight sync raises.

Layouts: knows neither: it compares log-probs, so it catches a wrong box, a stale layer or a failed load whichever
path (colocated_sync.py, server_sync.py) moved the weights.

Must not: move weights, import vLLM (the engine's `prompt_logprobs` is called on the object passed in).

Test: tests/integration/test_weight_sync.py (a synced engine passes, a stale one or one stale decoder layer is caught,
float32 and bf16), tests/integration/test_rollout_server.py (several servers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.policy.parallel import ParallelState
from engine.policy.step import LogprobSettings, forward_logprobs


class WeightSyncError(RuntimeError):
    """The engine's weights do not reproduce the trainer's log-probs after a sync, or a transfer failed."""


def verify_sync(chunks, ps: ParallelState, engine, probe: dict, vocab_size: int, tolerance: float,
                quantile: float = 1.0) -> float:
    """Compare the engine's and the trainer's log-probs of the probe completions; raise if they differ.

    The check is on a quantile of the per-token |trainer - engine| differences of each engine, on each rank: the max
    (quantile 1.0) in float32, where the two agree to ~1e-5; the 90th percentile in bf16, where two correct forwards
    differ by a heavy-tailed rounding amount (one token in a hundred can be off by nats) while a stale layer or a
    layout error moves most tokens (engine/config.py `weight_sync_quantile` has the measured numbers).

    Args:
        chunks: the policy chunks (wrapped or not).
        probe: a micro-batch from engine/policy/batch.py (`tokens`, `prompt_lengths`, `completion_ids`, `completion_mask`, ...).
        tolerance: largest allowed `quantile` of the |trainer - engine| log-prob differences.
        quantile: 1.0 checks the largest difference.
    Returns:
        the largest difference (the same on every rank).
    Raises:
        WeightSyncError naming the statistic, the probe row and completion position of the largest difference.
    """
    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0, implementation="auto")
    trainer = forward_logprobs(chunks, ps, [probe], settings)
    sequences = [row[: int(p) + int(m.sum())].tolist() for row, p, m in
                 zip(probe["tokens"], probe["prompt_lengths"], probe["completion_mask"])]
    # NOTE: every rank queries its engine, also where there is nothing to compare: the ranks of one vLLM TP group
    # must make the same engine calls, and a group may span pipeline stages.
    each = getattr(engine, "prompt_logprobs_each", None)  # several rollout servers: each one checks every probe
    per_engine = each(sequences, 1.0) if each is not None else [engine.prompt_logprobs(sequences, temperature=1.0)]
    # (checked quantile, max diff, row, position, trainer logprob, engine index) of the worst engine
    worst = torch.zeros(6, dtype=torch.float64)
    if trainer:
        logprobs = trainer[0][0]  # (b, C)
        for e, engine_logprobs in enumerate(per_engine):
            diffs = []
            for i, engine_lp in enumerate(engine_logprobs):
                start = int(probe["prompt_lengths"][i]) - 1
                ref = torch.tensor(engine_lp[start:], dtype=torch.float64)  # (C_i,)
                diffs.append((logprobs[i, : ref.numel()].double() - ref).abs().nan_to_num(nan=float("inf")))  # NaN: bad
            flat = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)  # (N,)
            if flat.numel() == 0:
                continue
            checked = float(flat.max()) if quantile >= 1.0 else float(torch.quantile(flat, quantile))
            if checked > worst[0] or (checked == worst[0] and float(flat.max()) > worst[1]):
                i = max(range(len(diffs)), key=lambda r: float(diffs[r].max()) if diffs[r].numel() else -1.0)
                j = int(diffs[i].argmax())
                worst = torch.tensor([checked, float(flat.max()), i, j, float(logprobs[i, j]), e], dtype=torch.float64)
    largest = worst[:2].to(ps.device)  # NCCL reduces device tensors only
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    checked_all, max_all = (float(v) for v in largest.cpu())
    if checked_all > tolerance:
        which = f" ({engine.describe(int(worst[5]))})" if each is not None and len(per_engine) > 1 else ""
        statistic = "largest difference" if quantile >= 1.0 else f"{quantile:g}-quantile of the per-token differences"
        where = (f"; on this rank the largest is {float(worst[1]):.3g} at probe row {int(worst[2])}, completion token "
                 f"{int(worst[3])} (trainer {float(worst[4]):.5f})") if float(worst[0]) > tolerance else ""
        raise WeightSyncError(
            f"after the weight sync the engine's{which} log-probs differ from the trainer's: {statistic} "
            f"{checked_all:.3g} > tolerance {tolerance:g} (largest {max_all:.3g}){where}: the engine is not running "
            "the trainer's weights"
        )
    return max_all
