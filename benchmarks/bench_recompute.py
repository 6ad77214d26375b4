"""Activation recompute benchmark: the activation peak memory and the time of one training forward + backward of the
Megatron policy with recompute off, full (uniform, one layer per unit) and selective (`core_attn`), side by side in
one run, against what the memory planner (engine/planning/memory.py `activation_term`) predicts for the same shape.
Rows go to `benchmarks/results/recompute.csv`.

Shape (default): a Qwen2-like model of 4 layers, hidden 1024, 16 heads / 4 KV heads, MLP 2816, vocab 1024 (small, so
the LM head does not hide the layers), one sequence of 2048 tokens (1024 prompt + 1024 completion), float32, Megatron's
local spec (attention scores materialised: the 5*a*s/h term), one process, world size 1.

Memory, exactly: the torch CPU allocator's live bytes, from `torch.profiler` memory events (`profile_memory=True`:
every allocation and free the allocator makes, with its size), summed in time order; the peak of that running sum
minus the bytes live before the call is the call's extra memory (`allocated_peak_bytes`). The weights' gradients are
allocated by a warm-up pass first (zeroed, kept), so the extra is activations + workspace. RSS sampling (harness
`peak_memory_fn`) would see the allocator's cached pages and miss short peaks; tracemalloc does not see torch.
The planner's formula counts bf16 bytes (2 per element); this run is float32, so the prediction shown is x2.

Measured (benchmarks/results/recompute.csv, CPU, fp32, 4 layers, h 1024, s 1024, git 49a60ba): full recompute 306 MiB
against 239 planned, none 769 against 892 (the planner counts the paper's stored activations, not the backward's
transient gradient buffers); selective 586 MiB against 252 planned, which showed the planner missing the part of the
one layer recomputed in the backward (added to `activation_term` on 2026-11-25).

    python -m benchmarks.bench_recompute            # about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, percentiles

MIB = 2**20
VARIANTS = {"none": {"gradient_checkpointing": False}, "full": {},
            "selective": {"recompute_granularity": "selective"}}
"""Variant -> `train` settings (engine.config.TrainConfig)."""


def allocated_peak_bytes(fn) -> int:
    """Peak extra bytes the torch CPU allocator holds during `fn()` over what it held before (profiler events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _hf_config(args):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                       num_key_value_heads=4, intermediate_size=args.ffn, vocab_size=1024,
                       max_position_embeddings=args.seq, tie_word_embeddings=False)


def _batch(seq: int) -> dict:
    from engine.policy.batch import pack_completions

    gen = torch.Generator().manual_seed(0)
    half = seq // 2
    return pack_completions([torch.randint(3, 1024, (half,), generator=gen).tolist()],
                            [torch.randint(3, 1024, (half,), generator=gen).tolist()], pad_token_id=0)


def _planned_bytes(args, variant: str) -> float:
    """The planner's activation term for this shape and recompute, in bf16 bytes."""
    from engine.config import build_config
    from engine.planning.memory import activation_term
    from engine.planning.shapes import ModelDims

    dims = ModelDims(hidden_size=args.hidden, num_layers=args.layers, num_heads=16, num_kv_heads=4,
                     intermediate_size=args.ffn, vocab_size=1024, tie_word_embeddings=False, qkv_bias=True)
    cfg = build_config({"model": {"transformer_impl": "local"}, "train": {"per_device_train_batch_size": 1,
                                                                           **VARIANTS[variant]},
                        "generation": {"max_completion_length": args.seq // 2},
                        "data": {"max_prompt_length": args.seq // 2}})
    return activation_term(cfg, dims, stage=0, num_microbatches=1).nbytes


def measure(args, ps, variant: str) -> dict:
    """(peak extra MiB, per-call ms samples) of one forward + backward with `variant`'s recompute."""
    from engine.config import KernelsConfig, ModelConfig, TrainConfig
    from engine.policy.model import build_policy, init_weights_by_name
    from engine.policy.step import LogprobSettings, completion_logprobs, run_schedule

    hf = _hf_config(args)
    chunks = build_policy(hf, ModelConfig(dtype="float32", transformer_impl="local"), ps, TrainConfig(**VARIANTS[variant]))
    init_weights_by_name(chunks, ps, seed=0)
    batch = _batch(args.seq)
    settings = LogprobSettings(vocab_size=1024, temperature=1.0,
                               kernels=KernelsConfig(loss_implementation="torch_chunked"))

    def loss_fn(model, hidden, b):
        return completion_logprobs(model, hidden, b, ps, settings)[0].sum(), {}

    def step():
        run_schedule(chunks, ps, [batch], loss_fn)

    step()  # allocates the gradients, kept (zeroed) from here on
    chunks[0].zero_grad(set_to_none=False)
    peak = allocated_peak_bytes(step)
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return {"peak_mib": peak / MIB, "times_ms": times}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)

    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel

    ps = init_parallel(ParallelConfig(), seed=0)
    env = capture_env("cpu")
    config = {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "heads": 16, "kv_heads": 4,
              "vocab": 1024, "seq": args.seq, "batch": 1, "dtype": "float32", "spec": "local",
              "threads": torch.get_num_threads()}
    rows = []
    for variant in VARIANTS:
        result = measure(args, ps, variant)
        planned = 2 * _planned_bytes(args, variant) / MIB  # float32: twice the planner's bf16 bytes
        p20, p50, p80 = percentiles(result["times_ms"])
        common = dict(bench="recompute", variant=variant, mode="forward_backward", x_name="seq", x_value=args.seq,
                      config=config)
        rows += [
            make_row(env, metric="activation_peak", unit="MiB", p20=result["peak_mib"], p50=result["peak_mib"],
                     p80=result["peak_mib"], n_iters=1, **common),
            make_row(env, metric="planned_activations", unit="MiB", p20=planned, p50=planned, p80=planned, n_iters=1,
                     **common),
            make_row(env, metric="time", unit="ms", p20=p20, p50=p50, p80=p80, n_iters=len(result["times_ms"]),
                     **common),
        ]
        print(f"{variant:>10}: activation peak {result['peak_mib']:8.1f} MiB (planner, fp32: {planned:8.1f} MiB), "
              f"forward+backward p50 {p50:8.1f} ms")
    path = append_rows(RESULTS_DIR / "recompute.csv", rows, overwrite=args.overwrite)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
