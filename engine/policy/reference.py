"""The frozen reference policy for the KL term (beta > 0): same Megatron layout as the policy, never trained.

Owns: `ReferencePolicy` (build from the same Hugging Face checkpoint, forward-only log-probs, optional offload of
its weights to CPU memory between uses, TR-DPO mixing `ref = alpha * policy + (1 - alpha) * ref` for
`sync_ref_model`). Its chunks are not wrapped in DDP and have no optimizer state.

Must not: read Megatron's global parallel state, or hold gradients.

Test: tests/distributed/test_reference_and_logprobs.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig, TrainConfig
from engine.policy.hf_convert import ModelDims
from engine.policy.parallel import ParallelState
from engine.policy.step import LogprobSettings, forward_logprobs, unwrap


class ReferencePolicy:
    """A frozen copy of the policy in the same layout (one per rank, holding this rank's shards)."""

    def __init__(self, chunks: list[torch.nn.Module], device: torch.device, offload: bool):
        self.chunks, self.device, self.offload = chunks, device, offload
        for chunk in chunks:
            chunk.eval()
            for param in chunk.parameters():
                param.requires_grad_(False)
        if offload:
            self._move(torch.device("cpu"))

    @classmethod
    def build(cls, hf_config, cfg: ModelConfig, ps: ParallelState, model_dir: str | Path, dims: ModelDims) -> ReferencePolicy:
        """Build the reference chunks and load the checkpoint (each rank reads only its slices)."""
        from engine.policy.hf_checkpoint import load_hf_checkpoint
        from engine.policy.model import build_policy

        chunks = build_policy(hf_config, cfg, ps, TrainConfig(gradient_checkpointing=False))  # never trained
        load_hf_checkpoint(chunks, ps, model_dir, dims)
        return cls(chunks, ps.device, cfg.offload_reference)

    def _move(self, device: torch.device) -> None:
        for chunk in self.chunks:
            for param in chunk.parameters():
                param.data = param.data.to(device, non_blocking=True)

    def logprobs(self, ps: ParallelState, microbatches: list[dict], settings: LogprobSettings):
        """Reference log-probs and entropies, (b, C) per micro-batch, on the last stage (see step.forward_logprobs)."""
        if self.offload:
            self._move(self.device)
        try:
            return forward_logprobs(self.chunks, ps, microbatches, settings)
        finally:
            if self.offload:
                self._move(torch.device("cpu"))

    @torch.no_grad()
    def mix_from(self, policy_chunks: list[torch.nn.Module], alpha: float) -> None:
        """TR-DPO reference sync: ref <- alpha * policy + (1 - alpha) * ref, shard by shard (same layout)."""
        for ref_chunk, policy_chunk in zip(self.chunks, policy_chunks):
            for ref, new in zip(ref_chunk.parameters(), unwrap(policy_chunk).parameters()):
                ref.mul_(1.0 - alpha).add_(new.detach().to(ref.device), alpha=alpha)
