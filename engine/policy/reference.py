"""The frozen reference policy for the KL term (beta > 0): same Megatron layout as the policy, never trained.

Owns: `ReferencePolicy` (build from the same Hugging Face checkpoint, or with LoRA the policy's own chunks with the
adapters disabled, `base_of`; forward-only log-probs, optional offload of
its weights to CPU memory between uses, TR-DPO mixing `ref = alpha * policy + (1 - alpha) * ref` for
`sync_ref_model`, https://arxiv.org/abs/2404.09656). Its chunks are not wrapped in DDP and have no optimizer state.

TR-DPO (`grpo.sync_ref_model`): engine/train/loop.py calls `mix_reference_if_due` -> `mix_from` after every optimizer step whose number is a
multiple of `grpo.ref_model_sync_steps` (TRL's SyncRefModelCallback: `on_step_end`, `global_step % sync_steps == 0`),
with `grpo.ref_model_mixup_alpha`. The policy's weights it mixes from are the model chunks' parameters, i.e. the
weights the policy's forward and vLLM use (TRL's `model.parameters()`), not the optimizer's float32 main parameters:
in bf16 those are sharded over DP ranks by the distributed optimizer and differ from the model's weights by one
bf16 rounding, which the bf16 reference would round away again. The mix is computed in float32 and rounded once
into the reference's dtype (TRL's in-place `mul_` / `add_` rounds twice in bf16; in float32 the two are the same
operations). An offloaded reference (`model.offload_reference`) is mixed where it lives (CPU memory): each policy
shard is copied to the host once. The mixed weights travel in checkpoints (engine/train/checkpoint.py, `reference`).

Must not: read Megatron's global parallel state, or hold gradients.

Test: tests/distributed/test_reference_and_logprobs.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import GRPOConfigSection, ModelConfig, TrainConfig
from engine.policy.hf_map import ModelDims
from engine.policy.microbatch import MicroBatch
from engine.policy.parallel import ParallelState
from engine.policy.step import LogprobSettings, forward_logprobs, unwrap


class ReferencePolicy:
    """A frozen copy of the policy in the same layout (one per rank, holding this rank's shards)."""

    adapters_off = False
    """The chunks are the LoRA policy's own, run with its adapters disabled (`base_of`)."""

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

    @classmethod
    def base_of(cls, policy_chunks: list[torch.nn.Module], ps: ParallelState) -> ReferencePolicy:
        """The reference of a LoRA policy: its own chunks with the adapters disabled (the frozen base is the initial
        model; TRL's PEFT reference), no second copy of the weights. Nothing is frozen or moved here."""
        reference = cls.__new__(cls)
        reference.chunks, reference.device, reference.offload = policy_chunks, ps.device, False
        reference.adapters_off = True
        return reference

    def _move(self, device: torch.device) -> None:
        for chunk in self.chunks:
            for param in chunk.parameters():
                param.data = param.data.to(device, non_blocking=True)

    def logprobs(self, ps: ParallelState, microbatches: list[MicroBatch], settings: LogprobSettings):
        """Reference log-probs and entropies, (b, C) per micro-batch, on the last stage (see step.forward_logprobs)."""
        if self.offload:
            self._move(self.device)
        try:
            if self.adapters_off:
                from engine.policy.lora import adapters_disabled

                with adapters_disabled(self.chunks):
                    return forward_logprobs(self.chunks, ps, microbatches, settings)
            return forward_logprobs(self.chunks, ps, microbatches, settings)
        finally:
            if self.offload:
                self._move(torch.device("cpu"))

    @torch.no_grad()
    def mix_from(self, policy_chunks: list[torch.nn.Module], alpha: float) -> None:
        """TR-DPO reference sync: ref <- alpha * policy + (1 - alpha) * ref, shard by shard (same layout), in float32,
        rounded once into the reference's dtype.

        Args:
            policy_chunks: this rank's policy chunks (DDP-wrapped or not), in the reference's layout.
            alpha: `grpo.ref_model_mixup_alpha`, in [0, 1].
        """
        for ref_chunk, policy_chunk in zip(self.chunks, policy_chunks, strict=True):
            refs, news = dict(ref_chunk.named_parameters()), dict(unwrap(policy_chunk).named_parameters())
            if refs.keys() != news.keys():
                raise RuntimeError(f"reference and policy layouts differ: {sorted(refs.keys() ^ news.keys())[:4]}")
            for name, ref in refs.items():
                mixed = ref.float().mul_(1.0 - alpha).add_(news[name].detach().to(ref.device, torch.float32), alpha=alpha)
                ref.copy_(mixed)


def mix_reference_if_due(reference: ReferencePolicy | None, policy_chunks: list, grpo: GRPOConfigSection,
                         step: int) -> None:
    """TR-DPO (`grpo.sync_ref_model`): after optimizer step `step`, when it is a multiple of `ref_model_sync_steps`
    (TRL's SyncRefModelCallback.on_step_end: `global_step % ref_model_sync_steps == 0`), mix the reference towards
    the policy with `ref_model_mixup_alpha` (`ReferencePolicy.mix_from`). engine/train/loop.py calls it after every
    optimizer step."""
    if grpo.sync_ref_model and step % grpo.ref_model_sync_steps == 0:
        reference.mix_from(policy_chunks, grpo.ref_model_mixup_alpha)
