"""`model.packed_attention_implementation` (engine/policy/varlen_attention.py): packed rows' attention through their
sequences instead of the dense block-diagonal mask.

(a) a varlen micro-batch's sequences are the packed ones (padding a run of its own) and it holds no mask;
(b) the per-sequence attention equals masked SDPA on the whole row (GQA), and the flash call gets causal / GQA
    keywords for both signatures of torch's `varlen_attn`;
(c) the GRPO step with packed rows through varlen (it acts: the varlen attention runs once per layer forward, and
    the micro-batches carry no mask) equals the masked packed step and the padded step, at TP1 and at TP2 with
    sequence parallelism;
(d) an explicit varlen where the layer keeps its own attention is refused; the models whose layers keep the mask
    (sliding windows, Mamba mixers, `masked`) get it, and a varlen micro-batch given to one is refused.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.policy.packing import block_causal_mask, build_microbatch
from engine.policy.varlen_attention import flash_varlen_kwargs, packed_segments, packed_sequences, varlen_attention
from tests.distributed.launcher import run_distributed
from tests.helpers.policy import grpo_step_and_export, hf_tensors


def _segment_ids():
    return torch.tensor([[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 3, 3]])  # row 0: two sequences and padding


def _carrier():
    return packed_sequences([[3, 2], [6]], 6)  # the rows of `_segment_ids`


def test_sequences_of_a_varlen_microbatch_and_no_mask():
    segments = packed_segments(_carrier())
    assert segments.lengths == (3, 2, 1, 6) and segments.max_len == 6
    assert segments.cu_seqlens.tolist() == [0, 3, 5, 6, 12] and segments.cu_seqlens.dtype == torch.int32
    from engine.policy.batch import pack_completions

    batch = pack_completions([[5, 6], [7], [8, 9]], [[10], [11, 12, 13, 14], [15]], pad_token_id=0)  # 3, 5, 3 tokens
    mb = build_microbatch(batch, [0, 1, 2], "varlen", pad_token_id=0)
    assert mb.attention_mask is None and mb.model_attention_mask is mb.packed_sequences
    assert mb.packed_sequences.tolist() == [0, 5, 8, 10, 13, 15]  # rows [5], [3, 2 pad], [3, 2 pad]


def test_per_sequence_attention_equals_masked_sdpa():
    gen = torch.Generator().manual_seed(0)
    rows, width, heads, groups, hn = 2, 6, 4, 2, 8
    q = torch.randn(rows, heads, width, hn, generator=gen)
    k, v = (torch.randn(rows, groups, width, hn, generator=gen) for _ in range(2))
    mask = block_causal_mask(_segment_ids())
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, enable_gqa=True, scale=0.3)  # (b, h, s, hn)
    flat = [t.transpose(1, 2).reshape(rows * width, t.shape[1], hn) for t in (q, k, v)]
    out = varlen_attention(*flat, packed_segments(_carrier()), 0.3)
    torch.testing.assert_close(out.reshape(rows, width, heads, hn).transpose(1, 2), ref, rtol=1e-6, atol=1e-6)


def test_flash_keywords_for_both_torch_signatures():
    assert flash_varlen_kwargs({"window_size": 0, "enable_gqa": 0}, 4, 2) == ({"window_size": (-1, 0),
                                                                               "enable_gqa": True}, False)
    assert flash_varlen_kwargs({"window_size": 0, "enable_gqa": 0}, 4, 4) == ({"window_size": (-1, 0)}, False)
    assert flash_varlen_kwargs({"is_causal": 0}, 4, 2) == ({"is_causal": True}, True)  # heads repeated first


def _steps(tp: int, model_dir: str, out_root: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy import packing
    from engine.policy import varlen_attention as module
    from engine.policy.parallel import destroy_parallel

    calls, masks = [0], [0]
    original, original_mask = module.varlen_attention, packing.block_causal_mask

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    def counted_mask(*args, **kwargs):
        masks[0] += 1
        return original_mask(*args, **kwargs)

    module.varlen_attention, packing.block_causal_mask = counted, counted_mask
    parallel = ParallelConfig(tp_size=tp, sequence_parallel=tp > 1)
    results = {}
    try:
        for name, packed, implementation in (("padded", False, "auto"), ("masked", True, "masked"),
                                             ("varlen", True, "varlen")):
            calls[0] = masks[0] = 0
            results[name] = grpo_step_and_export(
                model_dir, parallel, ModelConfig(dtype="float32", packed_attention_implementation=implementation),
                f"{out_root}/{name}", padding_free=packed, width_multiple=2)
            results[name]["varlen_calls"], results[name]["masks_built"] = calls[0], masks[0]
            destroy_parallel(keep_process_group=True)
    finally:
        module.varlen_attention, packing.block_causal_mask = original, original_mask
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_varlen_packed_step_equals_masked_and_padded(tmp_path, tp):
    from engine.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=5)
    results = run_distributed(_steps, tp, tp, str(model_dir), str(tmp_path))[0]
    assert results["varlen"]["varlen_calls"] > 0 and results["masked"]["varlen_calls"] == 0
    assert results["padded"]["varlen_calls"] == 0  # padded rows have no mask: SDPA's is_causal
    assert results["varlen"]["masks_built"] == 0 and results["masked"]["masks_built"] > 0  # no W x W mask for varlen
    reference = hf_tensors(tmp_path / "masked")
    for name in ("varlen", "padded"):
        assert results[name]["loss"] == pytest.approx(results["masked"]["loss"], rel=1e-5), name
        assert results[name]["grad_norm"] == pytest.approx(results["masked"]["grad_norm"], rel=1e-5), name
        for key, weight in hf_tensors(tmp_path / name).items():
            torch.testing.assert_close(weight, reference[key], rtol=0, atol=1e-6, msg=f"{name}: {key}")


def test_explicit_varlen_where_the_layer_keeps_its_own_attention_is_refused():
    from types import SimpleNamespace

    from engine.config import ModelConfig
    from engine.policy.model import _layer_spec
    from engine.policy.sdpa_attention import attention_specs

    spec = _layer_spec(ModelConfig(transformer_impl="local"))
    with pytest.raises(ValueError, match=r"packed_attention_implementation=varlen cannot act on this gemma3_text "
                                         r"model: the sliding window"):
        attention_specs(spec, None, SimpleNamespace(window_size=(4, 0)), "auto", "gemma3_text", "varlen")
    with pytest.raises(ValueError, match="varlen cannot act on this qwen2 model: model.attention_implementation is "
                                         "eager"):
        attention_specs(spec, None, SimpleNamespace(window_size=None), "eager", "qwen2", "varlen")
    windowed, _ = attention_specs(spec, None, SimpleNamespace(window_size=(4, 0)), "auto", "gemma3_text", "auto")
    assert windowed is spec  # auto: the layer's own attention, with the mask


def test_multi_latent_attention_keeps_sdpa_and_the_mask():
    """MLA: SDPA still acts (explicit sdpa accepted), packed rows keep the mask (explicit varlen refused)."""
    from types import SimpleNamespace

    from engine.config import ModelConfig
    from engine.policy.model import _layer_spec
    from engine.policy.sdpa_attention import attention_specs, sdpa_core_attention_class

    spec = _layer_spec(ModelConfig(transformer_impl="local"))
    mla = SimpleNamespace(window_size=None, multi_latent_attention=True)
    swapped, _ = attention_specs(spec, None, mla, "sdpa", "deepseek_v3", "auto")
    assert swapped.submodules.self_attention.submodules.core_attention is sdpa_core_attention_class()
    with pytest.raises(ValueError, match="varlen cannot act on this deepseek_v3 model: multi-latent"):
        attention_specs(spec, None, mla, "auto", "deepseek_v3", "varlen")


def _mask_keepers(root: str) -> dict:
    from transformers import AutoConfig

    from engine.config import ModelConfig, ParallelConfig
    from engine.models.tiny_model import build_tiny_model
    from engine.policy.batch import pack_completions
    from engine.policy.model import build_policy
    from engine.policy.parallel import destroy_parallel, init_parallel
    from engine.policy.sdpa_attention import serves_varlen
    from engine.policy.step import check_attention_mask

    ps = init_parallel(ParallelConfig(), seed=0)
    batch = pack_completions([[5, 6], [7]], [[10], [11, 12]], pad_token_id=0)
    varlen_mb = build_microbatch(batch, [0, 1], "varlen", pad_token_id=0)
    out = {}
    for family, implementation in (("qwen2", "auto"), ("qwen2", "masked"), ("gemma3_text", "auto"),
                                   ("nemotron_h", "auto"), ("deepseek_v3", "auto"), ("gpt_oss", "auto")):
        hf_config = AutoConfig.from_pretrained(build_tiny_model(f"{root}/{family}", family, seed=0))
        chunks = build_policy(hf_config, ModelConfig(dtype="float32", packed_attention_implementation=implementation),
                              ps)
        refused = ""
        try:
            check_attention_mask(chunks, [varlen_mb])
        except ValueError as error:
            refused = str(error)
        out[f"{family}/{implementation}"] = (serves_varlen(chunks), refused)
    destroy_parallel(keep_process_group=True)
    return out


def test_models_whose_layers_keep_the_mask_get_it_and_refuse_packed_sequences(tmp_path):
    """Only a model whose every layer takes the sequences gets micro-batches without a mask (round_batch.py
    `microbatch_spec`); sliding windows (Gemma 3, GPT-OSS), attention sinks, MLA, Mamba mixers and `masked` keep it."""
    results = run_distributed(_mask_keepers, 1, str(tmp_path))[0]
    assert results["qwen2/auto"] == (True, ""), results["qwen2/auto"]
    for name in ("qwen2/masked", "gemma3_text/auto", "nemotron_h/auto", "deepseek_v3/auto", "gpt_oss/auto"):
        serves, refused = results[name]
        assert not serves and "a layer of this model keeps the mask" in refused, (name, results[name])
