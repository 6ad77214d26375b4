"""Qwen3 (per-head q/k RMSNorm, head_dim != hidden / heads) and Qwen3-MoE (routed experts, expert parallelism) through
the sharded Megatron policy on gloo, all in ONE launch of 2 ranks (several layouts one after another; Megatron's
groups are rebuilt between them, the process group is kept):

(a) for every layout, Megatron's logits equal Hugging Face transformers' logits of the same checkpoint, and the HF
    export gives back every tensor bit for bit: Qwen3 at TP1 (x DP2), TP2, PP2; Qwen3-MoE at EP1 (x DP2), EP2 (x DP2,
    each rank holds 2 of the 4 experts), PP2 (2 MoE layers per stage) and TP2 x EP2 (expert TP 1; in eval mode: Megatron refuses to train MoE with
    TP > 1 but no sequence parallelism, which needs Transformer Engine, so MoE x TP training is GPU-only);
(b) one GRPO optimizer step of the tiny Qwen3-MoE at EP2 equals the step at EP1 (both DP2, the same batch split): the
    summed loss, the gradient norm and every updated weight, with the load-balancing aux loss (1e-2) and z-loss (1e-3)
    on, so the router's extra gradients go through expert parallelism too (Megatron's all-to-all token dispatcher).
"""

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.distributed.test_grpo_step_layouts import GLOBAL_BATCH, MICRO_BATCH, _global_batch

BATCH, SEQ = 2, 12
LOGIT_LAYOUTS = [  # (family, tp, pp, ep) on 2 ranks: dp = 2 / (tp * pp)
    ("qwen3", 1, 1, 1), ("qwen3", 2, 1, 1), ("qwen3", 1, 2, 1),
    ("qwen3_moe", 1, 1, 1), ("qwen3_moe", 1, 1, 2), ("qwen3_moe", 2, 1, 2), ("qwen3_moe", 1, 2, 1),
]
STEP_LAYOUTS = [1, 2]  # ep sizes of the Qwen3-MoE GRPO step (tp1, pp1, dp2)


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))  # (B, T)


def _layout_name(family: str, tp: int, pp: int, ep: int) -> str:
    return f"{family}-tp{tp}_pp{pp}_ep{ep}"


def _build(family_dir: str, tp: int, pp: int, ep: int, model_cfg):
    from transformers import AutoConfig

    from engine.config import ParallelConfig
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_convert import ModelDims
    from engine.policy.model import build_policy, padded_vocab_size
    from engine.policy.parallel import init_parallel

    ps = init_parallel(ParallelConfig(tp_size=tp, pp_size=pp, ep_size=ep), seed=0)
    hf_config = AutoConfig.from_pretrained(family_dir)
    chunks = build_policy(hf_config, model_cfg, ps)
    dims = ModelDims.from_hf(hf_config, padded_vocab_size(hf_config.vocab_size, model_cfg.make_vocab_size_divisible_by, tp))
    load_hf_checkpoint(chunks, ps, family_dir, dims)
    return ps, hf_config, chunks, dims


def _logits_and_export(family_dir: str, tp: int, pp: int, ep: int, out_dir: str):
    import torch.distributed as dist

    from engine.config import ModelConfig
    from engine.policy.hf_checkpoint import export_hf_checkpoint
    from engine.policy.step import lm_head_logits, run_schedule

    ps, hf_config, chunks, dims = _build(family_dir, tp, pp, ep, ModelConfig(dtype="float32"))
    for chunk in chunks:
        chunk.eval()  # NOTE: Megatron refuses MoE x TP > 1 in training mode without sequence parallelism (TE only)
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
    export_hf_checkpoint(chunks, ps, out_dir, hf_config, dims, tokenizer_dir=family_dir)
    return values[0]["logits"] if values and ps.tp_rank == 0 else None


