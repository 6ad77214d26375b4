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
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedTokenizerFast

from engine.models.families import SUPPORTED_MODEL_TYPES, family_spec
from engine.models.family_spec import TINY_QWEN3_HEAD_DIM  # noqa: F401 (the tests' name for the tiny head_dim field)

TINY_FAMILIES = SUPPORTED_MODEL_TYPES
"""Architectures the factory builds (every family's model_types; each family's folder holds its tiny config);
`builtin:tiny-<family>` names one of them."""

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
"""`CHAT_TEMPLATE` that also renders tools (the builtin models keep `CHAT_TEMPLATE`, which refuses the
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

    Shapes every family shares (`common`, which the family's own `tiny_config` adapts: engine/models/<family>/):
    hidden 128, 4 layers, 4 query heads and 2 KV heads of head_dim 32 (= 128 / 4; vLLM's CPU attention refuses
    head_dim < 32; a family with a head_dim field may take another), GQA ratio 2, MLP 352, vocabulary
    `TINY_VOCAB_SIZE` = 400. 400 is deliberately not a multiple of 128 (400 = 3 * 128 + 16), so Megatron's vocab
    padding (to 512 at make_vocab_size_divisible_by=128) and vLLM's per-rank padding are exercised. 841,856
    parameters (the untied default): building one takes ~0.2 s once transformers is imported.

    Args:
        family: one of `TINY_FAMILIES` (a model_type); its family's spec says what differs from the shared shapes.
        vocab_size: embedding rows; None = the tokenizer's size (`TINY_VOCAB_SIZE`). A larger value leaves rows no
            token maps to (as real checkpoints do); a smaller one is refused.
        tie_word_embeddings: share the input embedding with the LM head (a family whose checkpoints are always tied
            or untied ignores it).
        moe_layers: the variant with MoE layers of a family whose MoE layers are optional (`has_moe_layer_variant`).

    Returns:
        The model_type's transformers config: the shared shapes, 1024 positions, RoPE theta 1e4, RMSNorm eps 1e-6,
        SiLU, no dropout, float32, special-token ids from the tokenizer, as the family adapts them.
    """
    _check_family(family)
    tokenizer = build_tiny_tokenizer()
    tokenizer_vocab_size = len(tokenizer)
    if moe_layers and not family_spec(family).has_moe_layer_variant:
        raise ValueError(f"moe_layers=True is the variant of a family with optional MoE layers, not {family!r}'s")
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
    return AutoConfig.for_model(family, **family_spec(family).tiny_config(family, common, moe_layers))


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
        family_spec(family).randomise_tiny_inits(model)
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
