"""What a Hugging Face model directory must hold before anything is built from it, checked with errors that name
the directory, the file and the fix.

Owns: `resolve_model_dir` (the directory `model.name_or_path` names, for the trainer and the rollout server alike),
`check_model_dir` (config.json present and valid JSON, safetensors weights present: the single file or every
shard its index names; a tokenizer whose vocabulary fits the model's embedding rows) and `tokenizer_vocab_size`
(from tokenizer.json, without building a tokenizer).

Why: transformers and safetensors fail late or misleadingly on these: a directory without config.json gives
"Unrecognized model ... should have a model_type key", a missing shard a bare FileNotFoundError deep in a loader,
PyTorch `.bin` weights are never read here (no pickle), and a tokenizer with more tokens than the model has rows
(tokens added without resizing the embeddings) gives ids the model cannot embed, found only when one is sampled.

Must not: import anything of the engine's outside engine/models (models/ sits below every other folder), build a
model, or touch the network (hub.py does, when `resolve_model_dir` is asked to download).

Test: tests/unit/test_bad_inputs.py (the model classes).
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
"""Any one of these makes a directory's tokenizer loadable (fast, sentencepiece, BPE vocab, tiktoken)."""


def resolve_model_dir(name: str, run_dir: str | Path, *, need_tokenizer: bool = False, download: bool = False,
                      trust_remote_code: bool = False) -> Path:
    """The directory `model.name_or_path` names: a built-in model's (built under `run_dir`/models, or found there), a
    local directory (a path that exists, or starts with `.`, `/` or `~`), checked (`check_model_dir`: a missing
    config.json would give transformers' misleading "model_type" message), else a hub id: with `download` its local
    snapshot (engine/models/hub.py: the cache, else the hub), otherwise passed on to transformers as it is.

    Args:
        need_tokenizer: refuse a local directory without tokenizer files (the caller loads its tokenizer there).
        trust_remote_code: a downloaded snapshot includes the model's own Python files.
    """
    from engine.models.hub import resolve_hub_model
    from engine.models.tiny_model import resolve_builtin_model

    if name.startswith("builtin:"):
        return resolve_builtin_model(name, Path(run_dir) / "models")
    local = Path(name).expanduser()
    if local.is_dir() or name.startswith((".", "/", "~")):
        if local.is_dir():
            check_model_dir(local, need_tokenizer=need_tokenizer)
        return local
    return Path(resolve_hub_model(name, trust_remote_code)) if download else Path(name)


class ModelDirError(ValueError):
    """A model directory that cannot be used: a missing or malformed file, or parts that do not agree."""


def check_model_dir(model_dir: str | Path, *, vocab_size: int | None = None, need_tokenizer: bool = False) -> None:
    """Refuse a model directory that lacks a file the engine reads, or whose tokenizer does not fit the model.

    Args:
        model_dir: a local Hugging Face checkpoint directory.
        vocab_size: the model's vocabulary (config.json `vocab_size`, the embedding's rows); None = read it from
            config.json. The tokenizer (when the directory has a tokenizer.json) must not have more tokens.
        need_tokenizer: refuse a directory without tokenizer files (the caller loads its tokenizer from there).
    Raises:
        ModelDirError naming the directory, the file and what to do.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(f"model directory {model_dir}: no such directory")
    config = _read_config(model_dir)
    _check_weights(model_dir)
    if need_tokenizer and not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
                            "tokenizer files next to the weights (transformers would build an empty one silently)")
    vocab_size = config.get("vocab_size") if vocab_size is None else vocab_size
    num_tokens = tokenizer_vocab_size(model_dir)
    if vocab_size is not None and num_tokens is not None and num_tokens > vocab_size:
        raise ModelDirError(
            f"{model_dir}: the tokenizer has {num_tokens} tokens but the model's vocabulary (config.json vocab_size, "
            f"the embedding rows) is {vocab_size}: ids {vocab_size}..{num_tokens - 1} cannot be embedded. Tokens were "
            "added without resizing the embeddings (model.resize_token_embeddings(len(tokenizer)) before saving), or "
            "the tokenizer belongs to another model")


def tokenizer_vocab_size(model_dir: str | Path) -> int | None:
    """Tokens of the directory's tokenizer.json, added tokens included (None when there is no tokenizer.json)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on malformed files
        raise ModelDirError(f"{path}: cannot read the tokenizer ({exc})") from exc


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelDirError(f"{model_dir} has no config.json: it is not a Hugging Face model directory (save the "
                            "model with save_pretrained, or point model.name_or_path at the directory that has one)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{path} is not valid JSON ({exc}): a torn copy?") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelDirError(f"{path} has no model_type: not a transformers model config")
    return config


def _check_weights(model_dir: Path) -> None:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelDirError(f"{index} is not a safetensors index (no weight_map): {exc}") from exc
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise ModelDirError(f"{model_dir}: {len(missing)} safetensors shard(s) named by {index.name} are missing: "
                                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (an interrupted "
                                "download or copy?)")
        return
    if (model_dir / "model.safetensors").is_file():
        return
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ModelDirError(f"{model_dir} holds PyTorch .bin/.pt weights only; this engine reads safetensors (no "
                            "pickle): convert with AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                            "safe_serialization=True)")
    raise ModelDirError(f"{model_dir} has no weights: no model.safetensors or model.safetensors.index.json")
