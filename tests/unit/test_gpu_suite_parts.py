"""Pieces of the GPU suite that need no GPU and no subprocess: the longest-fit search's stopping rules (on a step
function raising the real CUDA out-of-memory error class) and the Megatron config part c builds on a GPU without
Transformer Engine or apex (the config's GPU branch, on this CPU). The suite itself: tests/integration/test_gpu_suite.py.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from benchmarks.gpu.longest_fit import find_longest_fit


def test_longest_fit_stops_at_the_first_out_of_memory_over_budget_or_past_the_deadline():
    def step(limit):
        def run_at(length):
            if length > limit:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return float(length)  # "peak MiB"
        return run_at

    search = find_longest_fit(step(4096), [8192, 1024, 2048, 4096, 16384])
    assert search.longest == 4096 and list(search.peaks_mib) == [1024, 2048, 4096]
    assert search.stopped.startswith("out of memory at 8192")
    assert find_longest_fit(step(10**6), [1024, 2048, 4096], memory_budget_mib=2500).longest == 2048
    assert find_longest_fit(step(10**6), [1024], deadline=time.monotonic() - 1).longest == 0
    with pytest.raises(ValueError):  # other errors are bugs, not answers
        find_longest_fit(lambda length: (_ for _ in ()).throw(ValueError("bad shape")), [1024])


def test_megatron_config_on_a_gpu_without_transformer_engine_or_apex_is_accepted(monkeypatch):
    """Part c on the lent GPU (megatron-core alone): the policy asks only for fusions whose kernels import; Megatron
    refused `apply_rope_fusion=True` without Transformer Engine ("apply_rope_fusion is not available")."""
    from types import SimpleNamespace

    from benchmarks.bench_grpo_step import model_config
    from engine.config import ModelConfig
    from engine.policy.model import build_transformer_config

    if any(importlib.util.find_spec(n) for n in ("transformer_engine", "scaled_masked_softmax_cuda")):
        pytest.skip("Transformer Engine or apex's softmax kernel is installed: the fusions are available here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU branch of the config, on this CPU
    ps = SimpleNamespace(tp_size=1, pp_size=1, vpp_size=None, sequence_parallel=False, ep_size=1, etp_size=1)
    config = build_transformer_config(model_config("tiny"), ModelConfig(dtype="bfloat16"), ps)
    assert not config.apply_rope_fusion and not config.masked_softmax_fusion
    assert config.bias_activation_fusion and config.bias_dropout_fusion  # torch.jit fusions: no extension needed


def test_long_tailed_batch_has_the_asked_median_tail_and_cap_and_is_the_same_for_every_variant():
    from benchmarks.gpu.long_tail import long_tail_batch, long_tail_lengths

    lengths = long_tail_lengths(20000, median=600, p99=8000, cap=8192)
    ordered = sorted(lengths)
    assert 560 < ordered[len(ordered) // 2] < 640
    assert 7000 < ordered[int(0.99 * len(ordered))] <= 8192 and max(lengths) == 8192  # the cap binds
    suite = long_tail_lengths(64, median=600, p99=8000, cap=8192)
    assert suite == long_tail_lengths(64, median=600, p99=8000, cap=8192) and max(suite) <= 8192
    first, second = (long_tail_batch(1000, [3, 9, 1], prompt_len=4) for _ in range(2))
    assert first.completion_mask.sum(1).tolist() == [3, 9, 1]
    assert all(torch.equal(getattr(first, k), getattr(second, k)) for k in ("tokens", "completion_ids", "advantages", "old_logprobs"))


def test_step_part_measures_every_onepass_implementation_on_the_gpu():
    """Part c's GPU implementations include each one-pass implementation, each a step config the engine accepts and an
    LM-head variant the share rows can time."""
    from benchmarks.bench_fused_logprob import ONEPASS_VARIANTS
    from benchmarks.bench_grpo_step import kernels_for
    from benchmarks.gpu.suite import STEP_IMPLEMENTATIONS
    from kernels.onepass_logprob import ONEPASS_IMPLEMENTATIONS

    names = STEP_IMPLEMENTATIONS.split(",")
    onepass = [n for n in names if n.startswith("onepass_")]
    assert sorted(onepass) == sorted(f"onepass_{i}" for i in ONEPASS_IMPLEMENTATIONS if i != "auto")
    for name in onepass:
        config = kernels_for(name)
        assert config.loss_pass == "one" and config.onepass_implementation == ONEPASS_VARIANTS[name]
