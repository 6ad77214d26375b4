"""Where a Hugging Face model comes from when it is named by a hub id: the local cache first, else a download.

Owns: `resolve_hub_model` (a snapshot directory for a hub id, refusing with advice when offline or when the download
fails) and the files it fetches (`HUB_ALLOW_PATTERNS`: config, weights, tokenizer; no PyTorch .bin, no remote code
unless trust_remote_code). Used by the TRL-compatible trainer and the rollout server alike.

Must not: import anything of the engine's (models/ sits below every other folder).

Test: tests/unit/test_trl_api.py (model resolution).
"""

from __future__ import annotations

import os

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
"""Files fetched for a hub model: config, weights, tokenizer (no PyTorch .bin, no remote code)."""


def resolve_hub_model(name: str, trust_remote_code: bool = False) -> str:
    """The local snapshot directory of a hub model: from the cache, else downloaded (unless HF_HUB_OFFLINE)."""
    from huggingface_hub import snapshot_download

    patterns = HUB_ALLOW_PATTERNS + (["*.py"] if trust_remote_code else [])
    try:
        return snapshot_download(name, allow_patterns=patterns, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or not a valid id): try the hub below, or explain
        pass
    offline = any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE",
                                                                                          "TRANSFORMERS_OFFLINE"))
    advice = ("download it where there is a network (`huggingface-cli download NAME --local-dir DIR`) and pass "
              "the directory as model")
    if offline:
        raise ValueError(f"model={name!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: {advice}")
    try:
        return snapshot_download(name, allow_patterns=patterns)
    except Exception as exc:  # noqa: BLE001 - every hub failure gets the same advice
        raise ValueError(f"model={name!r}: not a local directory, and the hub download failed "
                         f"({type(exc).__name__}: {exc}); {advice}") from exc
