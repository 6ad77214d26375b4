"""Qwen3 / Qwen3-MoE, pure: the HF <-> Megatron map (q/k norms, expert tables incl. Mixtral's) round-trips every
tensor bit for bit and reads each expert's shard by its global index; the weight-sync plan carries Qwen3's per-head
norms as replicated (head_dim,) tensors (the MoE plan at every EP layout is brute-forced in
tests/unit/test_sync_plan.py); the planner's Qwen3 shapes reproduce the published parameter counts and its
expert-parallel terms follow their formulas."""

import pytest
import torch

from engine.policy.hf_convert import DictSource, read_megatron_shard, to_hf, to_megatron_global
from engine.policy.hf_map import MOE_MAPS, ModelDims, expert_index, family_map, find_entry
from engine.rollout.sync_plan import TrainerLayout, build_sync_plan

H, HEADS, KV, D, VOCAB, FFN, MOE_FFN, EXPERTS = 16, 4, 2, 8, 37, 24, 6, 4


def _dims(moe_map: str = "", tie: bool = False) -> ModelDims:
    return ModelDims(2, H, HEADS, KV, D, VOCAB, 64, tie, False, qk_norm=True, num_experts=EXPERTS if moe_map else 0,
                     moe_ffn_hidden_size=MOE_FFN if moe_map else 0, moe_map=moe_map)


def _megatron_names(dims: ModelDims) -> list[str]:
    names = []
    for entry in family_map(dims):
        for layer in (range(dims.num_layers) if "{i}" in entry.megatron else [None]):
            for expert in (range(dims.num_experts) if entry.is_expert else [None]):
                names.append(entry.megatron.format(i=layer, e=expert))
    return names


def _hf_tensors(dims: ModelDims) -> dict[str, torch.Tensor]:
    """Random tensors under every HF name the map reads, shaped by the map's own kinds."""
    gen, out = torch.Generator().manual_seed(0), {}
    q, kv = HEADS * D, KV * D
    for name in _megatron_names(dims):
        entry, layer = find_entry(family_map(dims), name)
        hf = entry.hf
        for part, pattern in enumerate(hf):
            hf_name = pattern.format(i=layer, e=expert_index(name))
            if "norm" in hf_name and "self_attn" in hf_name:
                shape = (D,)
            elif entry.kind == "replicated":
                shape = (EXPERTS, H) if "gate.weight" in hf_name else (H,)
            elif entry.kind == "qkv":
                shape = ((q, kv, kv)[part], H)
            elif entry.kind == "vocab":
                shape = (VOCAB, H)
            elif entry.kind == "gate_up":
                shape = (MOE_FFN if entry.is_expert else FFN, H)
            else:  # row
                shape = (H, q if "o_proj" in hf_name else (MOE_FFN if entry.is_expert else FFN))
            out[hf_name] = torch.randn(shape, generator=gen)
    return out


@pytest.mark.parametrize("moe_map", ["", "qwen3_moe", "mixtral"], ids=["qwen3", "qwen3_moe", "mixtral"])
def test_qwen3_and_moe_tables_round_trip_exactly(moe_map):
    dims = _dims(moe_map)
    hf = _hf_tensors(dims)
    back = {}
    for name in _megatron_names(dims):
        entry, layer = find_entry(family_map(dims), name)
        expert = expert_index(name)
        back |= to_hf(entry, layer, dims, to_megatron_global(entry, layer, dims, hf, expert), expert)
    assert sorted(back) == sorted(hf)
    assert all(torch.equal(back[n], t) for n, t in hf.items())
    if moe_map:
        assert {n for n in hf if ".experts.3." in n} and not any(".mlp.gate_proj." in n for n in hf)


