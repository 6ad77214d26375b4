"""The Megatron-core policy: a GPTModel built from a Hugging Face config, at any TP x PP (x virtual PP) layout.

Owns: the translation of a Qwen2 / Llama / Qwen3 / Qwen3-MoE / Mixtral / GLM-4.5 MoE / GPT-OSS (its own keywords,
spec pieces and YaRN: engine/models/gpt_oss/) / DeepSeek-V3 (GLM-4.5's MoE + MLA: engine/models/deepseek_v3/) /
Nemotron-H (one mixer per layer, the Mamba-2 one the project's: engine/models/nemotron_h/layers.py) HF config into
Megatron's `TransformerConfig` (`build_transformer_config`: what it translates, and activation
recompute; dropout: `dropout_settings`; MoE router and experts with expert parallelism, GLM-4.5's / DeepSeek-V3's
router, shared expert and dense first layers: engine/policy/moe_config.py; the families refused and what they lack:
engine/models/families.py), the layer spec choice (`_layer_spec`, per layer: `_decoder_spec`; the fused norm /
activation / RoPE modules: `_layer_kernel_specs`, engine/policy/fused_layers.py), `build_policy`, the
weights that are buffers (`WEIGHT_BUFFERS`: GLM's frozen expert bias), and the rule
that takes a global tensor to this rank's TP shard (`take_tp_shard`; Mamba-2's unequal row blocks: `partition_blocks`),
which checkpoint conversion reuses.

Must not: read Megatron's global parallel state (it receives a ParallelState), or know vLLM's layout.

Test: tests/distributed/test_megatron_layouts.py (forward + backward at TP=2, PP=2, TP=2 x PP=2 equal to TP=1),
tests/distributed/test_qwen3_layouts.py (Qwen3 and Qwen3-MoE logits = HF at TP / PP / EP layouts, GRPO step at EP2
and TP2 x EP2 with sequence parallelism = EP1), tests/distributed/test_family_layouts.py (the same for Mixtral,
GLM-4.5 MoE and GPT-OSS), tests/distributed/test_grpo_step_layouts.py (TP2 with sequence
parallelism too; also: no "tp_group is None" fallback warning from Megatron; and the step with full recompute equals
the step without it, bit for bit, at TP2 and PP2), tests/unit/test_recompute.py (settings to Megatron's fields).
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import ModelConfig, TrainConfig
from engine.models.families import (
    MOE_MODEL_TYPES,
    check_model_type,
    family_spec,
    has_qk_norm,
    has_qkv_bias,
)
from engine.policy.moe_config import freeze_expert_bias, mark_expert_params, moe_settings
from engine.policy.parallel import ParallelState
from engine.policy.sdpa_attention import attention_specs
from engine.recompute import resolve_recompute


@dataclass(frozen=True)
class PolicyShape:
    """What the rest of the engine needs to know about the model, independent of the layout."""

    vocab_size: int
    """The tokenizer's vocabulary (HF config vocab_size)."""
    padded_vocab_size: int
    """Rows of the embedding / LM head after Megatron's padding; rows >= vocab_size are never sampled."""
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool


