"""Cohere 2 (HF `cohere2`, Cohere2ForCausalLM: Command R7B / Command A): what the engine needs to know about its HF
config, without torch or Megatron.

Owns: `check_cohere2` (the settings refused, each naming the cause: attention bias, layer types other than sliding /
full attention, RoPE other than default, a logit_scale <= 0, untied embeddings), `cohere2_transformer_settings`
(TransformerConfig fields: the bias-free LayerNorm's epsilon, interleaved RoPE, the sliding window and which layers
use it) and `COHERE2_NORM_NAMES` (its one norm per layer). The Megatron modules (the parallel attention + MLP layer,
the LayerNorm) are in engine/models/cohere2/layers.py; the final logits x `logit_scale` are applied where the LM
head's logits are made (engine/policy/step.py, engine/api/trl_compat.py: the kernel's temperature divided by it).

Must not: import torch, Megatron or vLLM (engine/models/families.py, read by the planner, calls `check_cohere2`).

Test: tests/unit/test_families.py (refusals), tests/distributed/test_family_layouts.py (logits = HF at TP1 and TP2 +
SP, log-probs through the LM-head kernel; export byte-exact; GRPO step at TP2 + SP = TP1).
"""

from __future__ import annotations

from engine.models.family_spec import FamilySpec, planner_shape, sliding_window_dims

COHERE2_MODEL_TYPES = ("cohere2",)
"""Cohere families the policy builds: one bias-free LayerNorm per layer feeding attention and MLP in parallel
(h = x + attn(ln(x)) + mlp(ln(x))), RoPE (interleaved pairs) on the sliding-window layers only, the global layers
without position encoding, the logits x `logit_scale`, tied embeddings."""

def check_cohere2(hf_config) -> None:
    """Refuse the Cohere 2 settings the translation would not reproduce.

    Raises:
        ValueError naming `model.name_or_path`, the setting and its value.
    """
    prefix = f"model.name_or_path: {hf_config.model_type}"
    if getattr(hf_config, "attention_bias", False):
        raise ValueError(f"{prefix} with attention_bias=true: not translated (Cohere 2's checkpoints have no "
                         "attention bias)")
    kinds = set(hf_config.layer_types)
    if not kinds <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"{prefix} with layer_types {sorted(kinds)}: only sliding_attention and full_attention are "
                         "supported")
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{prefix} with rope_parameters {rope}: only the default RoPE on the whole head is supported")
    scale = getattr(hf_config, "logit_scale", None)
    if scale is None or not scale > 0:
        raise ValueError(f"{prefix} with logit_scale={scale}: the logits are multiplied by it, it must be > 0 "
                         "(Command R7B ships 0.25)")
    if not hf_config.tie_word_embeddings:
        raise ValueError(f"{prefix} with tie_word_embeddings=false: vLLM's Cohere 2 (commandr.py) always multiplies "
                         "by the input embedding, so an untied LM head would never reach the rollout; only tied "
                         "embeddings (Cohere 2's own) are supported")


def cohere2_transformer_settings(hf_config) -> dict:
    """TransformerConfig fields that differ for Cohere 2: LayerNorm (its weight only: engine/models/cohere2/layers.py)
    with `layer_norm_eps`, RoPE on interleaved pairs (HF's cohere `rotate_half`: (x0, x1), (x2, x3), ...) and the
    sliding window of `sliding_window` tokens (HF: a query sees the keys less than `sliding_window` positions back;
    Megatron's `window_size` (sliding_window - 1, 0)) on the layers `layer_types` names `sliding_attention`
    (`window_attn_skip_freq` as a per-layer 0 / 1 list)."""
    return dict(
        normalization="LayerNorm",
        layernorm_epsilon=float(hf_config.layer_norm_eps),
        rotary_interleaved=True,
        window_size=(int(hf_config.sliding_window) - 1, 0),
        window_attn_skip_freq=[int(t == "sliding_attention") for t in hf_config.layer_types],
    )


TINY_COHERE2_LOGIT_SCALE, TINY_COHERE2_WINDOW = 0.25, 4
"""The tiny Cohere 2's logits x 0.25 (Command R7B's own; HF's default 0.0625) and its sliding window of 4 tokens
(shorter than the tests' 12-token rows, so the window masks)."""


