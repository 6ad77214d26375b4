"""LoRA benchmark: what the trainer holds for training, full fine-tune vs LoRA, side by side in one run,
and what LoRA's merged weight sync adds. Rows go to `benchmarks/results/lora.csv`.

Shape (default): a Qwen2-like model of 4 layers, hidden 1024, 16 heads / 4 KV heads, MLP 2816, vocab 1024, float32,
Megatron's local spec, one process (world size 1), Megatron's optimizer (Adam, not distributed). LoRA: rank 16 on
every linear (all-linear), alpha 32.

Metrics, per variant (`full`, `lora_r16`):
- `trainable_params`: parameters with requires_grad;
- `trainer_state` (MiB): the bytes of Megatron DDP's gradient buffers plus every tensor of the optimizer's state
  after one step (Adam m, v; fp32 model: no master copies), counted from the objects themselves;
- `weights` (MiB): every parameter's bytes (the frozen base included);
- `sync_bytes` (MiB): what one merged weight sync moves into vLLM: the merged model's tensors, as full fine-tuning
  (the adapter-only sync, `lora.lora_weight_sync=adapter`, moves only the adapters: benchmarks/bench_lora_sync.py);
- `merge_time` (ms, LoRA only): entering and leaving `merged_lora` (W + scale * B A for every adapted weight, fp32),
  the work the merged sync adds per sync. CPU times from a shared machine: compare within one run only.

    python -m benchmarks.bench_lora            # under a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, percentiles

MIB = 2**20


def _build(args, ps, lora_r: int | None):
    from transformers import Qwen2Config

    from engine.config import ModelConfig, OptimizerConfig, TrainConfig
    from engine.lora_settings import LoraSettings, resolve_target_modules
    from engine.policy.lora import apply_lora
    from engine.policy.model import build_policy, init_weights_by_name
    from engine.policy.optimizer import build_optimizer

    hf_config = Qwen2Config(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                            num_key_value_heads=4, intermediate_size=args.ffn, vocab_size=1024,
                            max_position_embeddings=2048, tie_word_embeddings=False)
    chunks = build_policy(hf_config, ModelConfig(dtype="float32", transformer_impl="local"), ps,
                          TrainConfig(gradient_checkpointing=False))
    init_weights_by_name(chunks, ps, seed=0)
    if lora_r:
        apply_lora(chunks, LoraSettings(r=lora_r, lora_alpha=2.0 * lora_r, lora_dropout=0.0,
                                        target_modules=resolve_target_modules("all-linear")), ps)
    popt = build_optimizer(OptimizerConfig(learning_rate=1e-3, use_distributed_optimizer=False), chunks, ps,
                           total_steps=1)
    return chunks, popt


@torch.no_grad()
def _step(chunks, popt) -> None:
    popt.zero_grad()
    for chunk in chunks:
        for param in chunk.parameters():
            if param.requires_grad:
                param.main_grad.normal_(std=1e-4)
    popt.step()


def _state_bytes(popt) -> int:
    grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size()
                for model in popt.model for buffer in model.buffers)
    inner = getattr(popt.optimizer, "chained_optimizers", None) or [popt.optimizer]
    states = sum(t.numel() * t.element_size() for opt in inner for s in opt.optimizer.state.values()
                 for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    return grads + states


def measure(args, ps, lora_r: int | None) -> dict:
    from engine.policy.lora import merged_lora

    chunks, popt = _build(args, ps, lora_r)
    _step(chunks, popt)
    params = [p for chunk in chunks for p in chunk.parameters()]
    out = {"trainable_params": sum(p.numel() for p in params if p.requires_grad),
           "trainer_state": _state_bytes(popt) / MIB,
           "weights": sum(p.numel() * p.element_size() for p in params) / MIB,
           "sync_bytes": sum(p.numel() * p.element_size() for p in params if not p.requires_grad or not lora_r)
           / MIB}
    if lora_r:
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            with merged_lora(chunks):
                pass
            times.append((time.perf_counter() - start) * 1000)
        out["merge_time"] = times
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--csv", default=str(RESULTS_DIR / "lora.csv"), help="where rows are appended")
    args = parser.parse_args(argv)

    from engine.config import ParallelConfig
    from engine.policy.parallel import init_parallel

    ps = init_parallel(ParallelConfig(), seed=0)
    env = capture_env("cpu")
    config = {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "heads": 16, "kv_heads": 4,
              "vocab": 1024, "dtype": "float32", "optimizer": "adam", "targets": "all-linear"}
    rows = []
    for variant, rank in (("full", None), (f"lora_r{args.rank}", args.rank)):
        result = measure(args, ps, rank)
        common = dict(bench="lora", variant=variant, mode="train_state", x_name="rank", x_value=rank or 0,
                      config=config)
        for metric, unit in (("trainable_params", "count"), ("trainer_state", "MiB"), ("weights", "MiB"),
                             ("sync_bytes", "MiB")):
            value = float(result[metric])
            rows.append(make_row(env, metric=metric, unit=unit, p20=value, p50=value, p80=value, n_iters=1, **common))
        line = ", ".join(f"{m} {result[m]:,.1f}" for m in ("trainable_params", "trainer_state", "weights", "sync_bytes"))
        if "merge_time" in result:
            p20, p50, p80 = percentiles(result["merge_time"])
            rows.append(make_row(env, metric="merge_time", unit="ms", p20=p20, p50=p50, p80=p80,
                                 n_iters=len(result["merge_time"]), **(common | {"mode": "weight_sync"})))
            line += f", merge p50 {p50:.1f} ms"
        print(f"{variant:>9}: {line}")
    path = append_rows(args.csv, rows, overwrite=args.overwrite)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
