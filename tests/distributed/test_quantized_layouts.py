"""Quantized checkpoints through the sharded Megatron policy, on gloo: a builtin tiny model quantized as the releases
are (block-wise FP8 for Qwen3, Qwen3-MoE and DeepSeek-V3, MXFP4 for GPT-OSS), loaded at TP1 and TP2 in bf16 and fp32.
(a) The policy's weights (exported with the default `export_quantization: none`) equal transformers' own
dequantization of the checkpoint bit for bit, and its fp32 logits equal transformers' logits of that dequantized
checkpoint; (b) exported in the source's format (`source`) without training, every tensor comes back byte for byte
and the config keeps its quantization_config."""

import json

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import hf_logits, hf_tensors
from tests.helpers.quantized import quantize_checkpoint, transformers_dequantized, write_unquantized


def _load_forward_export(tp: int, model_dir: str, out_dir: str, dtype: str, moe: bool) -> torch.Tensor | None:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.hf_checkpoint import export_hf_checkpoint
    from engine.policy.microbatch import MicroBatch
    from engine.policy.step import run_schedule
    from tests.helpers.policy import BATCH, SEQ, build_from_hf, gathered_logits_fn, tokens

    parallel = ParallelConfig(tp_size=tp, sequence_parallel=moe and tp > 1)
    ps, hf_config, chunks, dims = build_from_hf(model_dir, parallel, ModelConfig(dtype=dtype))
    for chunk in chunks:
        chunk.eval()
    batch = MicroBatch(tokens=tokens(hf_config.vocab_size), position_ids=torch.arange(SEQ).expand(BATCH, SEQ))
    with torch.no_grad():
        values = run_schedule(chunks, ps, [batch], gathered_logits_fn(ps, hf_config.vocab_size), forward_only=True)
    export_hf_checkpoint(chunks, ps, f"{out_dir}/none", hf_config, dims, tokenizer_dir=model_dir, source_dir=model_dir)
    export_hf_checkpoint(chunks, ps, f"{out_dir}/source", hf_config, dims, tokenizer_dir=model_dir,
                         dtype=torch.bfloat16, source_dir=model_dir, quantization="source")
    return values[0]["logits"] if values and ps.tp_rank == 0 else None


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("quantized")
    families = {"qwen3": "fp8", "qwen3_moe": "fp8", "deepseek_v3": "fp8", "gpt_oss": "mxfp4"}
    return {family: quantize_checkpoint(build_tiny_model(root / family, family, seed=7), root / f"{family}_{method}",
                                        method) for family, method in families.items()}


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,dtype", [
    ("qwen3", 1, "bfloat16"), ("qwen3", 2, "float32"), ("qwen3_moe", 2, "bfloat16"), ("deepseek_v3", 2, "float32"),
    ("gpt_oss", 1, "float32"), ("gpt_oss", 2, "bfloat16")])
def test_quantized_checkpoint_loads_as_transformers_dequantizes_it_and_exports_back_byte_exact(
        quantized_models, tmp_path, family, tp, dtype):
    model_dir = quantized_models[family]
    torch_dtype = getattr(torch, dtype)
    results = run_distributed(_load_forward_export, tp, tp, str(model_dir), str(tmp_path), dtype, family != "qwen3")
    logits = [r for r in results if r is not None]
    assert len(logits) == 1, "exactly one rank (TP rank 0) reports logits"

    reference = transformers_dequantized(model_dir, torch_dtype)
    loaded = hf_tensors(tmp_path / "none")
    assert sorted(loaded) == sorted(reference)
    for name, tensor in reference.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert "quantization_config" not in json.loads((tmp_path / "none" / "config.json").read_text())
    if torch_dtype == torch.float32:
        dequantized_dir = write_unquantized(reference, model_dir, tmp_path / "dequantized")
        torch.testing.assert_close(logits[0], hf_logits(dequantized_dir), rtol=1e-5, atol=1e-5)

    source, exported = hf_tensors(model_dir), hf_tensors(tmp_path / "source")
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name].view(torch.uint8), tensor.view(torch.uint8)), name
    configs = [json.loads((d / "config.json").read_text()) for d in (model_dir, tmp_path / "source")]
    assert configs[1]["quantization_config"] == configs[0]["quantization_config"]
