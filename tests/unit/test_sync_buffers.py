"""The weight-sync transport's buffers (engine/rollout/sync_buffers.py) and the planner's use of them
(engine/planning/sync_memory.py): equal to what the transport's own per-bucket layouts allocate on many tiny
layouts, to a tiny plan by hand, and to the GPT-OSS-120B header's hand numbers; a config whose vLLM share leaves too
little room for the receive buffers is refused."""

import pytest

from engine.policy.hf_map import ModelDims
from engine.policy.model import padded_vocab_size
from engine.rollout import weight_transport
from engine.rollout.sync_buffers import sync_buffers
from engine.rollout.sync_plan import TrainerLayout, build_sync_plan

GIB = 2**30


def _dims(moe_map: str, tp: int, tied: bool = False) -> ModelDims:
    """4 layers, hidden 16, 4 heads of 8 over 2 KV heads; MoE: 8 experts of width 8 (GLM: a dense first layer and a
    shared expert)."""
    experts = 8 if moe_map else 0
    return ModelDims(num_layers=4, hidden_size=16, num_heads=4, num_groups=2, head_dim=8, vocab_size=100,
                     padded_vocab=padded_vocab_size(100, 8, tp), tie_word_embeddings=tied,
                     qkv_bias=moe_map in ("glm4_moe", "gpt_oss", ""), qk_norm=moe_map in ("qwen3_moe", "glm4_moe"),
                     num_experts=experts, moe_ffn_hidden_size=8 if experts else 0, moe_map=moe_map,
                     dense_layers=1 if moe_map == "glm4_moe" else 0, shared_expert_ffn=8 if moe_map == "glm4_moe" else 0)


def _transport_numels(plan, buckets):
    """What weight_transport.py's own layouts put in one slot: per engine rank max(payload + assembly), per sender
    the largest bucket it packs (restated from `_receive_layouts` / `_pair_transfers`)."""
    receive = [max(p + a for _, _, p, a in weight_transport._receive_layouts(plan, buckets, r))
               for r in range(plan.engine_tp)]
    per_bucket = weight_transport._pair_transfers(plan, buckets)
    send = [max(sum(t.numel for (s, _), ts in pairs.items() if s == sender for t in ts) for pairs in per_bucket)
            for sender in range(plan.trainer.num_senders)]
    return receive, send


LAYOUTS = [("", TrainerLayout(1), 2), ("", TrainerLayout(2, 2), 4), ("", TrainerLayout(2, 2, 2), 1),
           ("qwen3_moe", TrainerLayout(2, 1, ep_size=2), 2), ("qwen3_moe", TrainerLayout(1, 2, ep_size=4), 4),
           ("glm4_moe", TrainerLayout(2, 1, ep_size=2, expert_tp_size=2), 2), ("mixtral", TrainerLayout(1), 1),
           ("gpt_oss", TrainerLayout(2, 1, ep_size=4), 4), ("gpt_oss", TrainerLayout(1, 2, ep_size=2), 2)]


@pytest.mark.parametrize("moe_map,layout,engine_tp", LAYOUTS, ids=[f"{m or 'dense'}-{i}" for i, (m, _, _) in
                                                                   enumerate(LAYOUTS)])
def test_buffers_equal_what_the_transports_layouts_allocate(moe_map, layout, engine_tp):
    """Every engine rank's receive slot and every sender's send slot, at bucket sizes from one unit per bucket to one
    bucket in all, equal the transport's per-bucket layouts (the slots `receive_weights` / `send_weights` fill)."""
    plan = build_sync_plan(_dims(moe_map, layout.tp_size), layout, engine_tp, ffn_hidden_size=32, dtype="bfloat16")
    for bucket_mb in (0.0, 0.004, 0.02, 1000.0):
        buffers = sync_buffers(plan, bucket_mb)
        receive, send = _transport_numels(plan, plan.buckets(bucket_mb))
        assert list(buffers.receive_numel) == receive, bucket_mb
        assert list(buffers.send_numel) == send, bucket_mb
        assert buffers.receive_bytes == 2 * max(receive) * 2 and buffers.send_bytes() == 2 * max(send) * 2