def padded_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's rule: pad to a multiple of divisible_by * tp_size (Qwen2.5's 151936: 151936 at TP1, 152576 at TP8)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def build_transformer_config(hf_config, cfg: ModelConfig, ps: ParallelState, train: TrainConfig | None = None):
    """Megatron TransformerConfig equivalent to a Hugging Face config of any family of the registry.

    Translates the Llama-shaped model (GQA, QKV bias, per-head q/k RMSNorm, SwiGLU, RMSNorm, RoPE theta, tied or
    untied embeddings, the vocabulary padded for TP, dropout and MoE), then what the family's spec says differs
    (engine/models/<family>/: its `transformer_settings` override keywords, its `finish_transformer_config` finishes
    the config); and Megatron's activation recompute from the `train` section
    (`train.gradient_checkpointing` and `recompute_*`, resolved and checked against the layers by
    engine.recompute.resolve_recompute; MoE routers replay their forward's routes in the recomputed forward:
    engine/policy/routing_replay.py).

    Args:
        hf_config: transformers PretrainedConfig (model_type in SUPPORTED_MODEL_TYPES).
        cfg: the `model` config section.
        ps: this process's parallel state.
        train: the `train` section, for the activation recompute (`gradient_checkpointing`, `recompute_*`:
            engine.recompute.resolve_recompute); None = its defaults (TRL's: full recompute, uniform, 1 layer).
    Returns:
        megatron.core.transformer.TransformerConfig.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_model_type(hf_config)
    family = family_spec(hf_config.model_type)
    num_layers = hf_config.num_hidden_layers
    chunks = ps.pp_size * (ps.vpp_size or 1)
    if num_layers % chunks:
        raise ValueError(
            f"num_hidden_layers={num_layers} is not divisible by pp_size*virtual_pipeline_size = "
            f"{ps.pp_size}*{ps.vpp_size or 1} = {chunks}"
        )
    heads, groups = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % ps.tp_size or groups % ps.tp_size:
        raise ValueError(
            f"num_attention_heads={heads} and num_key_value_heads={groups} must both be divisible by "
            f"tp_size={ps.tp_size}"
        )
    dtype = _dtype(cfg.dtype)
    on_cpu = not torch.cuda.is_available()
    # NOTE: Megatron's fused RoPE needs Transformer Engine and its fused softmax apex's `scaled_masked_softmax_cuda`;
    # on a GPU without them Megatron refuses the config (RoPE) or fails at the first forward (softmax, seq <= 4096).
    from importlib.util import find_spec

    has_te, has_softmax_kernel = (find_spec(name) is not None for name in ("transformer_engine",
                                                                         "scaled_masked_softmax_cuda"))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    recompute = resolve_recompute(train or TrainConfig(), num_layers, chunks, hf_config.model_type in MOE_MODEL_TYPES)
    if "layernorm" in recompute.modules and not has_te:
        raise ValueError(
            "train.recompute_modules: 'layernorm' needs Transformer Engine: megatron-core 0.16.1's "
            "CheckpointWithoutOutput (the norms' recompute) reads `fp8 is not None`, true for its default fp8=False, "
            "and then calls Transformer Engine's FP8GlobalStateManager (NameError without it)")
    settings = family.transformer_settings(hf_config)  # e.g. GPT-OSS's sinks and windows, DeepSeek-V3's MLA
    mla = settings.get("multi_latent_attention", False)
    config = (MLATransformerConfig if mla else TransformerConfig)(**{**dict(
        num_layers=num_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=getattr(hf_config, family.norm_eps_field),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        qk_layernorm=has_qk_norm(hf_config),
        **dropout_settings(hf_config, cfg),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=ps.tp_size,
        pipeline_model_parallel_size=ps.pp_size,
        virtual_pipeline_model_parallel_size=ps.vpp_size,
        sequence_parallel=ps.sequence_parallel,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        attention_softmax_in_fp32=True,
        **recompute.megatron_kwargs(),
        # CPU: Megatron's fused kernels and CUDA initialisation are unavailable.
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=not on_cpu,
        masked_softmax_fusion=not on_cpu and has_softmax_kernel,
        bias_dropout_fusion=not on_cpu,
        apply_rope_fusion=not on_cpu and has_te,
        persist_layer_norm=not on_cpu,
        **moe_settings(hf_config, cfg, ps),
    ), **settings})
    return family.finish_transformer_config(config, hf_config, ps.tp_size, ps.pp_size)


def dropout_settings(hf_config, cfg: ModelConfig) -> dict:
    """TransformerConfig's dropout probabilities: the Hugging Face config's own (`attention_dropout`; `hidden_dropout`
    where the family has one, Qwen2 / Llama / Qwen3 have not: 0), or 0 for both with `model.disable_dropout` (TRL's
    name and default False). Dropout acts in training forwards only: the old-log-prob, reference and weight-sync
    probe forwards run in eval mode (engine/policy/step.py `forward_logprobs`)."""
    if cfg.disable_dropout:
        return {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    return {"hidden_dropout": float(getattr(hf_config, "hidden_dropout", 0.0) or 0.0),
            "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0)}


def rope_settings(hf_config) -> dict:
    """GPTModel's RoPE keyword arguments for an HF config; refuses RoPE variants Megatron would not reproduce.

    transformers >= 5 keeps theta in `rope_parameters` (a missing `rope_theta` attribute must not silently become
    Megatron's default 10000: Qwen2.5 uses 1e6), and GLM-4.5's `partial_rotary_factor` there too. Llama-3.1's
    `llama3` scaling maps to Megatron's `rope_scaling`,
    whose low/high frequency factors and original length are fixed at 1, 4 and 8192.
    """
    hook = family_spec(hf_config.model_type).rope_settings  # e.g. YaRN, MLA's own RoPE, none, one per layer type
    if hook is not None and (settings := hook(hf_config)) is not None:
        return settings
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"{hf_config.model_type} config has no rope_theta (looked in rope_parameters and rope_theta)")
    rope_type = params.get("rope_type", "default")
    partial = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))
    if rope_type == "default":  # GLM-4.5: RoPE on the first half of each head (Megatron's rotary_percent, HF's order)
        return {"rotary_base": float(theta), **({"rotary_percent": partial} if partial != 1.0 else {})}
    if partial != 1.0:
        raise ValueError(f"RoPE {params} with partial_rotary_factor={partial}: only the default RoPE is supported")
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if rope_type == "llama3" and all(float(params.get(k, -1)) == v for k, v in fixed.items()):
        return {"rotary_base": float(theta), "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise ValueError(f"RoPE {params} is not supported: only the default RoPE and llama3 scaling with {fixed}")


def _layer_spec(cfg: ModelConfig, qk_layernorm: bool = False, num_experts: int | None = None, mla: bool = False):
    """Transformer Engine's layer spec when it imports, Megatron's local spec otherwise, whose row-parallel linears
    are swapped through the ModuleSpec for ones that pass their own TP group on (`_row_parallel_linear_class`), and
    whose norms are ones that allow sequence parallelism (`LocalRMSNorm`; MLA's latent norms too: `mla`)."""
    impl = cfg.transformer_impl
    if impl == "auto":
        try:
            import transformer_engine  # noqa: F401

            impl = "transformer_engine"
        except ImportError:
            impl = "local"
    if impl == "transformer_engine":
        if cfg.attention_implementation == "eager":
            raise ValueError("model.attention_implementation=eager acts on Megatron's local spec only; Transformer "
                             "Engine's spec has its own fused attention: set model.transformer_impl: local")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                                          multi_latent_attention=mla)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm, num_experts=num_experts,
                                    multi_latent_attention=mla)
    row_parallel, norm = _row_parallel_linear_class(), LocalRMSNorm
    layer = spec.submodules
    qk_norms = {"q_layernorm": norm, ("kv_" if mla else "k_") + "layernorm": norm} if qk_layernorm or mla else {}
    attention = dataclasses.replace(layer.self_attention, submodules=dataclasses.replace(
        layer.self_attention.submodules, linear_proj=row_parallel, **qk_norms))
    if num_experts:  # MoELayer: the experts' SequentialMLP and the shared expert's MLP hold row-parallel fc2s
        experts, shared = layer.mlp.submodules.experts, layer.mlp.submodules.shared_experts
        experts = dataclasses.replace(experts, submodules=dataclasses.replace(experts.submodules,
                                                                              linear_fc2=row_parallel))
        shared = dataclasses.replace(shared, submodules=dataclasses.replace(shared.submodules, linear_fc2=row_parallel))
        mlp = dataclasses.replace(layer.mlp, submodules=dataclasses.replace(layer.mlp.submodules, experts=experts,
                                                                            shared_experts=shared))
    else:
        mlp = dataclasses.replace(layer.mlp, submodules=dataclasses.replace(layer.mlp.submodules,
                                                                            linear_fc2=row_parallel))
    return dataclasses.replace(spec, submodules=dataclasses.replace(
        layer, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=attention, mlp=mlp))