def test_expert_shard_is_read_by_global_index_and_expert_tp_rank():
    dims = _dims("qwen3_moe")
    hf = _hf_tensors(dims)
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    entry, layer = find_entry(family_map(dims), name)
    assert entry.is_expert and entry.kind == "gate_up" and expert_index(name) == 3
    shard = read_megatron_shard(entry, layer, dims, DictSource(hf), tp_rank=1, tp_size=2, expert=3)
    gate, up = hf["model.layers.1.mlp.experts.3.gate_proj.weight"], hf["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(shard, torch.cat([gate[3:], up[3:]]))  # [gate_r; up_r] of expert 3, expert-TP rank 1 of 2


def test_sync_plan_sends_qwen3_qk_norms_whole_from_tp_rank_0():
    dims = _dims()
    plan = build_sync_plan(dims, TrainerLayout(tp_size=2, pp_size=2), engine_tp=2, ffn_hidden_size=FFN)
    norms = {t.name: t for t in plan.tensors if "_norm." in t.name and "self_attn" in t.name}
    assert sorted(norms) == [f"model.layers.{i}.self_attn.{x}_norm.weight" for i in (0, 1) for x in ("k", "q")]
    for tensor in norms.values():
        assert tensor.shape == (D,) and tensor.engine_boxes == (((0, D),), ((0, D),))
        assert [(p.tp_rank, p.hf_box) for p in tensor.pieces] == [(0, ((0, D),))]
    o_proj = next(t for t in plan.tensors if t.name == "model.layers.0.self_attn.o_proj.weight")
    assert o_proj.shape == (H, HEADS * D) and HEADS * D != H  # head_dim is not hidden / heads


def test_moe_maps_have_router_and_three_expert_tensors():
    """Each family: a router and an expert's fc1 / fc2; GLM-4.5 adds the router's bias and the shared expert (a
    dense gate_up / row pair); GPT-OSS: a router bias, expert biases, every expert tensor stacked in HF's."""
    extra = {"glm4_moe": [("gate_up", False), ("replicated", False), ("row", False)]}
    extra["deepseek_v3"] = extra["glm4_moe"]  # DeepSeek-V3's MoE names are GLM-4.5's
    gpt_oss = [("replicated", False)] * 2 + [("stacked_gate_up", True)] * 2 + [("stacked_replicated", True),
                                                                              ("stacked_row", True)]
    for name, table in MOE_MAPS.items():
        kinds = sorted((e.kind, e.is_expert) for e in table)
        expected = gpt_oss if name == "gpt_oss" else [("gate_up", True), ("replicated", False), ("row", True)]
        assert kinds == sorted(expected + extra.get(name, [])), name


@pytest.mark.parametrize("name,published", [("qwen/qwen3-30b-a3b", 30_532_122_624), ("qwen/qwen3-8b", 8_190_735_360)])
def test_planner_qwen3_shapes_give_the_published_parameter_counts(name, published):
    from engine.planning.shapes import KNOWN_MODELS

    assert KNOWN_MODELS[name].total_params() == published


def test_planner_expert_terms_follow_their_formulas():
    from engine.config import load_config
    from engine.planning.memory import GIB
    from engine.planning.planner import build_plan
    from engine.planning.shapes import resolve_cluster_shape

    cfg = load_config("configs/qwen3-30b-a3b_tp2_ep8_split_2x1.yaml", [])
    plan = build_plan(cfg, resolve_cluster_shape(cfg))
    terms = {t.label: t.nbytes for t in plan.budget("training GPU").terms}
    experts = 48 * 128 * 3 * 2048 * 768 / 8  # layers x E x 3*h*f_moe / ep
    assert terms["expert weights"] == experts * 2
    assert terms["expert optimizer"] == experts * 12 / (2 * 8 / 8)  # / expert dp = tp*dp/ep
    assert terms["MoE all-to-all"] == 2 * 8704 * 4 * 8 * 2048 * 2 / 2  # 2 x s*b*k*h x 2 B / tp (SP)
    assert not plan.problems and all(b.total_bytes < 80 * GIB for b in plan.budgets)
    with pytest.raises(Exception, match="num_experts=128 is not divisible by parallel.ep_size=48"):
        cfg = load_config("configs/qwen3-30b-a3b_tp2_ep8_split_2x1.yaml", ["parallel.ep_size=48", "parallel.dp_size=24"])
        build_plan(cfg, resolve_cluster_shape(cfg))


QWEN3_CONFIGS = ["qwen3-8b_tp2_dp4_1node.yaml", "qwen3-30b-a3b_tp2_ep8_split_2x1.yaml",
                 "qwen3-235b-a22b_tp4_pp2_ep32_split_16x8.yaml"]


@pytest.mark.parametrize("name", QWEN3_CONFIGS)
def test_qwen3_configs_fit_under_80_gib_and_their_headers_quote_the_planner(name):
    from pathlib import Path

    from engine.config import load_config
    from engine.planning.memory import GIB
    from engine.planning.planner import build_plan
    from engine.planning.shapes import resolve_cluster_shape

    path = Path(__file__).resolve().parents[2] / "configs" / name
    cfg = load_config(path, [])
    plan = build_plan(cfg, resolve_cluster_shape(cfg))
    assert not plan.problems
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    for budget in plan.budgets:
        assert budget.total_bytes < 80 * GIB, budget.title
        assert f"{budget.total_bytes / GIB:.2f} GiB" in header, (budget.title, f"{budget.total_bytes / GIB:.2f}")


@pytest.mark.parametrize("name", QWEN3_CONFIGS[1:])
def test_moe_split_configs_have_a_server_sync_plan_and_their_headers_quote_its_group(name):
    """The shipped MoE split configs' server-mode sync is planned at their EP (the real shapes, one layer per stage
    to stay fast): each sender of a stage sends its own experts, and the header's group size is the plan's."""
    import re
    from pathlib import Path

    from engine.config import load_config
    from engine.planning.shapes import KNOWN_MODELS

    path = Path(__file__).resolve().parents[2] / "configs" / name
    cfg = load_config(path, [])
    shape, par = KNOWN_MODELS[cfg.model.name_or_path.lower()], cfg.parallel
    dims = ModelDims(par.pp_size, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.d, shape.vocab_size,
                     shape.vocab_size, shape.tie_word_embeddings, shape.qkv_bias, qk_norm=True,
                     num_experts=shape.num_experts, moe_ffn_hidden_size=shape.moe_intermediate_size,
                     moe_map="qwen3_moe")
    layout = TrainerLayout(par.tp_size, par.pp_size, ep_size=par.ep_size, expert_tp_size=par.expert_tp_size)
    plan = build_sync_plan(dims, layout, cfg.rollout.vllm_tensor_parallel_size, dtype=cfg.model.dtype,
                           ffn_hidden_size=shape.intermediate_size)
    experts_by_sender = {}
    for t in plan.transfers():
        if ".local_experts." in t.piece.megatron:
            experts_by_sender.setdefault(t.sender, set()).add(expert_index(t.piece.megatron))
    assert len(experts_by_sender) == par.pp_size * par.ep_size  # expert TP 1: one sender per (stage, ep rank)
    assert {len(e) for e in experts_by_sender.values()} == {shape.num_experts // par.ep_size}
    header = "".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    match = re.search(r"(\d+) senders \+ (\d+) vLLM workers", header)
    assert match and (int(match[1]), int(match[2])) == (plan.trainer.num_senders, plan.engine_tp), header
