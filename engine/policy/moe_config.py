"""Megatron's MoE keywords for each MoE family, and what the build does to the routers afterwards.

Owns: `moe_settings` (TransformerConfig's router / expert / expert-parallel keywords from an HF config; {} for a dense
model), `sigmoid_router_settings` (the sigmoid group-limited router with the expert bias, shared expert and the
MoE layers a family's spec names: `moe_layer_freq`), `freeze_expert_bias` (the loaded expert bias kept as it is),
`mark_expert_params` (replicated experts reduced over the expert data-parallel group) and
`define_te_general_gemm` (a megatron-core 0.16.1 fix-up without Transformer Engine). engine/policy/model.py builds
the policy with these.

Must not: read Megatron's global parallel state (it receives a ParallelState), or know vLLM's layout.

Test: tests/unit/test_model_config.py (the keywords and refusals), tests/unit/test_families.py (GLM-4.5's router
settings Megatron computes differently are refused), tests/distributed/test_qwen3_layouts.py and
tests/distributed/test_family_layouts.py (MoE logits = HF and steps at EP layouts: these keywords acting; the
Nemotron-H MoE step at TP2 x EP1 + SP = TP1: `mark_expert_params`).
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.models.families import moe_shape, shared_expert_width, spec_or_default
from engine.policy.parallel import ParallelState


def moe_settings(hf_config, cfg: ModelConfig, ps: ParallelState) -> dict:
    """TransformerConfig's MoE keywords for a Qwen3-MoE, Mixtral or GLM-4.5 MoE config ({} for a dense model).

    Router, from the HF config: softmax scores over the routed experts, top `num_experts_per_tok`; HF's
    `norm_topk_prob=True` (softmax over all experts, top-k, renormalised; Mixtral always) is Megatron's default
    top-k-then-softmax (`moe_router_pre_softmax=False`: the same probabilities); `norm_topk_prob=False` is
    `pre_softmax=True`. Every layer is an MoE layer (Qwen3-MoE: `decoder_sparse_step=1`, no `mlp_only_layers`; other
    patterns are refused). Experts are Megatron's SequentialMLP (local spec) of each expert's width (`moe_shape`:
    Qwen3-MoE's `moe_intermediate_size`, Mixtral's `intermediate_size`), split over `parallel.ep_size` ranks (and
    `parallel.expert_tp_size`). Aux / z-loss coefficients come from the `model` section (`moe_aux_loss_coeff`,
    `moe_z_loss_coeff`); no token dropping (capacity None), as HF and vLLM. TP > 1 needs sequence parallelism
    (Megatron's MoELayer refuses to train without it; the local spec runs it too: `LocalRMSNorm`).
    GLM-4.5 MoE, DeepSeek-V3, Nemotron-H's MoE layers: `sigmoid_router_settings`.
    """
    experts, top_k, expert_ffn = moe_shape(hf_config)
    if not experts:
        if cfg.moe_aux_loss_coeff:  # as TRL refuses router_aux_loss_coef on a dense model
            raise ValueError(f"model.moe_aux_loss_coeff={cfg.moe_aux_loss_coeff} (TRL's router_aux_loss_coef) weights "
                             f"the MoE load-balancing loss, but model_type {hf_config.model_type!r} has no MoE layers: "
                             "set it to 0")
        return {}
    define_te_general_gemm()
    sparse_step, dense_only = getattr(hf_config, "decoder_sparse_step", 1), getattr(hf_config, "mlp_only_layers", [])
    if sparse_step != 1 or dense_only:
        raise ValueError(f"{hf_config.model_type} with decoder_sparse_step={sparse_step}, "
                         f"mlp_only_layers={dense_only}: only "
                         "every-layer MoE (step 1, no dense layers) is supported")
    if ps.tp_size > 1 and not ps.sequence_parallel:
        raise ValueError(f"{hf_config.model_type} at parallel.tp_size={ps.tp_size} needs "
                         "parallel.sequence_parallel=true: "
                         "megatron-core's MoELayer refuses to train MoE with TP > 1 without it (moe_layer.py forward)")
    if experts % ps.ep_size:
        raise ValueError(f"num_experts={experts} is not divisible by parallel.ep_size={ps.ep_size}")
    aux = cfg.moe_aux_loss_coeff
    if aux is None:
        aux = float(getattr(hf_config, "router_aux_loss_coef", 0.0))
    return {**dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=expert_ffn,
        moe_router_topk=top_k,
        moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", True)),
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if aux else "none",
        moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff,
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
        moe_grouped_gemm=False,
        # every MoE router gets a RouterReplay: replaying (R3) or recording for the router-agreement metric is chosen
        # per forward (engine/policy/routing_replay.py, from the chunk's `routing_replay`)
        moe_enable_routing_replay=True,
        expert_model_parallel_size=ps.ep_size,
        expert_tensor_parallel_size=ps.etp_size,
    ), **sigmoid_router_settings(hf_config)}


def sigmoid_router_settings(hf_config) -> dict:
    """The sigmoid group-limited router (GLM-4.5 MoE's, DeepSeek-V3's) and its layer pattern in TransformerConfig's
    keywords ({} for a family whose spec has no `moe_layer_freq`: the softmax router).

    Sigmoid scores in float32 (HF computes the router in float32); the top-k is chosen on scores + the expert-score
    correction bias (`e_score_correction_bias`, Megatron's `router.expert_bias` buffer, float32), within the
    `topk_group` best of `n_group` groups; the chosen experts' plain scores are renormalised and multiplied by
    `routed_scaling_factor`; a shared expert of `shared_expert_width` runs on every token; the first
    `first_k_dense_replace` layers are dense MLPs of `intermediate_size` (the spec's `moe_layer_freq`, built by
    `_decoder_spec`); the spec's `warn_unbuilt_layers` names checkpoint layers not built (GLM-4.5's MTP layers;
    DeepSeek-V3's are named in its `mla_settings`).

    The expert bias stays frozen (`freeze_expert_bias`): its update rule (aux-loss-free balancing: +/- a rate per
    step by each expert's token count) is a pre-training load-balancer; RL post-training keeps the routing the
    checkpoint was balanced with, so the policy, the frozen reference and vLLM route alike and routing replay replays
    the routes the engine chose. It is loaded, exported and synced like a weight (`global_param_names`).

    Nemotron-H's MoE ('E') layers route alike (HF NemotronHTopkRouter); `moe_layer_freq` marks its 'E' layers (the
    hybrid stack builds them: engine/models/nemotron_h/layers.py), its non-gated relu2 experts come from
    `nemotron_h_settings` (`gated_linear_unit=False`, squared ReLU, shared by experts and shared expert).
    """
    spec = spec_or_default(hf_config.model_type)
    if spec.moe_layer_freq is None:
        return {}
    freq = spec.moe_layer_freq(hf_config)
    spec.warn_unbuilt_layers(hf_config)
    groups = int(hf_config.n_group)
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_dtype="fp32",
        moe_router_enable_expert_bias=True,  # builds the buffer; its updates are switched off after the build
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=int(hf_config.topk_group) if groups > 1 else None,
        moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
        moe_shared_expert_intermediate_size=shared_expert_width(hf_config) or None,
        moe_layer_freq=freq,
    )


def define_te_general_gemm() -> None:
    """NOTE: megatron-core 0.16.1's MoE router (`moe_utils.RouterGatingLinearFunction`) tests `te_general_gemm is not
    None`, a name imported only when Transformer Engine imports: without TE the router fails with NameError. None is
    what the test expects without TE (torch.mm then computes the gating logits)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def freeze_expert_bias(chunks: list[torch.nn.Module], config) -> None:
    """Keep the routers' expert bias (GLM-4.5's) as loaded: no token counting in the forward, no update in
    `finalize_model_grads` (`sigmoid_router_settings` says why). The routers still add it to their scores.

    NOTE: megatron-core 0.16.1's token counting (`TopKRouter._apply_expert_bias`, training forwards) fails with the
    engine's MoE padding mask: `routing_map & ~padding_mask` broadcasts (tokens, E) against (tokens,).
    """
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "expert_bias", None) is not None:
                module.enable_expert_bias = False
    config.moe_router_enable_expert_bias = False  # finalize_model_grads reads it: neither counts reset nor updates


def mark_expert_params(chunks: list[torch.nn.Module], ps: ParallelState) -> None:
    """Mark every routed expert's parameters as expert-parallel (`allreduce=False`) where Megatron leaves them dense.

    NOTE: megatron-core 0.16.1 marks them only at expert_model_parallel_size > 1 (tensor_parallel/layers.py,
    moe/experts.py: `allreduce = not (is_expert and expert_parallel)`); unmarked, DDP reduces their gradients over
    the dense data-parallel group, and the optimizer keeps them with the dense weights. At ep_size 1 that group holds
    the same experts only where expert_tp_size = tp_size. At TP2 x EP1 with expert TP 1 (the defaults) each TP rank
    holds whole experts and, under sequence parallelism, gets their gradient from its own half of the tokens: the
    dense DP group (size 1) never summed the halves, and the experts' update differed from TP1's (the GRPO step's
    grad norm by rel 1.9e-5, expert weights by up to 1.8 x the learning rate). Marked, they are reduced over the
    expert data-parallel group (here both TP ranks) as at EP > 1.
    """
    if ps.ep_size > 1 or ps.etp_size == ps.tp_size:  # Megatron's own marks, or the dense group is the expert one
        return
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, BaseMoELayer):
                for param in module.experts.parameters():
                    param.allreduce = False