def test_tiny_plan_buffers_by_hand():
    """2 layers, hidden 8, 2 heads of 4, MLP 8, vocabulary 16, untied, float32; trainer TP 1 (one sender) into engine
    TP 2. One unit per bucket: a layer's 7 split tensors (q, k, v, o, gate, up, down: 8 x 8 = 64 each) arrive as
    halves (payload 7 x 32) and are assembled at full shape (7 x 64), its 2 norms (8 each) arrive whole:
    224 + 448 + 16 = 688 elements per receive slot, on both ranks (the embedding's 128: whole on rank 0, assembled
    on rank 1, whose padded vocabulary rows [32, 64) hold none of the 16). The sender packs a layer's 7 x 64 + 2 x 2
    x 8 = 480. One bucket for everything: 128 + 2 x 688 + 8 + 128 = 1640 received, 128 + 2 x 480 + 2 x 8 + 128 =
    1232 sent."""
    dims = ModelDims(num_layers=2, hidden_size=8, num_heads=2, num_groups=2, head_dim=4, vocab_size=16,
                     padded_vocab=16, tie_word_embeddings=False, qkv_bias=False)
    plan = build_sync_plan(dims, TrainerLayout(1), 2, ffn_hidden_size=8, dtype="float32")
    per_unit = sync_buffers(plan, 0.0)
    assert per_unit.num_buckets == 5  # embedding, 2 layers, final norm, LM head
    assert per_unit.receive_numel == (688, 688) and per_unit.send_numel == (480,)
    assert per_unit.receive_bytes == 2 * 688 * 4 and per_unit.send_bytes() == 2 * 480 * 4
    whole = sync_buffers(plan, 1000.0)
    assert whole.num_buckets == 1 and whole.receive_numel == (1640, 1640) and whole.send_numel == (1232,)
    assert whole.bucket_numel == 2 * 16 * 8 + 2 * (7 * 64 + 16) + 8


def _plan(name: str, overrides=()):
    from pathlib import Path

    from engine.config import load_config
    from engine.planning.planner import build_plan
    from engine.planning.shapes import resolve_cluster_shape

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / name, list(overrides))
    return build_plan(cfg, resolve_cluster_shape(cfg))


GPT_OSS = "gpt-oss-120b_tp2_ep64_split_8x1.yaml"


def test_gpt_oss_120b_buffers_are_the_headers_hand_numbers_and_a_share_of_0_9_is_refused():
    """The header computed them from the plan by hand: 2 x 0.54 GiB of send slots per training GPU, 13.47 GiB of
    receive slots per inference GPU (38 buckets); at vLLM's usual 0.9 only 7.91 GiB stay outside the share: refused,
    the hint names the share that fits."""
    plan = _plan(GPT_OSS)
    training = {t.label: t for t in plan.budget("training GPU").terms}
    assert f"{training['weight-sync send'].nbytes / GIB / 2:.2f}" == "0.54"
    outside = plan.budget("inference GPU outside")
    receive = {t.label: t.nbytes for t in outside.terms}["receive slots"]
    assert f"{receive / GIB:.2f}" == "13.47" and "38 buckets" in outside.terms[0].arithmetic
    assert outside.fits and not plan.problems
    refused = _plan(GPT_OSS, ["rollout.vllm_gpu_memory_utilization=0.9"])
    assert len(refused.problems) == 1, refused.problems
    assert refused.problems[0].startswith("inference GPU outside vLLM's share (weight-sync receive buffers): total "
                                          "14.47 GiB > (1 - 0.9) x 79.1 GiB = 7.91 GiB; lower "
                                          "rollout.vllm_gpu_memory_utilization to at most"), refused.problems[0]
    assert "= 0.81" in refused.problems[0] and "rollout.weight_sync_bucket_mb" in refused.problems[0]


def test_colocated_term_is_the_largest_bucket_of_full_hf_tensors_by_hand():
    """Colocated (no transport): the sync gathers a bucket of full HF tensors at a time. Qwen2.5-0.5B (tied, bf16,
    buckets of >= 512 MiB = 268,435,456 elements): the embedding 151936 x 896 = 136,134,656, then layers of q, o 896 x
    896, k, v 128 x 896, their biases 1152, gate / up / down 3 x 4864 x 896 and 2 norms of 896 = 14,912,384 each,
    until the bucket reaches 512 MiB: 9 layers, 270,346,112 elements (the second bucket, the other 15 layers, is
    smaller); no send or receive slots."""
    plan = _plan("qwen2.5-0.5b_tp1_1gpu.yaml")
    layer = 2 * 896 * 896 + 2 * 128 * 896 + 1152 + 3 * 4864 * 896 + 2 * 896
    assert layer == 14_912_384
    terms = {t.label: t for t in plan.budget("training GPU").terms}
    assert terms["weight-sync bucket"].nbytes == (151936 * 896 + 9 * layer) * 2
    assert "weight-sync send" not in terms and not any(b.title.startswith("inference GPU outside") for b in plan.budgets)
