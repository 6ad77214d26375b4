"""Which megatron-core features the model families need build and train on Megatron's local (non-TE)
layer spec on this machine: one tiny GPTModel per feature (2 layers, hidden 64), a forward and a backward, and the
first line of the error where one fails. Prints one `OK` / `FAIL` line per feature; writes nothing.

    python -m benchmarks.megatron_features

Measured with megatron-core 0.16.1 on CPU (README "Model families"): sliding-window attention (also alternating),
learnable-softmax attention sinks, the clamped SwiGLU with the +1 linear offset, sigmoid routing with expert bias,
group-limited top-k and scaling, shared experts, dense first layers (`moe_layer_freq`) and partial rotary build and
train; expert biases fail in the backward (SequentialMLP's in-place bias add on a view of the TP reduction; with the
experts' fc2 output copied they train: the policy's GPT-OSS spec carries that fix, engine/models/gpt_oss.py) and the
local MLA spec fails to build (`DotProductAttention` has no `k_channels`). Megatron has no logit soft-capping, no
post-attention / post-MLP norms and no embedding scaling at all (Gemma 2 / 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_grouped_gemm=False,
           moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none")
MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16, kv_channels=16)
FEATURES = [  # (name, TransformerConfig keywords, GPTModel rotary_percent, how the layer spec is made)
    ("baseline dense", {}, 1.0, "layer"),
    ("sliding window (window_size=(8, 0)): GPT-OSS, Gemma, Cohere 2", {"window_size": (8, 0)}, 1.0, "layer"),
    ("alternating sliding / full (window_attn_skip_freq=2)", {"window_size": (8, 0), "window_attn_skip_freq": 2},
     1.0, "layer"),
    ("attention sinks (softmax_type='learnable'): GPT-OSS", {"softmax_type": "learnable"}, 1.0, "layer"),
    ("clamped SwiGLU (clamp 7, glu_linear_offset 1): GPT-OSS",
     {"activation_func_clamp_value": 7.0, "glu_linear_offset": 1.0}, 1.0, "layer"),
    ("linear biases, dense", {"add_bias_linear": True}, 1.0, "layer"),
    ("expert biases (add_bias_linear in MoE): GPT-OSS", {**MOE, "add_bias_linear": True}, 1.0, "layer"),
    ("expert biases, the experts' fc2 output copied (`_CopiedOutputRowParallel`): GPT-OSS",
     {**MOE, "add_bias_linear": True}, 1.0, "fc2_copy"),
    ("sigmoid routing + expert bias + 2 groups top-1 + scaling 2.5: GLM-4.5, DeepSeek-V3",
     {**MOE, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_num_groups": 2,
      "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5, "moe_router_pre_softmax": True}, 1.0, "layer"),
    ("shared experts: GLM-4.5, DeepSeek-V3", {**MOE, "moe_shared_expert_intermediate_size": 32}, 1.0, "layer"),
    ("dense first layer (moe_layer_freq=[0, 1]): GLM-4.5, DeepSeek-V3", {**MOE, "moe_layer_freq": [0, 1]}, 1.0,
     "block"),
    ("partial rotary (rotary_percent=0.5): GLM-4.5", {}, 0.5, "layer"),
    ("multi-latent attention (local MLA spec): DeepSeek-V3", MLA, 1.0, "mla"),
]


def _copied_output_row_parallel():
    """The policy's own fix (engine/models/gpt_oss.py `copied_output_row_parallel_class`) on Megatron's
    RowParallelLinear: its output copied when it returns a bias."""
    from megatron.core.tensor_parallel import RowParallelLinear

    from engine.models.gpt_oss import copied_output_row_parallel_class

    return copied_output_row_parallel_class(RowParallelLinear)


def _experts_fc2(spec, fc2):
    """The local MoE layer spec with the experts' linear_fc2 replaced."""
    import dataclasses

    mlp = spec.submodules.mlp
    experts = dataclasses.replace(mlp.submodules.experts, submodules=dataclasses.replace(
        mlp.submodules.experts.submodules, linear_fc2=fc2))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=dataclasses.replace(
        mlp, submodules=dataclasses.replace(mlp.submodules, experts=experts))))


def probe(name: str, extra: dict, rotary_percent: float, spec_kind: str) -> str:
    """One feature's line: OK with the logits' shape, or FAIL with the error's first 200 characters."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
                masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32)
    try:
        config = (MLATransformerConfig if spec_kind == "mla" else TransformerConfig)(**{**base, **extra})
        if spec_kind == "block":
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        else:
            spec = get_gpt_layer_local_spec(normalization="RMSNorm", num_experts=config.num_moe_experts,
                                            multi_latent_attention=spec_kind == "mla")
        if spec_kind == "fc2_copy":
            spec = _experts_fc2(spec, _copied_output_row_parallel())
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=64,
                         position_embedding_type="rope", rotary_percent=rotary_percent)
        tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))  # (b, s)
        causal = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), 1)
        logits = model(tokens, torch.arange(16).expand(2, 16), causal)  # (b, s, V)
        logits.float().sum().backward()
        return f"OK   {name}: forward + backward, logits {tuple(logits.shape)}"
    except Exception as error:  # noqa: BLE001 - the point is to report it
        return f"FAIL {name}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"


def main() -> None:
    from engine.config import ParallelConfig
    from engine.policy.moe_config import define_te_general_gemm
    from engine.policy.parallel import destroy_parallel, init_parallel

    init_parallel(ParallelConfig(), seed=0)
    define_te_general_gemm()
    try:
        for feature in FEATURES:
            print(probe(*feature), flush=True)
    finally:
        destroy_parallel()


if __name__ == "__main__":
    main()
