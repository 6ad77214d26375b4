"""`trainer.push_to_hub(...)` and `trainer.hub_model_id`, as HF's Trainer has them, over the model `save_model`
writes.

Owns: `HubSurface` (mixed into GRPOTrainer): `push_to_hub` saves the policy as a Hugging Face checkpoint into
output_dir (`save_model`, the trained model after `train()`), writes a short model card (README.md) unless one is
there, and uploads those files with huggingface_hub to `hub_model_id` (default: output_dir's name, as HF), honouring
`hub_token`, `hub_private_repo` and `hub_revision`; run logs, checkpoints and the engine's own folders stay local.
`upload_model_folder` does the upload and turns any failure to reach the hub into one error that names the cause, the
repository and the folder that holds the model.

Must not: push during training (GRPOConfig refuses push_to_hub=True), or upload from more than one process.

Test: tests/unit/test_trl_accelerator.py (the error path with the hub unreachable, the folder it would upload).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

MODEL_FILE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "README.md"]
"""The files of a Hugging Face checkpoint in output_dir (weights, config, tokenizer, chat template, card) that are
uploaded; metrics.jsonl and the engine's folders (checkpoint-*, hf, initial_model, ...) are not."""


class HubUploadError(RuntimeError):
    """The hub could not be reached or refused the upload; the model is still saved locally."""


class HubSurface:
    """HF Trainer's hub methods on GRPOTrainer (which provides `args`, `output_dir`, `save_model`, `accelerator`)."""

    @property
    def hub_model_id(self) -> str:
        """The repository `push_to_hub` uploads to: args.hub_model_id, else output_dir's name."""
        return self.args.hub_model_id or Path(self.args.output_dir).resolve().name

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs: Any) -> Any:
        """Save the model to output_dir and upload it to `hub_model_id` (HF's `Trainer.push_to_hub`); returns the
        commit info (None on processes other than the main one). `kwargs` (dataset_name, tags, model_name, ...) go
        into the model card. Raises HubUploadError naming the cause when the hub cannot be reached."""
        self.save_model(self.args.output_dir)
        if not self.accelerator.is_main_process:
            return None
        folder = Path(self.args.output_dir)
        write_model_card(folder, self.hub_model_id, self.model_path, kwargs)
        return upload_model_folder(folder, self.hub_model_id, token=token or self.args.hub_token,
                                   private=self.args.hub_private_repo, revision=revision or self.args.hub_revision,
                                   commit_message=commit_message or "End of training", blocking=blocking)


def write_model_card(folder: Path, repo_id: str, base_model: Any, details: dict[str, Any]) -> None:
    """A short README.md for the uploaded model (kept if the folder has one)."""
    card = folder / "README.md"
    if card.exists():
        return
    tags = ["grpo", *(details.get("tags") or [])]
    lines = ["---", "library_name: transformers", "tags: [" + ", ".join(tags) + "]"]
    dataset = details.get("dataset_name")
    if dataset:
        lines.append(f"datasets: [{dataset}]")
    lines += ["---", "", f"# {details.get('model_name') or repo_id}", "",
              f"Trained with GRPO (grpo-engine) from `{base_model}`" + (f" on `{dataset}`." if dataset else ".")]
    card.write_text("\n".join(lines) + "\n")


def upload_model_folder(folder: Path, repo_id: str, *, token: str | None = None, private: bool | None = None,
                        revision: str | None = None, commit_message: str = "End of training",
                        blocking: bool = True) -> Any:
    """Create `repo_id` if needed and upload the model files of `folder` (`MODEL_FILE_PATTERNS`)."""
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"push_to_hub: {folder} holds no saved model (no config.json / adapter_config.json)")
    try:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision is not None:
            api.create_branch(repo.repo_id, branch=revision, exist_ok=True)
        return api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder), commit_message=commit_message,
                                 revision=revision, allow_patterns=MODEL_FILE_PATTERNS, run_as_future=not blocking)
    except Exception as exc:  # offline mode, no network, no token, refused: one message with the cause
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0") else ""
        raise HubUploadError(f"push_to_hub: could not upload to the Hugging Face Hub repository {repo_id!r}"
                             f"{offline}: {type(exc).__name__}: {exc}. The model is saved in {folder}; upload it "
                             "later with `huggingface-cli upload` or trainer.push_to_hub()") from exc
