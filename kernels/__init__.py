"""Fused LM-head kernels for the GRPO loss: hidden states + LM-head shard -> per-token log-prob and entropy.

Imports torch and Triton only, never engine/. The functional entries (one contract, see kernels/lm_head_logprob.py):

- `lm_head_logprob_entropy`: the public entry; `implementation="auto" | "triton" | "torch_chunked" | "reference"`.
- `triton_logprob_entropy` (kernels/fused_logprob.py): fused Triton kernels, GPU (or the Triton interpreter).
- `chunked_logprob_entropy` (kernels/chunked_logprob.py): tiled plain torch, bounded memory; CPU and CI.
- `reference_logprob_entropy` (kernels/reference.py): materialised logits, for tests and as the benchmark baseline.

Also: kernels/grpo_token_terms.py (the GRPO per-token terms after the log-probs, one fused kernel, with gradients)
and kernels/compile_check.py (`python -m kernels.compile_check`: every kernel compiled for sm_90 / sm_80, registers,
spills, shared memory).

Test: `pytest tests/kernels`.
"""

from kernels.chunked_logprob import DEFAULT_WORKSPACE_MB, chunked_logprob_entropy
from kernels.fused_logprob import TritonTiles, triton_logprob_entropy
from kernels.lm_head_logprob import IMPLEMENTATIONS, lm_head_logprob_entropy
from kernels.reference import build_lm_head_problem, reference_logprob_entropy

__all__ = [
    "DEFAULT_WORKSPACE_MB",
    "IMPLEMENTATIONS",
    "TritonTiles",
    "build_lm_head_problem",
    "chunked_logprob_entropy",
    "lm_head_logprob_entropy",
    "reference_logprob_entropy",
    "triton_logprob_entropy",
]
