"""GRPO per-token terms benchmark: the loss epilogue (torch terms vs the fused Triton terms) next to the LM-head kernel.

What it answers: how much of a GRPO micro-batch's loss computation is the O(N) per-token epilogue (ratio, clipping,
masks, KL, normaliser, metrics sums: `compute_policy_loss` forward + backward) compared with the O(N V H) fused
LM-head log-prob (forward + backward), at one shape, in one run (ratios; absolute times count only on a GPU).

Variants (mode `full` = forward + backward; x = tokens N = B x T):
- `lm_head_<implementation>`: kernels.lm_head_logprob_entropy at (N, H, V), implementation `auto` (torch_chunked on
  CPU, triton on CUDA), loss = sum(logprobs) + sum(entropy);
- `terms_torch`: compute_policy_loss with the torch terms (the reference) on (B, T) float32 log-probs: DAPO, token
  level, beta 0.04 (k3), vLLM IS correction (token_truncate), epsilon_high 0.28;
- `terms_triton`: the same with kernels/grpo_token_terms.py (under the Triton interpreter on CPU: TRITON_INTERPRET=1
  is set here when there is no CUDA, before triton is imported).

    python -m benchmarks.bench_grpo_token_terms            # CPU: N = 2048 (B, T = 8, 256), H = 512, V = 32000
    python -m benchmarks.bench_grpo_token_terms --device cuda --tokens 8192 --hidden 4096 --vocab 151936 \
        --dtype bfloat16

Rows: benchmarks/results/grpo_token_terms.csv. Test: none (a program, not a test);
tests/kernels/test_grpo_token_terms.py checks the values.

Is the fused kernel worth it? These are O(B T) elementwise operations next to the O(N V H) LM-head GEMMs. Measured on
the 2-core CPU VM (benchmarks/results/grpo_token_terms.csv, git 62d1be5; N = 2048 tokens, H = 512, V = 32000, fp32,
forward + backward): the whole torch loss (terms, normaliser, metric sums) 0.39 ms against 14955 ms for the chunked
LM head (2.6e-5 of it); the Triton terms under the interpreter 13.8 ms (35x the torch terms), so "auto" keeps torch
off CUDA. On a GPU the gain is launches and memory passes (~25-40 small torch kernels forward + backward -> 1 + 1),
not FLOPs; it has not been timed on a GPU (none was lent), and next to the LM-head GEMMs it cannot be more than a
small fraction of a step.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # NOTE: before triton is imported (kernels/, engine/grpo)

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, time_fn  # noqa: E402
from engine.config import GenerationConfig, GRPOConfigSection  # noqa: E402
from engine.grpo.policy_loss import (  # noqa: E402
    PolicyLossBatch,
    build_loss_normalizer,
    compute_policy_loss,
    compute_vllm_importance_sampling_ratio,
)
from engine.grpo.settings import PolicyLossConfig  # noqa: E402
from kernels import build_lm_head_problem, lm_head_logprob_entropy  # noqa: E402

BENCH = "grpo_token_terms"
SEQUENCE_LENGTH = 256
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WORKSPACE_MB = 128.0
"""The LM head's tile budget in the recorded rows (git 62d1be5); the engine's default is kernels.loss_workspace_mb."""


def build_loss_call(num_tokens: int, device: torch.device, terms: str):
    """A closure running compute_policy_loss forward + backward on (N / 256, 256) float32 log-probs."""
    batch_size = max(num_tokens // SEQUENCE_LENGTH, 1)
    gen = torch.Generator().manual_seed(0)
    shape = (batch_size, SEQUENCE_LENGTH)
    logprobs = (-torch.rand(shape, generator=gen) * 3).to(device)
    old = logprobs + 0.1 * torch.randn(shape, generator=gen).to(device)
    mask = torch.ones(shape, device=device)
    batch = PolicyLossBatch(
        mask=mask, advantages=torch.randn(batch_size, generator=gen).to(device), old_logprobs=old,
        ref_logprobs=logprobs + 0.1 * torch.randn(shape, generator=gen).to(device), sampling_logprobs=old,
        importance_sampling_ratio=compute_vllm_importance_sampling_ratio(
            old, old + 0.05, mask, "token_truncate", None, 3.0),
    )
    config = PolicyLossConfig.from_sections(GRPOConfigSection(loss_type="dapo", beta=0.04, epsilon_high=0.28,
                                                              use_bias_correction_kl=False), GenerationConfig())
    normalizer = build_loss_normalizer(mask)

    def run():
        lp = logprobs.clone().requires_grad_(True)
        compute_policy_loss(lp, batch, config, normalizer, terms_implementation=terms).loss.backward()

    return run


def build_lm_head_call(num_tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device):
    """A closure running the fused LM-head log-prob forward + backward (implementation `auto`)."""
    x, w, y = build_lm_head_problem(num_tokens, hidden, vocab, dtype=dtype, device=device, logit_std=3.0, seed=1)

    def run():
        xr, wr = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        lp, ent = lm_head_logprob_entropy(xr, wr, y, workspace_mb=WORKSPACE_MB, implementation="auto")
        (lp.sum() + ent.sum()).backward()

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="LM-head inputs")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--csv", type=Path, default=RESULTS_DIR / f"{BENCH}.csv")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    env = capture_env(device)
    lm_head_variant = "lm_head_" + ("triton" if device.type == "cuda" else "torch_chunked")
    calls = {
        lm_head_variant: build_lm_head_call(args.tokens, args.hidden, args.vocab, DTYPES[args.dtype], device),
        "terms_torch": build_loss_call(args.tokens, device, "torch"),
        "terms_triton": build_loss_call(args.tokens, device, "triton"),
    }
    config = {"H": args.hidden, "V": args.vocab, "dtype": args.dtype, "T": SEQUENCE_LENGTH, "loss_type": "dapo",
              "workspace_mb": WORKSPACE_MB,
              "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1", "torch_threads": torch.get_num_threads()}
    rows = []
    for variant, call in calls.items():
        timing = time_fn(call, device=device, warmup=args.warmup, n_iters=args.iters)
        rows.append(make_row(env, bench=BENCH, variant=variant, mode="full", metric="time", unit="ms",
                             x_name="tokens", x_value=args.tokens, p20=timing.p20_ms, p50=timing.p50_ms,
                             p80=timing.p80_ms, n_iters=timing.n_iters, config=config))
        print(f"{variant:<24} p50 {timing.p50_ms:10.3f} ms  (p20 {timing.p20_ms:.3f}, p80 {timing.p80_ms:.3f})")
    lm_head_ms = rows[0].p50
    for row in rows[1:]:
        print(f"{row.variant} / {lm_head_variant}: {row.p50 / lm_head_ms:.4f}")
    append_rows(args.csv, rows)
    print(f"{len(rows)} rows -> {args.csv}")


if __name__ == "__main__":
    main()
