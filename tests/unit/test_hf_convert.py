"""The HF <-> Megatron map, pure: hand-computed layouts, exact round trips, and agreement with the way Megatron's
own partition attributes split a global tensor (engine.policy.model.take_tp_shard)."""

import pytest
import torch

from engine.policy.hf_convert import DictSource, read_megatron_shard, to_hf, to_megatron_global
from engine.policy.hf_map import ModelDims, family_map, find_entry
from engine.policy.model import take_tp_shard

# kind -> (partition_dim, partition_stride) of the Megatron parameter that holds it
PARTITION = {"vocab": (0, 1), "column": (0, 1), "qkv": (0, 1), "gate_up": (0, 2), "row": (1, 1)}


def _dims(heads=8, groups=4, head_dim=4, hidden=16, vocab=37, padded=64, tie=False, bias=True, layers=2):
    return ModelDims(layers, hidden, heads, groups, head_dim, vocab, padded, tie, bias)


def _hf_tensors(dims: ModelDims, ffn: int = 24, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    h, q, kv = dims.hidden_size, dims.num_heads * dims.head_dim, dims.num_groups * dims.head_dim
    shapes = {"model.embed_tokens.weight": (dims.vocab_size, h), "model.norm.weight": (h,)}
    if not dims.tie_word_embeddings:
        shapes["lm_head.weight"] = (dims.vocab_size, h)
    for i in range(dims.num_layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        shapes |= {
            f"model.layers.{i}.input_layernorm.weight": (h,), f"model.layers.{i}.post_attention_layernorm.weight": (h,),
            f"{a}.q_proj.weight": (q, h), f"{a}.k_proj.weight": (kv, h), f"{a}.v_proj.weight": (kv, h),
            f"{a}.o_proj.weight": (h, q), f"{m}.gate_proj.weight": (ffn, h), f"{m}.up_proj.weight": (ffn, h),
            f"{m}.down_proj.weight": (h, ffn),
        }
        if dims.qkv_bias:
            shapes |= {f"{a}.q_proj.bias": (q,), f"{a}.k_proj.bias": (kv,), f"{a}.v_proj.bias": (kv,)}
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


def _megatron_names(dims: ModelDims) -> list[str]:
    names = []
    for entry in family_map(dims):
        layers = range(dims.num_layers) if "{i}" in entry.megatron else [None]
        names += [entry.megatron.format(i=i) for i in layers]
    return names


def test_qkv_interleaves_query_groups_by_hand():
    # 4 heads, 2 KV groups, head_dim 1, hidden 1: per group [q, q, k, v].
    dims = ModelDims(1, 1, 4, 2, 1, 3, 4, False, True)
    hf = {"model.layers.0.self_attn.q_proj.bias": torch.tensor([0.0, 1, 2, 3]),
          "model.layers.0.self_attn.k_proj.bias": torch.tensor([10.0, 11]),
          "model.layers.0.self_attn.v_proj.bias": torch.tensor([20.0, 21])}
    entry, layer = find_entry(family_map(dims), "decoder.layers.0.self_attention.linear_qkv.bias")
    assert to_megatron_global(entry, layer, dims, hf).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    shard1 = read_megatron_shard(entry, layer, dims, DictSource(hf), tp_rank=1, tp_size=2)
    assert shard1.tolist() == [2, 3, 11, 21], "TP rank 1 holds the whole second query group"


def test_vocab_is_padded_with_zero_rows_and_unpadded_on_export():
    dims = _dims()
    hf = _hf_tensors(dims)
    entry, layer = find_entry(family_map(dims), "embedding.word_embeddings.weight")
    full = to_megatron_global(entry, layer, dims, hf)
    assert full.shape == (64, 16) and full[37:].abs().sum() == 0
    last = read_megatron_shard(entry, layer, dims, DictSource(hf), tp_rank=3, tp_size=4)  # rows 48..63: all padding
    assert last.shape == (16, 16) and last.abs().sum() == 0
    assert torch.equal(to_hf(entry, layer, dims, full)["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_hf_megatron_hf_is_exact(tie, dtype):
    dims = _dims(tie=tie)
    hf = _hf_tensors(dims, dtype=dtype)
    back = {}
    for name in _megatron_names(dims):
        entry, layer = find_entry(family_map(dims), name)
        if tie and name == "output_layer.weight":
            continue  # the tied head is the embedding: exported once, from it
        back |= to_hf(entry, layer, dims, to_megatron_global(entry, layer, dims, hf))
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_shard_reads_agree_with_megatron_partitioning(tp_size):
    # Reading rank r's slices directly must equal slicing the global tensor the way Megatron's attributes say.
    dims = _dims()
    hf = _hf_tensors(dims)
    for name in _megatron_names(dims):
        entry, layer = find_entry(family_map(dims), name)
        full = to_megatron_global(entry, layer, dims, hf)
        param = torch.nn.Parameter(torch.empty(0))
        if entry.kind != "replicated":
            param.tensor_model_parallel, (param.partition_dim, param.partition_stride) = True, PARTITION[entry.kind]
        for rank in range(tp_size):
            shard = read_megatron_shard(entry, layer, dims, DictSource(hf), rank, tp_size)
            assert torch.equal(shard, take_tp_shard(full, param, rank, tp_size)), f"{name} rank {rank}/{tp_size}"


def test_transformer_engine_names_map_to_the_same_entries():
    entries = family_map(_dims())
    te, layer = find_entry(entries, "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
    assert (te.hf, layer) == (("model.layers.{i}.input_layernorm.weight",), 3)
    with pytest.raises(KeyError, match="no Hugging Face mapping"):
        find_entry(entries, "decoder.layers.0.mlp.router.weight")


def test_qkv_bias_only_when_the_family_has_it():
    names = {e.megatron for e in family_map(_dims(bias=False))}
    assert "decoder.layers.{i}.self_attention.linear_qkv.bias" not in names
