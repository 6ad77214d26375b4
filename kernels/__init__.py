"""Fused LM-head kernels for the GRPO loss: hidden states + LM-head shard -> per-token log-prob and entropy.

Imports torch and Triton only, never engine/. In Liger's order: tile primitives (kernels/chunked_logprob.py in
torch, kernels/fused_logprob.py in Triton, over the softmax state of kernels/softmax_stats.py), then the autograd
Function and the entries (kernels/lm_head_logprob.py, one contract):

- `lm_head_logprob_entropy`: the public entry; `implementation="auto" | "triton" | "torch_chunked" | "reference"`.
- `triton_logprob_entropy`: fused Triton kernels, GPU (or the Triton interpreter).
- `chunked_logprob_entropy`: tiled plain torch, bounded memory; CPU and CI.
- `reference_logprob_entropy` (kernels/reference.py): materialised logits, for tests and as the benchmark baseline.

- `onepass_logprob_entropy` (kernels/onepass_logprob.py): the training pass for token-local losses: each row
  chunk's logits formed once, the loss gradient taken in the forward (cuBLAS GEMMs + the Triton row kernels of
  kernels/onepass_rows.py, or torch ops); block sizes from kernels/tuned_tiles.py's measured tables where present.

Every entry but the reference takes `workspace_mb` (no default here: the engine's is `kernels.loss_workspace_mb`).
Also: kernels/grpo_token_terms.py (the GRPO per-token terms after the log-probs, one fused kernel, with gradients)
and kernels/compile_check.py (`python -m kernels.compile_check`: every kernel compiled for sm_90 / sm_80, registers,
spills, shared memory).

Test: `pytest tests/kernels`.
"""

from kernels.fused_logprob import TritonTiles
from kernels.lm_head_logprob import (
                                     IMPLEMENTATIONS,
                                     chunked_logprob_entropy,
                                     lm_head_logprob_entropy,
                                     triton_logprob_entropy,
)
from kernels.onepass_logprob import ONEPASS_IMPLEMENTATIONS, onepass_logprob_entropy
from kernels.reference import build_lm_head_problem, reference_logprob_entropy

__all__ = [
    "IMPLEMENTATIONS",
    "ONEPASS_IMPLEMENTATIONS",
    "TritonTiles",
    "build_lm_head_problem",
    "chunked_logprob_entropy",
    "lm_head_logprob_entropy",
    "onepass_logprob_entropy",
    "reference_logprob_entropy",
    "triton_logprob_entropy",
]
