"""Server-mode FP8, the trainer's side (engine/rollout/fp8_server_sync.py), on CPU without vLLM's FP8 layers (this
CPU has no AMX; the setting stays refused in server mode, which tests/unit/test_fp8_sync.py checks).

For a tiny dense Qwen2 and a tiny Qwen3-MoE (experts split over expert-TP ranks), trainer TP 1 / 2 into engine
TP 1 / 2, with each trainer rank's Megatron shards read by hf_convert's own reader:
- every tensor each engine rank loads (engine/rollout/fp8_sync.py `fp8_engine_tensors`): an FP8 weight's payload and
  scales, assembled from the trainer's pieces and quantized by one sender, are bit-equal to the reference quantizer
  (engine/models/quantized.py) of the rank's box; the other tensors are the model's own values, as the plan sends;
- the digests the assemblers contribute equal the colocated sync's for the same weights (the ones the engine's
  FP8 layers are verified against);
- at trainer TP 2 into engine TP 1 an engine rank's box spans two senders' pieces (assemblies take pieces from
  another sender);
- a missing piece, and a layout whose engine boxes cut a block, are refused by name.
"""

import pytest
import torch

from engine.models.quantized import FP8_DTYPE
from engine.policy.hf_convert import DictSource, read_megatron_shard
from engine.policy.hf_map import ModelDims, family_map, layer_entries
from engine.rollout.fp8_server_sync import assemble_box, assembled_digests, fp8_assemblies, quantize_assembled
from engine.rollout.fp8_sync import expected_digests, fp8_engine_tensors, is_fp8_weight, quantize_bucket, quantize_shard
from engine.rollout.sync_plan import TrainerLayout, box_slices, build_sync_plan, local_view
from tests.helpers.sync_plan import apply_plan

VOCAB, FFN = 300, 512


def _dense(head_dim: int = 128) -> ModelDims:
    """Qwen2-like: 4 heads of 128 over 2 KV heads (q 512 rows, k / v 256), hidden 256, MLP 512, QKV bias."""
    return ModelDims(num_layers=2, hidden_size=256, num_heads=4, num_groups=2, head_dim=head_dim, vocab_size=VOCAB,
                     padded_vocab=320, tie_word_embeddings=False, qkv_bias=True)


def _moe() -> ModelDims:
    """Qwen3-MoE-like: q/k norms, 2 experts of width 256, the router unquantized."""
    return ModelDims(num_layers=2, hidden_size=256, num_heads=4, num_groups=2, head_dim=128, vocab_size=VOCAB,
                     padded_vocab=320, tie_word_embeddings=False, qkv_bias=False, qk_norm=True, num_experts=2,
                     moe_ffn_hidden_size=256, moe_map="qwen3_moe")


MODELS = {"dense": _dense, "dense_hd64": lambda: _dense(head_dim=64), "moe": _moe}

LAYOUTS = [(model, tp, tp if model == "moe" else 1, etp) for model in ("dense", "moe") for tp in (1, 2) for etp in (1, 2)]
LAYOUTS += [("dense_hd64", 2, 1, 1), ("moe", 2, 4, 1), ("moe", 2, 4, 2)]
"""(model, trainer TP, trainer expert TP, engine TP). The last three: trainer pieces that cut 128-row blocks (k / v
of 64 rows per trainer rank; experts of 64 rows per expert-TP rank), whole only once assembled."""


