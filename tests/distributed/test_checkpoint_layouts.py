"""HF checkpoints through the sharded Megatron policy, on gloo: at TP in {1, 2}, PP in {1, 2} and TP=2 x PP=2,
(a) Megatron's logits equal Hugging Face transformers' logits of the same checkpoint, and (b) HF -> Megatron -> HF
gives back every tensor bit for bit. Qwen2 (QKV bias), Qwen2 with tied embeddings, and Llama."""

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import hf_logits, hf_tensors, logits_and_export


def _load_forward_export(tp: int, pp: int, model_dir: str, out_dir: str) -> dict:
    from engine.config import ParallelConfig

    return {"logits": logits_and_export(model_dir, ParallelConfig(tp_size=tp, pp_size=pp), out_dir)}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=1),
        "qwen2_tied": build_tiny_model(root / "qwen2_tied", "qwen2", seed=2, tie_word_embeddings=True),
        "llama": build_tiny_model(root / "llama", "llama", seed=3),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,tp,pp",
    [("qwen2", 1, 1), ("qwen2", 2, 1), ("qwen2", 1, 2), ("qwen2", 2, 2), ("qwen2_tied", 2, 2), ("llama", 2, 2)],
    ids=["qwen2-tp1_pp1", "qwen2-tp2_pp1", "qwen2-tp1_pp2", "qwen2-tp2_pp2", "qwen2_tied-tp2_pp2", "llama-tp2_pp2"],
)
def test_checkpoint_logits_match_hf_and_round_trip_is_exact(tiny_models, tmp_path, family, tp, pp):
    model_dir = tiny_models[family]
    out_dir = tmp_path / "export"
    results = run_distributed(_load_forward_export, tp * pp, tp, pp, str(model_dir), str(out_dir))
    logits = [r["logits"] for r in results if r["logits"] is not None]
    assert len(logits) == 1, "exactly one rank (last stage, TP rank 0) reports logits"
    torch.testing.assert_close(logits[0], hf_logits(model_dir), rtol=1e-5, atol=1e-5)

    original, exported = hf_tensors(model_dir), hf_tensors(out_dir)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists()
    assert not out_dir.with_name("export.tmp").exists()
