"""`model.layer_kernel_implementation` (engine/policy/fused_layers.py): the local spec's RMSNorm, gated activation and
RoPE through the project's Triton kernels (interpreter here), against Megatron's unfused ops.

(a) the setting acts: under `triton` every swappable module is the fused one (the layers' norms, q/k norms, MLP and
    self-attention classes, the final norm), under `torch` none is;
(b) the same model: fp32 logits equal the unfused ones (1e-5) for Qwen3 (q/k norms), Gemma 3 (the (1 + w) norms,
    GeGLU, the sliding layers' own RoPE base), Cohere 2 (interleaved RoPE) and GLM-4.5 (partial RoPE, dense first
    layer + MoE);
(c) the same step: one GRPO optimizer step (tests/helpers/policy.py) with packed rows gives the same loss, gradient
    norm and updated weights as the unfused step, at TP1 and at TP2 with sequence parallelism;
(d) an explicit `triton` that cannot act (Transformer Engine's spec) is refused.
"""

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import grpo_step_and_export, hf_tensors, logits_and_export

FAMILIES = ("qwen3", "gemma3_text", "cohere2", "glm4_moe")


def _classes(model_dir: str, implementation: str) -> list[str]:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel
    from tests.helpers.policy import build_from_hf

    _, _, chunks, _ = build_from_hf(model_dir, ParallelConfig(), ModelConfig(
        dtype="float32", layer_kernel_implementation=implementation))
    names = set()
    for chunk in chunks:
        decoder = chunk.decoder
        names.add(type(decoder.final_layernorm).__name__)
        for layer in decoder.layers:
            attention = layer.self_attention
            names |= {type(m).__name__ for m in (layer.input_layernorm, attention, layer.mlp,
                                                 getattr(attention, "q_layernorm", None))}
    destroy_parallel(keep_process_group=True)
    return sorted(names - {"NoneType", "IdentityOp"})


def _logits(family_dir: str, out_root: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel

    results = {}
    for implementation in ("torch", "triton"):
        results[f"{implementation}_classes"] = _classes(family_dir, implementation)
        results[implementation] = logits_and_export(
            family_dir, ParallelConfig(), f"{out_root}/{implementation}",
            model_cfg=ModelConfig(dtype="float32", layer_kernel_implementation=implementation))
        destroy_parallel(keep_process_group=True)
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_layers_act_and_give_the_unfused_logits(tmp_path, family):
    from engine.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / family, family, seed=7)
    results = run_distributed(_logits, 1, str(model_dir), str(tmp_path))[0]
    fused, plain = results["triton_classes"], results["torch_classes"]
    assert not any(name.startswith("Fused") for name in plain), plain
    assert any(name.startswith("FusedRope") for name in fused), fused
    assert any(name.endswith("RMSNorm") and name.startswith("Fused") for name in fused) or family == "cohere2", fused
    if family != "glm4_moe":  # GLM's tiny model: the dense first layer's MLP; Cohere 2 keeps its LayerNorm
        assert "FusedGLUMLP" in fused, fused
    assert not torch.equal(results["triton"], torch.zeros_like(results["triton"]))
    torch.testing.assert_close(results["triton"], results["torch"], rtol=1e-5, atol=1e-5)


def _steps(tp: int, model_dir: str, out_root: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel

    parallel = ParallelConfig(tp_size=tp, sequence_parallel=tp > 1)
    results = {}
    for implementation in ("torch", "triton"):
        results[implementation] = grpo_step_and_export(
            model_dir, parallel, ModelConfig(dtype="float32", layer_kernel_implementation=implementation),
            f"{out_root}/{implementation}", padding_free=True, width_multiple=2)
        destroy_parallel(keep_process_group=True)
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_layers_give_the_unfused_grpo_step(tmp_path, tp):
    from engine.models.tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "qwen3", "qwen3", seed=5)
    results = run_distributed(_steps, tp, tp, str(model_dir), str(tmp_path))[0]
    plain, fused = results["torch"], results["triton"]
    assert fused["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert fused["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    before, weights, reference = (hf_tensors(d) for d in (model_dir, tmp_path / "triton", tmp_path / "torch"))
    for name, weight in weights.items():
        torch.testing.assert_close(weight, reference[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(weights[n], before[n]) for n in weights if "norm" in n), "norm weights did not move"


def test_triton_layer_kernels_with_transformer_engine_are_refused():
    from types import SimpleNamespace

    from engine.config import ModelConfig
    from engine.policy.model import _layer_kernel_specs

    te_spec = SimpleNamespace(submodules=SimpleNamespace(input_layernorm=object))
    with pytest.raises(ValueError, match="layer_kernel_implementation=triton acts on Megatron's local spec only"):
        _layer_kernel_specs(te_spec, None, None, None, ModelConfig(layer_kernel_implementation="triton"), None)
    assert _layer_kernel_specs(te_spec, None, None, None, ModelConfig(layer_kernel_implementation="torch"),
                               None)[0] is te_spec
