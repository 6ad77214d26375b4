"""HF checkpoints through the sharded Megatron policy, on gloo: at TP in {1, 2}, PP in {1, 2} and TP=2 x PP=2,
(a) Megatron's logits equal Hugging Face transformers' logits of the same checkpoint, and (b) HF -> Megatron -> HF
gives back every tensor bit for bit. Qwen2 (QKV bias), Qwen2 with tied embeddings, and Llama."""

import pytest
import torch

from tests.distributed.launcher import run_distributed

BATCH, SEQ = 2, 12


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))  # (B, T)


def _load_forward_export(tp: int, pp: int, model_dir: str, out_dir: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoConfig

    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.hf_checkpoint import export_hf_checkpoint, load_hf_checkpoint
    from engine.policy.hf_convert import ModelDims
    from engine.policy.model import build_policy, padded_vocab_size
    from engine.policy.parallel import init_parallel
    from engine.policy.step import lm_head_logits, run_schedule

    ps = init_parallel(ParallelConfig(tp_size=tp, pp_size=pp), seed=0)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(dtype="float32")
    chunks = build_policy(hf_config, model_cfg, ps)
    dims = ModelDims.from_hf(hf_config, padded_vocab_size(hf_config.vocab_size, model_cfg.make_vocab_size_divisible_by, tp))
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    tokens = _tokens(hf_config.vocab_size)
    batch = {"tokens": tokens, "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)}

    def logits_fn(model, hidden, _batch):
        local = lm_head_logits(hidden, model.lm_head_weight(), ps)  # (s, b, V_pad / tp)
        shards = [torch.empty_like(local) for _ in range(ps.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=ps.groups.tp)
        full = torch.cat(shards, dim=-1).transpose(0, 1)  # (b, s, V_pad)
        return full.sum() * 0, {"logits": full[..., : hf_config.vocab_size].detach().clone()}

    with torch.no_grad():
        values = run_schedule(chunks, ps, [batch], logits_fn, forward_only=True)
    export_hf_checkpoint(chunks, ps, out_dir, hf_config, dims, tokenizer_dir=model_dir)
    return {"logits": values[0]["logits"] if values and ps.tp_rank == 0 else None}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {
        "qwen2": build_tiny_model(root / "qwen2", "qwen2", seed=1),
        "qwen2_tied": build_tiny_model(root / "qwen2_tied", "qwen2", seed=2, tie_word_embeddings=True),
        "llama": build_tiny_model(root / "llama", "llama", seed=3),
    }


def _hf_logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_tokens(model.config.vocab_size)).logits  # (B, T, V)


def _safetensors(model_dir) -> dict[str, torch.Tensor]:
    from engine.policy.hf_checkpoint import SafetensorsSource

    src = SafetensorsSource(model_dir)
    return {name: src.read(name, (slice(None),)) for name in src.names()}


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
    torch.testing.assert_close(logits[0], _hf_logits(model_dir), rtol=1e-5, atol=1e-5)

    original, exported = _safetensors(model_dir), _safetensors(out_dir)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert (out_dir / "config.json").exists() and (out_dir / "tokenizer.json").exists()
    assert not out_dir.with_name("export.tmp").exists()