class LocalRMSNorm:
    """The local spec's RMSNorm, usable with sequence parallelism (`LocalRMSNorm(config, hidden_size, eps)` builds a
    `torch.nn.RMSNorm`).

    NOTE: megatron-core 0.16.1's `WrappedTorchNorm` (transformer/torch_norm.py, the local spec's norm and the final
    norm of a TransformerBlock without TE or apex) asserts `not config.sequence_parallel` ("sequence parallel not
    supported by torch LayerNorm"): that is the only reason the local spec refused SP. Under SP a norm sees s / tp
    tokens per TP rank, so its weight gradient is partial and must be summed over the TP group; Megatron's
    `finalize_model_grads` does that for every parameter marked `sequence_parallel` (TE's and apex's norms mark
    theirs). This is the same `torch.nn.RMSNorm` with that mark. Qwen3's q/k norms get it too (harmless: they see
    every token of their heads and are summed over TP by name, `qk_layernorm`, marked or not).
    """

    local_spec_norm = True
    """A norm of Megatron's local spec (engine/policy/model.py builds its blocks and fused swaps around it)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _layer_kernel_specs(spec, dense_spec, per_layer, config, cfg: ModelConfig, hf_config):
    """The specs with the fused norm / activation / RoPE modules of engine/policy/fused_layers.py when
    `model.layer_kernel_implementation` resolves to triton on the local spec; unchanged otherwise. An explicit
    `triton` that nothing could act on (Transformer Engine's spec, no swappable module) is refused."""
    from engine.policy.fused_layers import fused_layer_specs, use_layer_kernels

    implementation = cfg.layer_kernel_implementation
    if not use_layer_kernels(implementation):
        return spec, dense_spec, per_layer
    if not getattr(spec.submodules.input_layernorm, "local_spec_norm", False):
        if implementation == "triton":
            raise ValueError("model.layer_kernel_implementation=triton acts on Megatron's local spec only (Transformer "
                             "Engine's spec fuses its own norms and RoPE): set model.transformer_impl: local")
        return spec, dense_spec, per_layer
    family = family_spec(hf_config.model_type)
    rope_fusable = family.rope_fusable(hf_config) and not config.multi_latent_attention
    (spec, dense_spec, per_layer), applied = fused_layer_specs([spec, dense_spec, per_layer], config, rope_fusable,
                                                                  LocalRMSNorm, family.fused_modules and family.fused_modules())
    if not applied and implementation == "triton":
        raise ValueError(f"model.layer_kernel_implementation=triton cannot act on this {hf_config.model_type} model: "
                         "none of its norms, MLP activation or RoPE is one the fused kernels express")
    return spec, dense_spec, per_layer


def _decoder_spec(layer_spec, config, ps: ParallelState, vp_stage: int | None, dense_spec=None, per_layer=None):
    """GPTModel's decoder spec: the layer spec for Transformer Engine; for the local spec a TransformerBlock spec whose
    final norm is `LocalRMSNorm` too (a bare layer spec gets Megatron's `WrappedTorchNorm` there). With dense first
    layers (GLM-4.5's, `config.moe_layer_freq` 0) those layers get `dense_spec`, chosen by their global index; a hybrid
    stack (Nemotron-H) its `per_layer` specs."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else None
    norm = layer_spec.submodules.input_layernorm  # the local spec's: LocalRMSNorm, fused, or a family's own
    if not getattr(norm, "local_spec_norm", False):
        if pattern:
            raise ValueError("dense first layers (GLM-4.5's first_k_dense_replace) are built on the local spec only: "
                             "set model.transformer_impl: local")
        return layer_spec
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=ps.pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=ps.pp_rank)
    specs = [per_layer[offset + i] if per_layer else dense_spec if pattern and not pattern[offset + i] else layer_spec
             for i in range(num_layers)]
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=specs, layer_norm=norm))


def _check_local_spec(family, local: bool, hf_config) -> None:
    """Refuse Transformer Engine's spec for a family built on the local spec only (its spec's `local_spec_only`)."""
    if family.local_spec_only and not local:
        raise ValueError(f"{hf_config.model_type} is built on Megatron's local spec only ({family.local_spec_only}): "
                         "set model.transformer_impl: local")


def _row_parallel_linear_class():
    from megatron.core.tensor_parallel import RowParallelLinear

    class GroupedRowParallelLinear(RowParallelLinear):
        """Megatron's RowParallelLinear, handing its own TP group to the linear autograd function.

        NOTE: megatron-core 0.16's `RowParallelLinear.forward` passes `tp_group=None` to its linear function, which
        then looks up the global TP group and warns "tp_group is None, using default tp group" on every call
        (2 per layer per micro-batch: 32 lines per step of the 4-layer tiny model at 4 micro-batches). The group is
        only used there for sequence parallelism or the dgrad all-reduce, both off for a row-parallel layer, so
        passing `self.tp_group` (the layer's group from `pg_collection`) changes no number; it silences the
        warning and keeps the global parallel state out of the forward pass.
        """

        def _forward_impl(self, input, weight, *args, **kwargs):
            if kwargs.get("tp_group") is None:
                kwargs["tp_group"] = self.tp_group
            return super()._forward_impl(input, weight, *args, **kwargs)

    return GroupedRowParallelLinear


def policy_shape(hf_config, cfg: ModelConfig, tp_size: int) -> PolicyShape:
    """The layout-independent shape facts of a model (the first thing read from a config: its family is checked)."""
    check_model_type(hf_config)
    return PolicyShape(
        vocab_size=hf_config.vocab_size,
        padded_vocab_size=padded_vocab_size(hf_config.vocab_size, cfg.make_vocab_size_divisible_by, tp_size),
        hidden_size=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        tie_word_embeddings=bool(hf_config.tie_word_embeddings),
    )


def _policy_class():
    from megatron.core.models.gpt import GPTModel

    class PolicyGPTModel(GPTModel):
        """GPTModel whose last stage returns the final hidden states (s, b, H), after the final norm, not logits.

        The engine never materialises [tokens x vocab] logits through Megatron: log-probs come from the fused
        kernel (kernels/) applied to these hidden states and `lm_head_weight()`, this rank's vocab shard.
        Multi-token prediction is not supported.
        """

        final_logit_softcap: float | None = None
        """HF `final_logit_softcapping` (Gemma 2), set by `build_policy`: kernels/ and `lm_head_logits` cap by it."""
        logit_scale: float = 1.0
        """HF `logit_scale` (Cohere 2's logits x it), set by `build_policy`: engine/policy/step.py applies it."""

        def _postprocess(self, hidden_states, *args, **kwargs):
            return hidden_states

        def lm_head_weight(self) -> torch.Tensor:
            """(V_pad / tp, H): the output layer's shard, or the word embeddings' when they are tied."""
            if self.share_embeddings_and_output_weights:
                return self.shared_embedding_or_output_weight()
            return self.output_layer.weight

    return PolicyGPTModel


def build_policy(hf_config, cfg: ModelConfig, ps: ParallelState, train: TrainConfig | None = None
                 ) -> list[torch.nn.Module]:
    """Build this rank's model chunks (one per virtual pipeline stage) of a model of `SUPPORTED_MODEL_TYPES`.

    Args:
        hf_config: transformers PretrainedConfig.
        cfg: the `model` config section.
        ps: this process's parallel state.
        train: the `train` section (activation recompute, see `build_transformer_config`); None = its defaults.
    Returns:
        list of PolicyGPTModel chunks (GPTModel returning hidden states on the last stage), in virtual-stage
        order, weights randomly initialised (load a checkpoint or call `init_weights_by_name` next).
    """
    policy_class = _policy_class()
    config = build_transformer_config(hf_config, cfg, ps, train)
    shape = policy_shape(hf_config, cfg, ps.tp_size)
    mla = config.multi_latent_attention
    spec = _layer_spec(cfg, config.qk_layernorm, config.num_moe_experts, mla)
    family, local = family_spec(hf_config.model_type), spec.submodules.input_layernorm is LocalRMSNorm
    dense_spec = _layer_spec(cfg, config.qk_layernorm, mla=mla) if isinstance(config.moe_layer_freq, list) else None
    if family.layer_spec is not None:  # the family's own norms, layers or attention pieces
        _check_local_spec(family, local, hf_config)
        spec = family.layer_spec(spec, _row_parallel_linear_class(), hf_config)
    spec, dense_spec = attention_specs(spec, dense_spec, config, cfg.attention_implementation, hf_config.model_type,
                                       cfg.packed_attention_implementation)
    per_layer = None
    if family.local_layer_specs is not None:  # MLA's core attention keywords, a hybrid stack's mixers
        _check_local_spec(family, local, hf_config)
        if local:
            spec, dense_spec, per_layer = family.local_layer_specs(spec, dense_spec, _row_parallel_linear_class(),
                                                                   hf_config)
    spec, dense_spec, per_layer = _layer_kernel_specs(spec, dense_spec, per_layer, config, cfg, hf_config)
    num_chunks = ps.vpp_size or 1
    chunks = []
    for vp_stage in range(num_chunks):
        is_first = ps.is_first_stage and vp_stage == 0
        is_last = ps.is_last_stage and vp_stage == num_chunks - 1
        chunks.append(
            policy_class(
                config=config,
                transformer_layer_spec=_decoder_spec(spec, config, ps, vp_stage if ps.vpp_size else None, dense_spec,
                                                     per_layer),
                vocab_size=shape.padded_vocab_size,
                max_sequence_length=hf_config.max_position_embeddings,
                pre_process=is_first,
                post_process=is_last,
                parallel_output=True,
                share_embeddings_and_output_weights=shape.tie_word_embeddings,
                **{"position_embedding_type": "rope", **rope_settings(hf_config)},
                pg_collection=ps.groups,
                vp_stage=vp_stage if ps.vpp_size else None,
            )
        )
        chunks[-1].logit_scale = 1.0  # the LM head's logit multiplier; a family's finishing hook may set its own
        family.finish_policy_chunk(chunks[-1], hf_config)
        cast_params_to_dtype(chunks[-1], config.params_dtype)
        chunks[-1].final_logit_softcap = getattr(hf_config, "final_logit_softcapping", None)
        chunks[-1].hf_vocab_size = shape.vocab_size  # the rows an HF export keeps (engine/policy/lora.py)
        chunks[-1].routing_replay = bool(config.num_moe_experts) and cfg.moe_enable_routing_replay
        chunks[-1].hf_model_type = hf_config.model_type  # the HF layout adapters export to (engine/policy/lora.py)
    if config.moe_router_enable_expert_bias:
        freeze_expert_bias(chunks, config)
    mark_expert_params(chunks, ps)
    return chunks


@torch.no_grad()
def cast_params_to_dtype(chunk: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every floating-point parameter of a chunk the model's `params_dtype`.

    NOTE: Megatron's local layer spec builds its norms with `torch.nn.RMSNorm(hidden_size)`, whose weight is float32
    whatever `params_dtype` says, so a bf16 model came out mixed (bf16 linears, fp32 norms). Megatron's optimizers
    assume one model dtype: in bf16 they keep the fp32 norm weights in a separate group, and the sharded optimizer
    state then pairs parameters with the wrong states when it is saved (the distributed optimizer's
    `get_parameter_state_dp_zero` copied a (128,) norm state into the (256,) QKV-bias slot and failed; with equal
    shapes the pairing would be silently wrong). Megatron-LM itself casts the whole model (`Float16Module`:
    `module.bfloat16()`); Transformer Engine's norms take params_dtype. Casting the parameters here does the same
    for the local spec, and norms still compute in float32 inside torch's rms_norm.
    """
    for param in chunk.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def take_tp_shard(full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a global (TP=1 layout) tensor, following the parameter's Megatron partition attributes.

    A parameter split along `partition_dim` with `partition_stride` s holds, on rank r, chunk r of each of the s
    equal blocks of the global tensor: s=1 for QKV (whole query groups per rank), the vocabulary and row-parallel
    layers; s=2 for the fused SwiGLU fc1, whose shard is [gate_r; up_r].
    """
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    blocks = full.split(param.partition_blocks, dim=dim) if hasattr(param, "partition_blocks") else full.chunk(
        stride, dim=dim)  # Mamba-2's in_proj / conv: unequal blocks (engine/models/nemotron_h/layers.py)
    return torch.cat([block.chunk(tp_size, dim=dim)[tp_rank] for block in blocks], dim=dim)


WEIGHT_BUFFERS = (".router.expert_bias",)
"""Buffers that are weights of the checkpoint (GLM-4.5's frozen expert-score correction bias): loaded, exported and
synced with the parameters (`global_param_names`, `get_weight`), never trained."""


def named_weights(chunk: torch.nn.Module):
    """(name, tensor) of every parameter, then of every `WEIGHT_BUFFERS` buffer."""
    yield from chunk.named_parameters()
    yield from ((n, b) for n, b in chunk.named_buffers() if n.endswith(WEIGHT_BUFFERS))


def get_weight(chunk: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter, or weight buffer, of a `named_weights` name."""
    return chunk.get_buffer(name) if name.endswith(WEIGHT_BUFFERS) else chunk.get_parameter(name)


def global_param_names(chunk: torch.nn.Module) -> dict[str, str]:
    """Local name -> global name of every parameter and weight buffer (`named_weights`): the name it has in a TP=1,
    PP=1, EP=1 model (layer indices made global, and an MoE layer's `local_experts.<j>` made
    `local_experts.<global expert index>`)."""
    names = {}
    layers = getattr(getattr(chunk, "decoder", None), "layers", [])
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    for name, _ in named_weights(chunk):
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            local_layer = int(parts[2])
            parts[2] = str(offsets[local_layer])
            if parts[3:6] == ["mlp", "experts", "local_experts"]:
                parts[6] = str(layers[local_layer].mlp.local_expert_indices[int(parts[6])])
        names[name] = ".".join(parts)
    return names


@torch.no_grad()
def init_weights_by_name(chunks: list[torch.nn.Module], ps: ParallelState, seed: int, std: float = 0.02) -> None:
    """Deterministic init that depends only on each parameter's global name and shape, never on the layout.

    Every layout (TP, PP, virtual PP) then holds slices of the same global model, so its outputs must equal the
    single-process model's: what the distributed tests and random-weight benchmarks rely on. Norm weights are
    1 + noise, everything else N(0, std). Tied output layers on the last stage copy the word embeddings.
    """
    for chunk in chunks:
        global_names = global_param_names(chunk)
        for name, param in chunk.named_parameters():
            global_name = global_names[name]
            if global_name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
                global_name = "embedding.word_embeddings.weight"
            tp_rank, tp_size = (ps.etp_rank, ps.etp_size) if ".local_experts." in name else (ps.tp_rank, ps.tp_size)
            full_shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                full_shape[param.partition_dim] *= tp_size
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
            full = torch.randn(full_shape, generator=gen, dtype=torch.float32)
            full = 1.0 + 0.1 * full if "layernorm" in global_name or "norm.weight" in global_name else std * full
            param.copy_(take_tp_shard(full, param, tp_rank, tp_size).to(param.device, param.dtype))


def merge_tp_shards(shards: list[torch.Tensor], param: torch.nn.Parameter) -> torch.Tensor:
    """Inverse of `take_tp_shard`: the global tensor from every TP rank's shard (in TP-rank order)."""
    if not getattr(param, "tensor_model_parallel", False) or len(shards) == 1:
        return shards[0]
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    sizes = [size // len(shards) for size in getattr(param, "partition_blocks", ())]
    per_rank_blocks = [shard.split(sizes, dim=dim) if sizes else shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([torch.cat([blocks[s] for blocks in per_rank_blocks], dim=dim)
                      for s in range(len(per_rank_blocks[0]))], dim=dim)
