"""FP8 rollout, the trainer side, on CPU without vLLM's FP8 layers (this CPU has no AMX: vLLM cannot serve block-FP8
here, and the setting is refused, which is tested too).

- the quantize-at-sync path against the reference quantizer (engine/models/quantized.py): for every FP8 tensor of a
  tiny dense and a tiny MoE model and every engine rank at engine TP 1 and 2, the rank's box of the whole-tensor
  quantization (payload and the scale blocks of its box) is bit-equal to quantizing the rank's shard on its own;
- the plan: every tensor each engine rank loads, an FP8 weight as payload (float8_e4m3fn) plus scales (float32) whose
  boxes tile the block grid as the payload boxes tile the weight;
- the digests against a receiver holding what vLLM's FP8 layers hold (per engine rank: merged qkv_proj /
  gate_up_proj with their parts' rows and their parts' scale rows one after the other, float8 weight, float32
  `weight_scale_inv` of ceil(rows / 128) x ceil(cols / 128)), split back by the engine's own `held_parts`: equal when
  right, the tensor named when one scale block or one payload element is wrong;
- layouts that cut a block, server mode, and this CPU refused by name.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import ConfigError, RolloutConfig, load_config
from engine.models.quantized import FP8_DTYPE, quantize_fp8
from engine.policy.hf_map import ModelDims
from engine.rollout.fp8_checkpoint import fp8_engine_settings, write_fp8_engine_checkpoint
from engine.rollout.fp8_sync import (
    FP8_BLOCK,
    expected_digests,
    fp8_engine_tensors,
    fp8_layout_problems,
    held_parts,
    is_fp8_weight,
    quantize_bucket,
    quantize_shard,
    scale_box,
    scale_name,
)
from engine.rollout.sync_check import check_digests
from engine.rollout.sync_plan import TrainerLayout, box_slices, build_sync_plan
from engine.rollout.weight_digest import box_digest
from engine.validation import validate

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


MODELS = {"dense": _dense, "moe": _moe}


def _plan(model: str, engine_tp: int):
    return build_sync_plan(MODELS[model](), TrainerLayout(1), engine_tp, ffn_hidden_size=FFN, dtype="bfloat16")


def _weights(plan, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors of the plan, bf16, with a spread of magnitudes between blocks (so scales differ)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for tensor in plan.tensors:
        values = torch.randn(tensor.shape, generator=gen)
        if len(tensor.shape) == 2:
            values = values * torch.rand(tensor.shape[0], 1, generator=gen).mul(8).exp2()
        out.append((tensor.name, values.to(torch.bfloat16)))
    return out


@pytest.mark.parametrize("engine_tp", [1, 2])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_each_engine_rank_gets_its_shard_quantized_as_the_reference(model, engine_tp):
    plan = _plan(model, engine_tp)
    assert fp8_layout_problems(plan) == []
    full = dict(_weights(plan))
    sent = dict(quantize_bucket(list(full.items())))
    checked = 0
    for tensor in plan.tensors:
        if not is_fp8_weight(tensor.name, tensor.shape):
            assert sent[tensor.name] is full[tensor.name] and scale_name(tensor.name) not in sent
            continue
        payload, scales = sent[tensor.name], sent[scale_name(tensor.name)]
        assert payload.dtype == FP8_DTYPE and scales.dtype == torch.float32
        reference = quantize_fp8(full[tensor.name], FP8_BLOCK)  # engine/models/quantized.py, whole tensor
        assert torch.equal(payload.view(torch.int8), reference[0].view(torch.int8))
        assert torch.equal(scales, reference[1])
        for box in tensor.engine_boxes:
            own_payload, own_scales = quantize_shard(full[tensor.name], box)
            assert torch.equal(payload[box_slices(box)].view(torch.int8), own_payload.view(torch.int8)), tensor.name
            assert torch.equal(scales[box_slices(scale_box(box))], own_scales), tensor.name
            checked += 1
    experts = 2 * 2 * 3 if model == "moe" else 0
    assert checked == engine_tp * (2 * (4 + (0 if model == "moe" else 3)) + experts)


@pytest.mark.parametrize("engine_tp", [1, 2])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_plan_sends_payload_and_scales_for_every_tensor_each_rank_loads(model, engine_tp):
    plan = _plan(model, engine_tp)
    loaded = fp8_engine_tensors(plan)
    names = [name for name, *_ in loaded]
    assert len(names) == len(set(names))
    fp8 = [t for t in plan.tensors if is_fp8_weight(t.name, t.shape)]
    assert len(loaded) == len(plan.tensors) + len(fp8)
    by_name = {name: (shape, dtype, boxes) for name, shape, dtype, boxes in loaded}
    assert not any(".mlp.gate." in n or "norm" in n or "embed" in n or "lm_head" in n for n in by_name
                   if by_name[n][1] != torch.bfloat16)
    for tensor in fp8:
        shape, dtype, boxes = by_name[tensor.name]
        assert dtype == FP8_DTYPE and boxes == tensor.engine_boxes
        grid, scale_dtype, scale_boxes = by_name[scale_name(tensor.name)]
        assert scale_dtype == torch.float32 and grid == (-(-shape[0] // 128), -(-shape[1] // 128))
        covered = torch.zeros(grid, dtype=torch.int32)
        payload = torch.zeros(shape, dtype=torch.int32)
        for box, blocks in zip(boxes, scale_boxes):
            covered[box_slices(blocks)] += 1
            payload[box_slices(box)] += 1
        # the scale blocks are held as often as the weights in them (split weights: once; replicated: by every rank)
        assert torch.equal(covered, payload[::128, ::128]), tensor.name


_MERGED = (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def _receiver(sent: dict, plan, engine_rank: int) -> dict[str, list]:
    """What engine rank `engine_rank` holds after loading, as its digests: vLLM's FP8 layers' parameters (merged
    layers' parts and scale rows one after the other), split back with `held_parts` as the engine's digests do."""
    boxes = {t.name: t.engine_boxes[engine_rank] for t in plan.tensors}
    params = {}  # vLLM parameter -> (HF weight names, rows per part, payload, scales)
    for name, box in boxes.items():
        if name not in sent or not is_fp8_weight(name, sent[name].shape):
            continue
        module = name.rsplit(".", 2)[-2]
        prefix = name.rsplit(".", 2)[0]
        merged = next(((m, parts) for m, parts in _MERGED if module in parts), None)
        key = f"{prefix.rsplit('.', 1)[0]}.{merged[0].split('.')[-1]}" if merged else prefix
        held = params.setdefault(key, ([], [], [], []))
        held[0].append(name)
        held[1].append(box[0][1] - box[0][0])
        held[2].append(sent[name][box_slices(box)])
        held[3].append(sent[scale_name(name)][box_slices(scale_box(box))])
    digests = {}
    for names, rows, payloads, scales in params.values():
        weight, weight_scale_inv = torch.cat(payloads), torch.cat(scales)  # what vLLM allocates and loads
        assert weight.dtype == FP8_DTYPE and weight_scale_inv.dtype == torch.float32
        assert weight_scale_inv.shape == (sum(-(-r // 128) for r in rows), -(-weight.shape[1] // 128))
        for param, tensor in (("weight", weight), ("weight_scale_inv", weight_scale_inv)):
            for hf, view in held_parts(names, rows, param, tensor):
                digests[hf] = [int(box_digest(view)), str(view.dtype)]
    for name, box in boxes.items():
        if not is_fp8_weight(name, sent[name].shape):
            digests[name] = [int(box_digest(sent[name][box_slices(box)])), str(sent[name].dtype)]
    return digests


@pytest.mark.parametrize("engine_tp", [1, 2])
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_digests_verify_what_fp8_layers_hold(model, engine_tp):
    plan = _plan(model, engine_tp)
    sent = quantize_bucket(_weights(plan, seed=1))
    boxes = {t.name: t.engine_boxes for t in plan.tensors}
    shapes = {t.name: t.shape for t in plan.tensors}
    held_sent = dict(sent)
    expected = [{k: int(v) for k, v in expected_digests(sent, boxes, shapes, rank).items()} for rank in range(engine_tp)]
    for rank in range(engine_tp):
        assert len(expected[rank]) == len(fp8_engine_tensors(plan))
        assert check_digests(expected[rank], _receiver(held_sent, plan, rank), "bfloat16", f"engine rank {rank}") == ""

    k_proj = "model.layers.1.self_attn.k_proj.weight"
    wrong_scale = dict(held_sent)
    scales = wrong_scale[scale_name(k_proj)].clone()
    scales[-1, -1] *= 2  # one block's scale, on the last engine rank
    wrong_scale[scale_name(k_proj)] = scales
    rank = engine_tp - 1
    message = check_digests(expected[rank], _receiver(wrong_scale, plan, rank), "bfloat16", f"engine rank {rank}")
    assert "holds 1 of" in message and f"{scale_name(k_proj)} (digest" in message

    up = ("model.layers.0.mlp.experts.1.up_proj.weight" if model == "moe" else "model.layers.0.mlp.up_proj.weight")
    wrong_payload = dict(held_sent)
    payload = wrong_payload[up].clone()
    payload.view(torch.uint8)[0, 0] ^= 1  # one bit of one FP8 element, on engine rank 0
    wrong_payload[up] = payload
    message = check_digests(expected[0], _receiver(wrong_payload, plan, 0), "bfloat16", "engine rank 0")
    assert "holds 1 of" in message and f"{up} (digest" in message


def test_layouts_that_cut_blocks_are_refused_by_name():
    plan = build_sync_plan(_dense(head_dim=64), TrainerLayout(1), 2, ffn_hidden_size=FFN, dtype="bfloat16")
    (problem,) = fp8_layout_problems(plan)
    assert "rollout.vllm_weight_dtype=fp8 at rollout.vllm_tensor_parallel_size=2" in problem
    assert "model.layers.0.self_attn.k_proj.weight (128, 256): engine rank 0 holds rows [0, 64)" in problem
    # q_proj's 256 rows at engine TP 1 fill whole blocks; k_proj (128 rows) too; v_proj, the last part, may be partial
    plan = build_sync_plan(_dense(head_dim=64), TrainerLayout(1), 1, ffn_hidden_size=FFN, dtype="bfloat16")
    assert fp8_layout_problems(plan) == []


@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="this CPU has AMX: vLLM's CPU block-FP8 kernel runs")
def test_fp8_weights_refused_on_a_cpu_without_amx(tmp_path):
    rollout = RolloutConfig(vllm_weight_dtype="fp8")
    with pytest.raises(ConfigError, match=r"rollout.vllm_weight_dtype=fp8: .*requires AMX tiles .*this CPU has none"):
        fp8_engine_settings(tmp_path / "nowhere", rollout, on_gpu=False)  # refused before the checkpoint is read


@pytest.mark.skipif(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported(),
                    reason="this CPU has AVX-512 or AMX: vLLM's CPU FP8 KV cache runs")
def test_fp8_kv_cache_refused_on_a_cpu_without_avx512(tmp_path):
    rollout = RolloutConfig(vllm_kv_cache_dtype="fp8")
    with pytest.raises(ConfigError, match=r"rollout.vllm_kv_cache_dtype=fp8: .*AVX-512 or AMX"):
        fp8_engine_settings(tmp_path, rollout, on_gpu=False)


def test_settings_reach_vllm_on_a_gpu(tmp_path):
    """On a GPU nothing is refused here: the engine starts from the FP8 copy with vLLM's fp8 method and the KV dtype."""
    _checkpoint(tmp_path / "policy")
    model_dir, kwargs, copy = fp8_engine_settings(tmp_path / "policy", RolloutConfig(
        vllm_weight_dtype="fp8", vllm_kv_cache_dtype="fp8"), on_gpu=True)
    assert kwargs == {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    assert json.loads((model_dir / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    copy.release()  # what the engine's close does
    assert not model_dir.exists()
    assert fp8_engine_settings(tmp_path / "policy", RolloutConfig(), on_gpu=True) == (tmp_path / "policy", {}, None)


def _checkpoint(path) -> dict:
    path.mkdir()
    gen = torch.Generator().manual_seed(2)
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 200, generator=gen).to(torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.randn(200, 384, generator=gen).to(torch.bfloat16),
               "model.layers.0.input_layernorm.weight": torch.randn(200, generator=gen).to(torch.bfloat16),
               "model.embed_tokens.weight": torch.randn(300, 200, generator=gen).to(torch.bfloat16)}
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (path / "tokenizer.json").write_text("{}")
    return tensors


def test_engine_starts_from_a_block_fp8_copy(tmp_path):
    original = _checkpoint(tmp_path / "policy")
    out = write_fp8_engine_checkpoint(tmp_path / "policy", tmp_path / "fp8")
    written = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    assert (out / "tokenizer.json").read_text() == "{}"
    for name, tensor in original.items():
        if is_fp8_weight(name, tuple(tensor.shape)):
            payload, scales = quantize_fp8(tensor, FP8_BLOCK)
            assert torch.equal(written[name].view(torch.int8), payload.view(torch.int8))
            assert torch.equal(written[scale_name(name)], scales)
        else:
            assert torch.equal(written[name], tensor) and scale_name(name) not in written
    assert len(written) == len(original) + 2
    with pytest.raises(ValueError, match="is already quantized"):
        write_fp8_engine_checkpoint(out, tmp_path / "again")


def test_fp8_weights_accepted_in_server_mode_by_the_config():
    """The server-mode FP8 wire exists (engine/rollout/fp8_wire.py): only a machine that cannot serve FP8 refuses,
    at the server's engine start (`test_a_rollout_servers_fp8_engine_is_refused_on_a_cpu_without_amx`)."""
    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.vllm_weight_dtype=fp8", "rollout.vllm_mode=server"])
    validate(cfg, 1)
