"""Weight-sync verification: after a sync, the engine's log-probs of every token of the probe sequences (prompt and
completion, each distinct prefix once: `full_sequence_probe`) against the trainer's (temperature 1, both fp32
accumulation), every sync by default (`verify_sync`), and `WeightSyncError`, which every part of the weight sync raises.

Layouts: knows neither: it compares log-probs, so it catches a wrong box, a stale layer or a failed load whichever
path (colocated_sync.py, server_sync.py) moved the weights.

Must not: move weights, import vLLM (the engine's `prompt_logprobs` is called on the object passed in).

Test: tests/integration/test_weight_sync.py (a synced engine passes, a stale one or one stale decoder layer is caught,
float32 and bf16), tests/integration/test_rollout_server.py (several servers), tests/unit/test_sync_probe.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.policy.parallel import ParallelState
from engine.policy.step import LogprobSettings, forward_logprobs


class WeightSyncError(RuntimeError):
    """The engine's weights do not reproduce the trainer's log-probs after a sync, or a transfer failed."""


def full_sequence_probe(probe: dict) -> tuple[dict, list[list[int]]]:
    """The probe micro-batch as a batch of every token after the first of each sequence (prompt and completion):
    the same model inputs (layout, packing, shape), `prompt_lengths` 1, `completion_ids` / `completion_mask` (k, L - 1)
    the next tokens. A token whose whole prefix (itself included) another row repeats is masked: a group's shared
    prompt is compared once, identical completions once. Also returns the sequences (token ids) for the engine.
    """
    tokens = probe["tokens"]  # (k, L) right-padded
    lengths = probe.get("lengths")
    if lengths is None:
        lengths = probe["prompt_lengths"] + probe["completion_mask"].sum(1).long()
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
    device = probe["completion_mask"].device
    full = {k: v for k, v in probe.items() if k not in ("prompt_lengths", "completion_ids", "completion_mask")}
    full |= {"prompt_lengths": torch.ones(num_rows, dtype=torch.long, device=device),
             "completion_ids": (tokens[:, 1:] * mask.to(tokens.device)).to(device),  # masked ids: 0, never read
             "completion_mask": mask.to(device=device, dtype=torch.float32)}
    return full, sequences


def logprob_differences(chunks, ps: ParallelState, engine, probe: dict, vocab_size: int
                        ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per engine: the |trainer - engine| log-prob differences of the tokens of `full_sequence_probe(probe)`
    (float64, NaN -> inf), the mask of the compared ones, and the trainer's log-probs, (k, L - 1) each; token j + 1
    of row i at [i, j]. Every rank queries its engine(s); [] on ranks without the last pipeline stage.
    """
    settings = LogprobSettings(vocab_size=vocab_size, temperature=1.0, implementation="auto")
    full, sequences = full_sequence_probe(probe)
    trainer = forward_logprobs(chunks, ps, [full], settings)
    # NOTE: every rank queries its engine, also where there is nothing to compare: the ranks of one vLLM TP group
    # must make the same engine calls, and a group may span pipeline stages.
    each = getattr(engine, "prompt_logprobs_each", None)  # several rollout servers: each one checks every probe
    per_engine = each(sequences, 1.0) if each is not None else [engine.prompt_logprobs(sequences, temperature=1.0)]
    if not trainer:
        return []
    logprobs = trainer[0][0].cpu()  # (k, L - 1)
    mask = full["completion_mask"].bool().cpu()  # (k, L - 1)
    out = []
    for engine_logprobs in per_engine:
        diffs = torch.zeros(mask.shape, dtype=torch.float64)  # (k, L - 1); 0 where not compared
        for i, engine_lp in enumerate(engine_logprobs):
            ref = torch.tensor(engine_lp, dtype=torch.float64)  # (L_i - 1,)
            diffs[i, : ref.numel()] = (logprobs[i, : ref.numel()].double() - ref).abs().nan_to_num(nan=float("inf"))
        out.append((diffs, mask, logprobs))
    return out


def verify_sync(chunks, ps: ParallelState, engine, probe: dict, vocab_size: int, tolerance: float,
                quantile: float = 1.0) -> float:
    """Compare the engine's and the trainer's log-probs of every token of the probe sequences; raise if they differ.

    Every token after the first of each sequence, prompt and completion (`full_sequence_probe`): the engine computes
    the prompt's log-probs anyway, and a probe of completions alone can be a few dozen tokens, mostly near-certain
    ones that no stale weight moves. The check is on a quantile of the per-token |trainer - engine| differences of
    each engine, on each rank: the max (quantile 1.0) in float32, where the two agree to ~1e-5; the 90th percentile
    in bf16, where two correct forwards differ by a heavy-tailed rounding amount (one token in a hundred can be off
    by nats) while a stale layer or a layout error moves most tokens (engine/config.py `weight_sync_quantile` has
    the measured numbers).

    Args:
        chunks: the policy chunks (wrapped or not).
        probe: a micro-batch from engine/policy/batch.py or packing.py (`tokens`, `prompt_lengths`, `completion_mask`,
            optionally `lengths` and the packed layout).
        tolerance: largest allowed `quantile` of the |trainer - engine| log-prob differences.
        quantile: 1.0 checks the largest difference.
    Returns:
        the largest difference (the same on every rank).
    Raises:
        WeightSyncError naming the statistic, the probe row and token position of the largest difference.
    """
    differences = logprob_differences(chunks, ps, engine, probe, vocab_size)
    # (checked quantile, max diff, row, position, trainer logprob, engine index) of the worst engine
    worst = torch.zeros(6, dtype=torch.float64)
    for e, (diffs, mask, logprobs) in enumerate(differences):
        flat = diffs[mask]  # (N,)
        if flat.numel() == 0:
            continue
        checked = float(flat.max()) if quantile >= 1.0 else float(torch.quantile(flat, quantile))
        if checked > worst[0] or (checked == worst[0] and float(flat.max()) > worst[1]):
            i, j = divmod(int(diffs.masked_fill(~mask, -1.0).argmax()), mask.shape[1])
            worst = torch.tensor([checked, float(flat.max()), i, j + 1, float(logprobs[i, j]), e], dtype=torch.float64)
    largest = worst[:2].to(ps.device)  # NCCL reduces device tensors only
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    checked_all, max_all = (float(v) for v in largest.cpu())
    if checked_all > tolerance:
        which = f" ({engine.describe(int(worst[5]))})" if len(differences) > 1 else ""
        statistic = "largest difference" if quantile >= 1.0 else f"{quantile:g}-quantile of the per-token differences"
        where = (f"; on this rank the largest is {float(worst[1]):.3g} at probe row {int(worst[2])}, token "
                 f"{int(worst[3])} (trainer {float(worst[4]):.5f})") if float(worst[0]) > tolerance else ""
        raise WeightSyncError(
            f"after the weight sync the engine's{which} log-probs differ from the trainer's: {statistic} "
            f"{checked_all:.3g} over {int(differences[0][1].sum()) if differences else 0} tokens > tolerance "
            f"{tolerance:g} (largest {max_all:.3g}){where}: the engine is not running the trainer's weights"
        )
    return max_all
