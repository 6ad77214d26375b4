"""The embedded demo behind the README's first command (`make demo`, i.e. `grpo-engine demo`).

Owns: running the most complete path that exists, on CPU, from `configs/tiny_cpu.yaml`. Today that is: validate the
config and write it resolved into the run directory; build the tiny model and tokenizer in Hugging Face format;
build the Megatron policy at the configured layout and load the checkpoint into it (each rank reads its slices); train it for a few steps on next-token prediction over
the embedded corpus through Megatron's forward/backward schedule, printing the loss before and after. The GRPO
loop (vLLM rollout, rewards, advantages, fused loss, weight sync) replaces the training part when the trainer issue
lands; until then this demo says so rather than pretending.

Must not: be imported by other engine modules.

Run: `grpo-engine demo [section.key=value ...]` (e.g. `train.max_steps=5`), or `torchrun --nproc-per-node 2 -m
engine demo parallel.tp_size=2` for the same at TP=2.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.config import load_config, write_resolved_config
from engine.validation import validate

SEQ_LEN, MICRO_BATCH = 64, 4


def _corpus_batches(tokenizer, vocab_size: int, num_microbatches: int, step: int) -> list[dict]:
    """Consecutive windows of the tokenised embedded corpus, (b, T) each, the same on every rank."""
    from engine.tiny_model import read_corpus

    ids = torch.tensor(tokenizer(read_corpus())["input_ids"], dtype=torch.long)  # (N,)
    window = SEQ_LEN + 1
    num_windows = ids.numel() // window
    windows = ids[: num_windows * window].view(num_windows, window)  # (W, T+1)
    start = (step * num_microbatches * MICRO_BATCH) % max(num_windows - num_microbatches * MICRO_BATCH, 1)
    chunk = windows[start : start + num_microbatches * MICRO_BATCH]  # (m*b, T+1)
    position_ids = torch.arange(SEQ_LEN).expand(MICRO_BATCH, SEQ_LEN)  # (b, T)
    assert int(chunk.max()) < vocab_size
    return [
        {"tokens": mb[:, :-1], "labels": mb[:, 1:], "position_ids": position_ids}
        for mb in chunk.split(MICRO_BATCH)  # m x (b, T+1)
    ]


def run_demo(config_path: Path, overrides: list[str]) -> int:
    """Run the demo; returns the process exit status."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoTokenizer

    from engine.hf_checkpoint import load_hf_checkpoint
    from engine.hf_convert import ModelDims
    from engine.model import build_policy, policy_shape
    from engine.parallel import destroy_parallel, init_parallel
    from engine.step import lm_forward_backward
    from engine.tiny_model import resolve_builtin_model

    cfg = load_config(config_path, overrides)
    ps = init_parallel(cfg.parallel, seed=cfg.train.seed)
    say = print if ps.rank == 0 else (lambda *a, **k: None)
    derived = validate(cfg, ps.world_size)
    run_dir = Path(cfg.train.output_dir)
    if ps.rank == 0:
        say(f"[demo] config valid; resolved config written to {write_resolved_config(cfg, run_dir)}")
        say(f"[demo] derived: {derived}")
    name = cfg.model.name_or_path
    model_dir = resolve_builtin_model(name, run_dir / "models") if name.startswith("builtin:") else Path(name)
    dist.barrier()
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    say(f"[demo] model {name} -> {model_dir} (vocab {hf_config.vocab_size}, {hf_config.num_hidden_layers} layers)")

    chunks = build_policy(hf_config, cfg.model, ps)
    load_hf_checkpoint(chunks, ps, model_dir, ModelDims.from_hf(hf_config, policy_shape(hf_config, cfg.model, ps.tp_size).padded_vocab_size))
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=cfg.optimizer.weight_decay)
    num_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else 20
    say(
        f"[demo] Megatron policy at tp={ps.tp_size} pp={ps.pp_size} dp={ps.dp_size}; {num_steps} next-token steps "
        f"on the embedded corpus (lr 1e-3; the GRPO loop replaces this when the trainer lands)"
    )
    first = last = None
    start = time.perf_counter()
    for step in range(num_steps):
        optimizer.zero_grad(set_to_none=True)
        losses = lm_forward_backward(chunks, ps, _corpus_batches(tokenizer, hf_config.vocab_size, 2, step))
        optimizer.step()
        if losses:
            last = sum(losses) / len(losses)
            first = last if first is None else first
            if ps.tp_rank == 0 and (step % 5 == 0 or step == num_steps - 1):
                print(f"[demo] step {step + 1:3d}/{num_steps}  lm_loss {last:.4f}", flush=True)
    if first is not None and ps.tp_rank == 0:
        print(f"[demo] lm_loss {first:.4f} -> {last:.4f} in {time.perf_counter() - start:.1f} s")
    say("[demo] not yet wired: vLLM rollout, rewards and the GRPO loss (see README, 'Status')")
    destroy_parallel()
    return 0
