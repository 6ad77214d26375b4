"""`model.packed_attention_implementation` (engine/policy/varlen_attention.py): packed rows' attention through their
sequences instead of the dense block-diagonal mask.

(a) the sequences read from packing's block-causal mask are the packed ones (padding a run of its own), and any other
    mask is refused (None: the caller keeps the masked path);
(b) the per-sequence attention equals masked SDPA on the whole row (GQA), and the flash call gets causal / GQA
    keywords for both signatures of torch's `varlen_attn`;
(c) the GRPO step with packed rows through varlen (it acts: the varlen attention runs once per layer forward)
    equals the masked packed step and the padded step, at TP1 and at TP2 with sequence parallelism;
(d) an explicit varlen where the layer keeps its own attention is refused.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.policy.packing import block_causal_mask
from engine.policy.varlen_attention import flash_varlen_kwargs, packed_segments, varlen_attention
from tests.distributed.launcher import run_distributed
from tests.helpers.policy import grpo_step_and_export, hf_tensors


def _segment_ids():
    return torch.tensor([[1, 1, 1, 2, 2, 0], [3, 3, 3, 3, 3, 3]])  # row 0: two sequences and padding


def test_segments_of_a_packed_mask_and_refusal_of_other_masks():
    mask = block_causal_mask(_segment_ids())
    segments = packed_segments(mask)
    assert segments.lengths == (3, 2, 1, 6) and segments.max_len == 6
    assert segments.cu_seqlens.tolist() == [0, 3, 5, 6, 12] and segments.cu_seqlens.dtype == torch.int32
    windowed = mask.clone()
    windowed[1, 0, 5, 0] = True  # a sliding window inside one sequence: not block-causal
    assert packed_segments(windowed) is None
    assert packed_segments(~mask) is None


def test_per_sequence_attention_equals_masked_sdpa():
    gen = torch.Generator().manual_seed(0)
    rows, width, heads, groups, hn = 2, 6, 4, 2, 8
    q = torch.randn(rows, heads, width, hn, generator=gen)
    k, v = (torch.randn(rows, groups, width, hn, generator=gen) for _ in range(2))
    mask = block_causal_mask(_segment_ids())
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, enable_gqa=True, scale=0.3)  # (b, h, s, hn)
    flat = [t.transpose(1, 2).reshape(rows * width, t.shape[1], hn) for t in (q, k, v)]
    out = varlen_attention(*flat, packed_segments(mask), 0.3)
    torch.testing.assert_close(out.reshape(rows, width, heads, hn).transpose(1, 2), ref, rtol=1e-6, atol=1e-6)


def test_flash_keywords_for_both_torch_signatures():
    assert flash_varlen_kwargs({"window_size": 0, "enable_gqa": 0}, 4, 2) == ({"window_size": (-1, 0),
                                                                               "enable_gqa": True}, False)
    assert flash_varlen_kwargs({"window_size": 0, "enable_gqa": 0}, 4, 4) == ({"window_size": (-1, 0)}, False)
    assert flash_varlen_kwargs({"is_causal": 0}, 4, 2) == ({"is_causal": True}, True)  # heads repeated first


def _steps(tp: int, model_dir: str, out_root: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy import varlen_attention as module
    from engine.policy.parallel import destroy_parallel

    calls = [0]
    original = module.varlen_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    module.varlen_attention = counted
    parallel = ParallelConfig(tp_size=tp, sequence_parallel=tp > 1)
    results = {}
    try:
        for name, packed, implementation in (("padded", False, "auto"), ("masked", True, "masked"),
                                             ("varlen", True, "varlen")):
            calls[0] = 0
            results[name] = grpo_step_and_export(
                model_dir, parallel, ModelConfig(dtype="float32", packed_attention_implementation=implementation),
                f"{out_root}/{name}", padding_free=packed, width_multiple=2)
            results[name]["varlen_calls"] = calls[0]
            destroy_parallel(keep_process_group=True)
    finally:
        module.varlen_attention = original
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_varlen_packed_step_equals_masked_and_padded(tmp_path, tp):
    from engine.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "qwen2", "qwen2", seed=5)
    results = run_distributed(_steps, tp, tp, str(model_dir), str(tmp_path))[0]
    assert results["varlen"]["varlen_calls"] > 0 and results["masked"]["varlen_calls"] == 0
    assert results["padded"]["varlen_calls"] == 0  # padded rows have no mask: SDPA's is_causal
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
