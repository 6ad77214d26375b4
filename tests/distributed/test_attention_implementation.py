"""`model.attention_implementation` (engine/policy/sdpa_attention.py): the local spec's core attention through torch's
scaled_dot_product_attention (`sdpa`, the default) or Megatron's DotProductAttention (`eager`).

On the tiny Qwen2 checkpoint (4 query heads, 2 key/value groups: grouped-query attention), fp32, at TP1 (one rank)
and TP2 (two ranks, one query group each):
(a) the setting acts: every layer's core attention is SDPACoreAttention under `sdpa` and DotProductAttention under
    `eager`, and the autograd graph of a training forward holds a fused attention node and no softmax node under
    `sdpa` (the (b x heads, s, s) probabilities are not kept for the backward), a softmax node under `eager`;
(b) the same mathematics: one GRPO optimizer step (tests/helpers/policy.py: DAPO, beta > 0, off-policy old
    log-probs, the distributed optimizer) gives the same loss and gradient norm (rel 1e-5) and the same updated
    weights (abs 1e-6) under both, with padded rows (causal: SDPA's is_causal) and with packed rows (the
    block-diagonal mask passed to SDPA).
The other layout and family tests (test_grpo_step_layouts.py, test_packing_layouts.py, test_family_layouts.py, the
HF-logits checks) run with the default, `sdpa`.
"""

import pytest
import torch

from engine.policy.microbatch import MicroBatch
from tests.distributed.launcher import run_distributed
from tests.helpers.policy import BATCH, SEQ, grpo_step_and_export, hf_tensors, tokens

IMPLEMENTATIONS = ("eager", "sdpa")


def _graph_names(tensor: torch.Tensor) -> set[str]:
    """The names of every autograd node behind `tensor`."""
    names, seen, todo = set(), set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def _attention_facts(model_dir: str, parallel, implementation: str) -> dict:
    """The layers' core attention classes and the attention nodes of a training forward's graph (no recompute)."""
    from engine.config import ModelConfig, TrainConfig
    from engine.policy.step import run_schedule, unwrap
    from tests.helpers.policy import build_from_hf

    ps, hf_config, chunks, _ = build_from_hf(model_dir, parallel,
                                             ModelConfig(dtype="float32", attention_implementation=implementation),
                                             train=TrainConfig(gradient_checkpointing=False))
    classes = {type(layer.self_attention.core_attention).__name__
               for chunk in chunks for layer in unwrap(chunk).decoder.layers}
    names: set[str] = set()

    def loss_fn(model, hidden, batch):
        names.update(_graph_names(hidden))
        return hidden.sum() * 0, {}

    batch = MicroBatch(tokens=tokens(hf_config.vocab_size), position_ids=torch.arange(SEQ).expand(BATCH, SEQ))
    run_schedule(chunks, ps, [batch], loss_fn, forward_only=False)
    return {"classes": sorted(classes), "fused": any("ScaledDotProduct" in n for n in names),
            "softmax": any("Softmax" in n for n in names)}


def _compare(tp: int, model_dir: str, out_root: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel

    parallel = ParallelConfig(tp_size=tp)
    results = {}
    for implementation in IMPLEMENTATIONS:
        results[f"{implementation}_facts"] = _attention_facts(model_dir, parallel, implementation)
        destroy_parallel(keep_process_group=True)
        for packed in (False, True):
            name = f"{implementation}_{'packed' if packed else 'padded'}"
            results[name] = grpo_step_and_export(
                model_dir, parallel, ModelConfig(dtype="float32", attention_implementation=implementation),
                f"{out_root}/{name}", padding_free=packed)
            destroy_parallel(keep_process_group=True)
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("attention") / "qwen2", "qwen2", seed=5)


@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_and_eager_attention_give_the_same_step_and_sdpa_keeps_no_probabilities(model_dir, tmp_path, tp):
    results = run_distributed(_compare, tp, tp, str(model_dir), str(tmp_path))[0]
    assert results["sdpa_facts"] == {"classes": ["SDPACoreAttention"], "fused": True, "softmax": False}
    assert results["eager_facts"] == {"classes": ["DotProductAttention"], "fused": False, "softmax": True}
    for rows in ("padded", "packed"):
        eager, sdpa = results[f"eager_{rows}"], results[f"sdpa_{rows}"]
        assert sdpa["loss"] == pytest.approx(eager["loss"], rel=1e-5), rows
        assert sdpa["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-5), rows
        before = hf_tensors(model_dir)
        weights, reference = hf_tensors(tmp_path / f"sdpa_{rows}"), hf_tensors(tmp_path / f"eager_{rows}")
        assert sorted(weights) == sorted(reference)
        for name, weight in weights.items():
            torch.testing.assert_close(weight, reference[name], rtol=0, atol=1e-6, msg=f"{rows}: {name}")
        assert any(not torch.equal(weights[n], before[n]) for n in weights if "self_attn.q_proj" in n), \
            f"{rows}: the step did not move the attention weights"


def test_eager_attention_with_transformer_engine_is_refused():
    from engine.config import ModelConfig
    from engine.policy.model import _layer_spec

    with pytest.raises(ValueError, match="attention_implementation=eager acts on Megatron's local spec only"):
        _layer_spec(ModelConfig(transformer_impl="transformer_engine", attention_implementation="eager"))


def test_auto_keeps_a_layers_own_attention_and_an_explicit_sdpa_there_is_refused():
    """`auto` (the default) swaps SDPA in for Megatron's plain attention only; where the layer keeps its own (a
    sliding window here; Gemma's, GPT-OSS's, Transformer Engine's core attention alike) an explicit `sdpa` would
    have no effect and is refused, naming why; `eager` never swaps."""
    import dataclasses
    from types import SimpleNamespace

    from engine.config import ModelConfig
    from engine.policy.model import _layer_spec
    from engine.policy.sdpa_attention import attention_specs as _attention_specs
    from engine.policy.sdpa_attention import sdpa_core_attention_class

    spec = _layer_spec(ModelConfig(transformer_impl="local"))
    core = lambda s: s.submodules.self_attention.submodules.core_attention  # noqa: E731
    plain, windowed = SimpleNamespace(window_size=None), SimpleNamespace(window_size=(4, 0))
    for implementation in ("auto", "sdpa"):
        assert core(_attention_specs(spec, None, plain, implementation, "qwen2")[0]) is sdpa_core_attention_class()
    assert _attention_specs(spec, None, plain, "eager", "qwen2")[0] is spec
    assert _attention_specs(spec, None, windowed, "auto", "gemma3_text")[0] is spec
    with pytest.raises(ValueError, match=r"sdpa cannot act on this gemma3_text model: the sliding window \(4, 0\)"):
        _attention_specs(spec, None, windowed, "sdpa", "gemma3_text")
    own = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(
        spec.submodules.self_attention, submodules=dataclasses.replace(
            spec.submodules.self_attention.submodules, core_attention=SimpleNamespace))))
    assert _attention_specs(own, None, plain, "auto", "gpt_oss")[0] is own
    with pytest.raises(ValueError, match="its own core attention"):
        _attention_specs(own, None, plain, "sdpa", "gpt_oss")
