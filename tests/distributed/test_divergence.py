"""A diverged policy stops the run before its weights are synced (engine/train/run.py `check_finite`, called by the
loop after the optimizer steps of a round): a non-finite loss or weight raises TrainingDivergedError naming the step
and what went non-finite, on every rank, and a finite policy passes. Trainer TP2 on gloo (the tiny Qwen2)."""

import pytest

from tests.distributed.launcher import run_distributed


def _diverge(model_dir: str) -> dict:
    import math
    from types import SimpleNamespace

    import torch

    from engine.config import OptimizerConfig, ParallelConfig
    from engine.train.run import TrainingDivergedError, check_finite
    from tests.helpers.policy import build_from_hf

    ps, _, chunks, _ = build_from_hf(model_dir, ParallelConfig(tp_size=2))
    run = SimpleNamespace(chunks=chunks, ps=ps, cfg=SimpleNamespace(optimizer=OptimizerConfig(learning_rate=0.1)))
    out = {}
    check_finite(run, 3, [torch.tensor(0.5)])  # finite: returns
    for case, losses in (("loss", [torch.tensor(math.nan)] if ps.rank == 1 else []), ("weight", [])):
        if case == "weight" and ps.rank == 1:
            next(p for name, p in chunks[0].named_parameters() if "linear_fc1" in name).data[0, 0] = math.inf
        try:
            check_finite(run, 7, losses)
            out[case] = ""
        except TrainingDivergedError as exc:
            out[case] = str(exc)
    return out


@pytest.mark.slow
def test_non_finite_loss_or_weight_stops_the_run_naming_the_step(tmp_path):
    from engine.models.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / "qwen2", "qwen2", seed=6))
    for r in run_distributed(_diverge, 2, model_dir):
        assert "training diverged at step 7: the loss is nan (trainer rank 1)" in r["loss"], r["loss"]
        assert "training diverged at step 7: the policy's weight" in r["weight"], r["weight"]
        assert "linear_fc1" in r["weight"] and "not finite (trainer rank 1)" in r["weight"], r["weight"]
        assert "optimizer.learning_rate (now 0.1)" in r["weight"]