def tiny_config(model_type: str, common: dict, moe_layers: bool) -> dict:
    """Cohere 2's architecture at the tiny shapes: layers sliding, full, sliding, full (each PP2 stage holds one of
    each; HF's default pattern is 3 sliding then 1 full) with a window of `TINY_COHERE2_WINDOW` tokens, RoPE
    (interleaved pairs, base 1e4) on the sliding layers only, one bias-free LayerNorm (eps 1e-5) per layer feeding
    attention and the SwiGLU MLP in parallel, logits x `TINY_COHERE2_LOGIT_SCALE`, tied embeddings (Cohere 2's own;
    `tie_word_embeddings` is ignored)."""
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "rms_norm_eps", "tie_word_embeddings")}
    return dict(**common, layer_norm_eps=1e-5, logit_scale=TINY_COHERE2_LOGIT_SCALE, tie_word_embeddings=True,
                sliding_window=TINY_COHERE2_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                rope_parameters={"rope_type": "default", "rope_theta": 1e4}, attention_bias=False)


def randomise_tiny_inits(model) -> None:
    """The LayerNorm weights 1 + N(0, 0.1^2), where HF initialises ones."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))


def layer_spec(spec, row_parallel, hf_config):
    """Cohere 2's parallel attention / MLP layer (engine/models/cohere2/layers.py `cohere2_layer_spec`)."""
    from engine.models.cohere2.layers import cohere2_layer_spec

    return cohere2_layer_spec(spec)


def finish_policy_chunk(chunk, hf_config) -> None:
    """The final logits x `logit_scale` (read where the LM head's logits are computed)."""
    chunk.logit_scale = float(hf_config.logit_scale)


def finish_transformer_config(config, hf_config, tp_size: int, pp_size: int):
    """`cohere2_transformer_settings`: its LayerNorm's epsilon, interleaved RoPE, the sliding window."""
    import dataclasses

    return dataclasses.replace(config, **cohere2_transformer_settings(hf_config))


def vllm_hf_overrides(model_dir) -> dict:
    """vLLM's `hf_overrides` for the checkpoint in `model_dir`: {"sliding_window": sliding_window - 1} for a Cohere 2
    with a sliding window, {} otherwise (or when the directory holds no config.json, e.g. a hub name vLLM resolves).

    vLLM 0.32's Cohere 2 attention (models/commandr.py) gives its sliding layers a window of `sliding_window + 1`
    tokens; transformers' Cohere2 and the trainer mask keys `sliding_window` or more positions back. Started with
    `sliding_window - 1`, vLLM attends over exactly the trainer's window. Measured on the tiny Cohere 2 (window 4,
    fp32): engine vs trainer log-probs 0.028 apart without the override, within the sync test's 1e-3 with it."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    if config.get("model_type") not in COHERE2_MODEL_TYPES or not config.get("sliding_window"):
        return {}
    return {"sliding_window": int(config["sliding_window"]) - 1}


PLANNER_MODELS = {
    "builtin:tiny-cohere2": planner_shape(128, 4, 4, 2, 352, 400, True, False, norms_per_layer=1, sliding_window=4,
                                          sliding_layers=2),
}
"""The planner's shape of the tiny Cohere 2."""


SPEC = FamilySpec(planner_models=PLANNER_MODELS, name="cohere2", model_types=COHERE2_MODEL_TYPES, check=check_cohere2,
                  norm_eps_field="layer_norm_eps", finish_transformer_config=finish_transformer_config,
                  planner_dims=lambda values: {"norms_per_layer": 1, **sliding_window_dims(values)},
                  ties_embeddings_by_default=True, converter_dims=lambda hf_config: {"parallel_block": True},
                  layer_spec=layer_spec, finish_policy_chunk=finish_policy_chunk,
                  local_spec_only="its norms, layer and sliding-window attention are project modules",
                  vllm_engine_kwargs=lambda model_dir, dtype, on_gpu: {"hf_overrides": vllm_hf_overrides(model_dir)},
                  tiny_config=tiny_config, randomise_tiny_inits=randomise_tiny_inits)