def _hf(dims: ModelDims, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full HF tensors, bf16, with a spread of magnitudes between row blocks (so scales differ)."""
    gen = torch.Generator().manual_seed(seed)
    plan = build_sync_plan(dims, TrainerLayout(1), 1, ffn_hidden_size=FFN, dtype="bfloat16")
    out = {}
    for tensor in plan.tensors:
        values = torch.randn(tensor.shape, generator=gen)
        if len(tensor.shape) == 2:
            values = values * torch.rand(tensor.shape[0], 1, generator=gen).mul(8).exp2()
        out[tensor.name] = values.to(torch.bfloat16)
    return out


def _shards(hf: dict, dims: ModelDims, tp: int, etp: int = 1) -> dict:
    """(pp_rank, tp_rank, vp_chunk, Megatron name) -> that trainer rank's shard (experts: over expert TP `etp`)."""
    shards = {}
    for entry in family_map(dims):
        for layer in range(dims.num_layers) if "{i}" in entry.megatron else [None]:
            if layer is not None and entry not in layer_entries(dims, layer):
                continue
            for expert in range(dims.num_experts) if entry.is_expert else [None]:
                name = entry.megatron.format(i=layer, e=expert)
                size = etp if entry.is_expert else tp
                for rank in range(size):
                    shards[(0, rank, 0, name)] = read_megatron_shard(entry, layer, dims, DictSource(hf), rank, size,
                                                                     expert)
    return shards


def _parts(assembly, shards) -> list[torch.Tensor]:
    """Each transfer's box of its sender's shard, in the wire dtype (what the senders hand the assembler)."""
    out = []
    for t in assembly.transfers:
        piece = t.piece
        shard = local_view(shards[(piece.pp_rank, piece.tp_rank, piece.vp_chunk, piece.megatron)], piece.view)
        out.append(shard[box_slices(t.local_box)].to(torch.bfloat16))
    return out


def _cuts_blocks(transfer) -> bool:
    return any(start % 128 or stop % 128 for start, stop in transfer.hf_box[:1])


@pytest.mark.parametrize("model,trainer_tp,expert_tp,engine_tp", LAYOUTS,
                         ids=[f"{m}_tp{a}_etp{b}_engine_tp{c}" for m, a, b, c in LAYOUTS])
def test_each_server_rank_gets_its_box_quantized_as_the_reference(model, trainer_tp, expert_tp, engine_tp):
    dims = MODELS[model]()
    hf = _hf(dims)
    layout = TrainerLayout(trainer_tp, expert_tp_size=expert_tp)
    plan = build_sync_plan(dims, layout, engine_tp, ffn_hidden_size=FFN, dtype="bfloat16")
    shards = _shards(hf, dims, trainer_tp, expert_tp)
    assemblies = {(a.tensor, a.engine_rank): a for a in fp8_assemblies(plan)}
    fp8_names = {t.name for t in plan.tensors if is_fp8_weight(t.name, t.shape)}
    assert len(assemblies) == len(fp8_names) * engine_tp
    if trainer_tp > engine_tp:
        assert any(a.incoming for a in assemblies.values()), "an engine rank's box spans several senders' pieces"
    if model == "dense_hd64" or expert_tp == 4:
        assert any(_cuts_blocks(t) for a in assemblies.values() for t in a.transfers), "pieces that cut blocks"
    reference = quantize_bucket(list(hf.items()))
    boxes = {t.name: t.engine_boxes for t in plan.tensors}
    shapes = {t.name: t.shape for t in plan.tensors}
    for rank in range(engine_tp):
        sent, digests = {}, {}
        for (index, engine_rank), assembly in assemblies.items():
            if engine_rank == rank:
                out = quantize_assembled(plan, assembly, _parts(assembly, shards))
                sent |= dict(out)
                digests |= assembled_digests(out)
        received = apply_plan(plan, shards, rank)  # the tensors that travel in the model's dtype
        checked = 0
        for name, _, dtype, ranks_boxes in fp8_engine_tensors(plan):
            box = ranks_boxes[rank]
            if dtype == FP8_DTYPE:
                payload, scales = quantize_shard(hf[name], box)
                assert torch.equal(sent[name].view(torch.int8), payload.view(torch.int8)), f"rank {rank}: {name}"
                assert torch.equal(sent[name + "_scale_inv"], scales), f"rank {rank}: {name}'s scales"
                checked += 2
            elif name.removesuffix("_scale_inv") not in fp8_names:
                assert torch.equal(received[name][box_slices(box)], hf[name].float()[box_slices(box)]), name
                checked += 1
        assert checked == len(fp8_engine_tensors(plan))
        colocated = expected_digests(reference, boxes, shapes, rank)
        assert digests == {n: int(d) for n, d in colocated.items() if n.removesuffix("_scale_inv") in fp8_names}


def test_a_missing_piece_is_refused_by_name():
    dims = _dense()
    plan = build_sync_plan(dims, TrainerLayout(2), 1, ffn_hidden_size=FFN, dtype="bfloat16")
    shards = _shards(_hf(dims), dims, 2)
    assembly = next(a for a in fp8_assemblies(plan) if a.incoming)
    parts = _parts(assembly, shards)
    with pytest.raises(ValueError, match=rf"FP8 assembly of {plan.tensors[assembly.tensor].name} for engine rank 0"):
        assemble_box(plan, assembly, [torch.zeros_like(p) for p in parts[:-1]] + [parts[-1][:0]])


def test_layouts_that_cut_blocks_are_refused_by_name():
    plan = build_sync_plan(_dense(head_dim=64), TrainerLayout(2), 2, ffn_hidden_size=FFN, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight \(128, 256\): engine rank 0 holds "
                                         r"rows \[0, 64\)"):
        fp8_assemblies(plan)


@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="this CPU has AMX: vLLM's CPU block-FP8 kernel runs")
def test_a_rollout_servers_fp8_engine_is_refused_on_a_cpu_without_amx(tmp_path):
    """The server's engine starts through the same settings as a colocated one: refused by name before vLLM or the
    FP8 copy is touched."""
    from engine.config import ConfigError, GenerationConfig, RolloutConfig
    from engine.rollout.vllm_engine import ServerEngine

    rollout = RolloutConfig(vllm_weight_dtype="fp8", vllm_mode="server")
    with pytest.raises(ConfigError, match=r"rollout.vllm_weight_dtype=fp8: .*requires AMX tiles .*this CPU has none"):
        ServerEngine(tmp_path / "nowhere", rollout, GenerationConfig(), seed=0, dtype="bfloat16")


def test_a_server_refuses_a_sync_of_the_other_weight_dtype_by_name():
    """The plan spec says whether the trainer sends FP8 (engine/rollout/fp8_wire.py `receiver`); a server's worker
    whose engine serves the other kind refuses to join, naming the setting."""
    from engine.rollout.fp8_wire import receive_fp8_weights, receiver
    from engine.rollout.weight_transport import receive_weights

    assert receiver({"fp8": True}, "fp8") is receive_fp8_weights
    assert receiver({"fp8": False}, None) is receive_weights and receiver({}, None) is receive_weights
    with pytest.raises(RuntimeError, match="trainer syncs FP8 but this server serves the model dtype: .*vllm_weight_dtype"):
        receiver({"fp8": True}, None)
    with pytest.raises(RuntimeError, match="trainer syncs the model dtype but this server serves FP8"):
        receiver({}, "fp8")