def _grpo_step(family_dir: str, ep: int, out_dir: str) -> dict:
    from engine.config import ModelConfig, OptimizerConfig
    from engine.grpo.policy_loss import LossNormalizer, PolicyLossConfig
    from engine.policy.batch import split_microbatches
    from engine.policy.hf_checkpoint import export_hf_checkpoint
    from engine.policy.optimizer import build_optimizer
    from engine.policy.step import LogprobSettings, grpo_forward_backward

    model_cfg = ModelConfig(dtype="float32", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    ps, hf_config, chunks, dims = _build(family_dir, 1, 1, ep, model_cfg)
    opt_cfg = OptimizerConfig(learning_rate=1e-3, adam_epsilon=1e-4, lr_scheduler_type="constant", max_grad_norm=1.0)
    popt = build_optimizer(opt_cfg, chunks, ps, total_steps=1)
    batch = _global_batch()
    rows = GLOBAL_BATCH // ps.dp_size
    local = {k: v[ps.dp_rank * rows: (ps.dp_rank + 1) * rows] for k, v in batch.items()}
    normalizer = LossNormalizer(num_tokens=float(batch["completion_mask"].sum()), num_sequences=float(GLOBAL_BATCH))
    loss_config = PolicyLossConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28, use_bias_correction_kl=True)
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=0.9, implementation="torch_chunked")
    popt.zero_grad()
    outputs = grpo_forward_backward(popt.model, ps, split_microbatches(local, MICRO_BATCH), loss_config, normalizer,
                                    settings)
    stats = popt.step()
    export_hf_checkpoint(chunks, ps, out_dir, hf_config, dims)
    return {"loss": float(sum(o.loss for o in outputs)), "grad_norm": stats["grad_norm"]}


def _all_layouts(model_dirs: dict, out_root: str) -> dict:
    from engine.policy.parallel import destroy_parallel

    results = {}
    for family, tp, pp, ep in LOGIT_LAYOUTS:
        name = _layout_name(family, tp, pp, ep)
        results[name] = _logits_and_export(model_dirs[family], tp, pp, ep, f"{out_root}/{name}")
        destroy_parallel(keep_process_group=True)
    for ep in STEP_LAYOUTS:
        results[f"step-ep{ep}"] = _grpo_step(model_dirs["qwen3_moe"], ep, f"{out_root}/step-ep{ep}")
        destroy_parallel(keep_process_group=True)
    return results


def _hf_logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_tokens(model.config.vocab_size)).logits  # (B, T, V)


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    from engine.policy.hf_checkpoint import SafetensorsSource

    src = SafetensorsSource(model_dir)
    return {name: src.read(name, (slice(None),)) for name in src.names()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("qwen3")
    model_dirs = {family: str(build_tiny_model(root / family, family, seed=7)) for family in ("qwen3", "qwen3_moe")}
    results = run_distributed(_all_layouts, 2, model_dirs, str(root / "out"))
    return model_dirs, root / "out", results


@pytest.mark.slow
@pytest.mark.parametrize("layout", LOGIT_LAYOUTS, ids=[_layout_name(*x) for x in LOGIT_LAYOUTS])
def test_qwen3_logits_match_hf_and_export_is_byte_exact(launched, layout):
    model_dirs, out_root, results = launched
    name = _layout_name(*layout)
    logits = [r[name] for r in results if r[name] is not None]
    assert logits, "some rank (last stage, TP rank 0) reports logits"
    reference = _hf_logits(model_dirs[layout[0]])
    for got in logits:
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    original, exported = _tensors(model_dirs[layout[0]]), _tensors(out_root / name)
    assert sorted(exported) == sorted(original)
    for tensor_name, tensor in original.items():
        assert exported[tensor_name].dtype == tensor.dtype and torch.equal(exported[tensor_name], tensor), tensor_name


@pytest.mark.slow
def test_qwen3_moe_grpo_step_at_ep2_equals_ep1(launched):
    model_dirs, out_root, results = launched
    ep1, ep2 = [[r[f"step-ep{ep}"] for r in results] for ep in STEP_LAYOUTS]
    assert sum(r["loss"] for r in ep2) == pytest.approx(sum(r["loss"] for r in ep1), rel=1e-5)
    assert ep2[0]["grad_norm"] == pytest.approx(ep1[0]["grad_norm"], rel=1e-5)
    before, after1, after2 = (_tensors(d) for d in (model_dirs["qwen3_moe"], out_root / "step-ep1", out_root / "step-ep2"))
    assert sorted(after2) == sorted(after1) == sorted(before)
    moved = [n for n in before if not torch.equal(before[n], after1[n])]
    assert any(".mlp.gate." in n for n in moved) and any(".experts.3." in n for n in moved), "router and experts train"
    for name, weight in after1.items():
        torch.testing.assert_close(after2[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
