"""One GRPO optimizer step through Megatron on gloo equals the single-process step, whatever the layout.

The tiny Qwen2 checkpoint, one fixed global batch of 8 completions (2 prompts x G=4, ragged prompt and completion
lengths), DAPO loss with beta > 0 and off-policy old log-probs (so clipping and the KL are active), Megatron's
distributed optimizer (Adam) with gradient clipping. At TP=2, TP=2 with sequence parallelism, PP=2, DP=2 and
TP=2 x PP=2 the summed loss, the gradient norm and every updated weight (exported to Hugging Face format) must equal
the TP=1 x PP=1 x DP=1 run: the normaliser is global, so how the batch is cut must not matter.

Adam's epsilon is 1e-4 here, not 1e-8: Adam's first update lr * g / (|g| + eps) amplifies the fp32 reordering
noise of a near-zero gradient (about 1e-9 absolute) by up to lr / eps. Observed at TP=2 with loss and grad norm
equal to 1e-5: eps=1e-8 moved one weight in 16K by 4e-6, eps=1e-6 by 1.4e-6; at 1e-4 the amplification is 10.
Sequence parallelism at TP=2 runs on Megatron's local spec (engine/policy/model.py LocalRMSNorm); its rows are
widened to an even length (the trainer's padded path does the same): pad columns after every sequence change no
real position's values, so it is compared with the same unwidened reference.
Activation recompute (TRL's default `gradient_checkpointing=True`: Megatron's full recompute, uniform, one layer per
unit) is on in every run here; at TP=2 and PP=2 the same world also runs the step with it off first, and the two must
be equal bit for bit (fp32 and bf16: the recomputed forward repeats the same operations), with twice the layer
forwards when it is on (so it really ran).
Megatron's "tp_group is None, using default tp group" warning (a DeprecationWarning, on rank 0) must not appear: every
call gets its group explicitly (engine/policy/model.py `_row_parallel_linear_class`).
"""

import warnings

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import grpo_step_and_export, hf_tensors


def _grpo_step(tp: int, pp: int, dp: int, sp: bool, model_dir: str, out_dir: str, dtype: str = "float32",
               compare_recompute: bool = False) -> dict:
    from engine.config import ModelConfig, ParallelConfig, TrainConfig
    from engine.policy.parallel import destroy_parallel

    parallel = ParallelConfig(tp_size=tp, pp_size=pp, dp_size=dp, sequence_parallel=sp)
    without = None
    if compare_recompute:  # first the step without recompute, from the same checkpoint, in the same world
        without = grpo_step_and_export(model_dir, parallel, ModelConfig(dtype=dtype), f"{out_dir}_no_recompute",
                                       tp if sp else 1, train=TrainConfig(gradient_checkpointing=False))
        destroy_parallel(keep_process_group=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = grpo_step_and_export(model_dir, parallel, ModelConfig(dtype=dtype), out_dir, tp if sp else 1)
    return result | {"tp_group_warnings": sum("tp_group is None" in str(w.message) for w in caught),
                     "no_recompute": without}


def _assert_recompute_changes_nothing(results: list, out_dir) -> None:
    """The step with recompute (the layout's result) equals the step without it bit for bit, and ran each layer's
    forward twice."""
    for r in results:
        without = r["no_recompute"]
        assert r["layer_forwards"] == 2 * without["layer_forwards"] > 0, "recompute did not run the layers again"
        assert r["loss"] == without["loss"] and r["grad_norm"] == without["grad_norm"]
    weights, weights_without = hf_tensors(out_dir), hf_tensors(f"{out_dir}_no_recompute")
    assert sorted(weights) == sorted(weights_without)
    for name, weight in weights.items():
        assert torch.equal(weight, weights_without[name]), f"{name}: recompute changed the step"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("grpo_step")
    model_dir = build_tiny_model(root / "qwen2", "qwen2", seed=5)
    results = run_distributed(_grpo_step, 1, 1, 1, 1, False, str(model_dir), str(root / "reference"))
    return model_dir, results[0], hf_tensors(root / "reference")


def test_grpo_step_changes_weights_and_clips(setup):
    model_dir, reference, updated = setup
    original = hf_tensors(model_dir)
    assert reference["grad_norm"] > 1.0, "the batch should need clipping at max_grad_norm=1.0"
    assert reference["tp_group_warnings"] == 0, "a Megatron call fell back to the global TP group"
    changed = [name for name in original if not torch.equal(original[name], updated[name])]
    assert sorted(changed) == sorted(original), f"unchanged after the step: {set(original) - set(changed)}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,pp,dp,sp",
    [(2, 1, 1, False), (2, 1, 1, True), (1, 2, 1, False), (1, 1, 2, False), (2, 2, 1, False)],
    ids=["tp2", "tp2_sp", "pp2", "dp2", "tp2_pp2"],
)
def test_grpo_step_matches_single_process(setup, tmp_path, tp, pp, dp, sp):
    model_dir, reference, ref_weights = setup
    compare = (tp, pp, dp, sp) in ((2, 1, 1, False), (1, 2, 1, False))
    results = run_distributed(_grpo_step, tp * pp * dp, tp, pp, dp, sp, str(model_dir), str(tmp_path / "out"),
                              "float32", compare)
    if compare:
        _assert_recompute_changes_nothing(results, tmp_path / "out")
    loss = sum(r["loss"] for r in results if r["loss"] is not None)
    assert loss == pytest.approx(reference["loss"], rel=1e-5)
    assert all(r["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5) for r in results)
    assert results[0]["tp_group_warnings"] == 0, "a Megatron call fell back to the global TP group"
    weights = hf_tensors(tmp_path / "out")
    assert sorted(weights) == sorted(ref_weights)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def setup_bf16(setup, tmp_path_factory):
    model_dir = setup[0]
    root = tmp_path_factory.mktemp("grpo_step_bf16")
    results = run_distributed(_grpo_step, 1, 1, 1, 1, False, str(model_dir), str(root / "reference"), "bfloat16")
    return model_dir, results[0], hf_tensors(root / "reference")


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2"])
def test_bf16_grpo_step_matches_single_process_within_bf16_rounding(setup_bf16, tmp_path, tp, pp, dp):
    """TRL's default precision. Layouts reorder bf16 sums (TP's row-parallel all-reduce adds bf16 partial sums,
    DP averages gradients of other micro-batch splits), so equality holds up to bf16 rounding, not bit for bit:
    - loss and grad norm: relative 2e-2 (bf16 has 8 mantissa bits, ~4e-3 per rounding; a few roundings deep);
    - weights: Adam's update is lr * m / (sqrt(v) + eps), at most lr = 1e-3 in size whatever the gradient, so a
      gradient that rounds differently moves a weight by at most 2 * lr; plus one bf16 step of the weight itself
      (2^-8 relative). Every weight must be within that bound, and at most 1% of any tensor may differ by more than
      lr / 2 (a wrong layout moves most weights by about lr).
    """
    model_dir, reference, ref_weights = setup_bf16
    assert all(t.dtype == torch.bfloat16 for t in ref_weights.values()), "a bf16 run exports bf16 weights"
    compare = dp == 1  # tp2, pp2
    results = run_distributed(_grpo_step, tp * pp * dp, tp, pp, dp, False, str(model_dir), str(tmp_path / "out"),
                              "bfloat16", compare)
    if compare:
        _assert_recompute_changes_nothing(results, tmp_path / "out")
    loss = sum(r["loss"] for r in results if r["loss"] is not None)
    assert loss == pytest.approx(reference["loss"], rel=2e-2)
    assert all(r["grad_norm"] == pytest.approx(reference["grad_norm"], rel=2e-2) for r in results)
    weights = hf_tensors(tmp_path / "out")
    assert sorted(weights) == sorted(ref_weights)
    lr = 1e-3
    for name, ref in ref_weights.items():
        diff = (weights[name].double() - ref.double()).abs()
        bound = 2 * lr + ref.double().abs() * 2.0**-8
        assert (diff <= bound).all(), f"{name}: max |diff| {float(diff.max()):.3g} beyond 2*lr + 1 bf16 step"
        far = float((diff > lr / 2).double().mean())  # measured: at most 0.0002 (TP2), 0 (PP2: bit-exact)
        assert far <= 0.01, f"{name}: {far:.1%} of the weights differ by more than lr / 2 (a layout error moves most)"


def _fp16_steps(model_dir: str, out_dir: str) -> dict:
    """One fp16 step at the starting loss scale, then one from the same checkpoint at a scale that overflows."""
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel

    fp16 = ModelConfig(dtype="float16")
    trained = grpo_step_and_export(model_dir, ParallelConfig(), fp16, f"{out_dir}/trained")
    destroy_parallel(keep_process_group=True)
    overflow = grpo_step_and_export(model_dir, ParallelConfig(), fp16, f"{out_dir}/overflow", loss_scale=2.0**40)
    return {"trained": trained, "overflow": overflow}


@pytest.mark.slow
def test_fp16_step_scales_the_loss_equals_fp32_and_an_overflow_skips_the_update(setup, tmp_path):
    """TRL's `fp16=True`: Megatron's fp16 optimizer divides the gradients by its loss scale, so the schedule must
    multiply each backward by it (`grad_scale_func`; without it the gradients were 2**-32 of their size and the weights
    barely moved). The step equals the fp32 step within fp16 rounding (bounds as in the bf16 test, fp16's 2^-11 step),
    at PyTorch GradScaler's starting scale 2**16. Gradients that overflow (scale 2**40) skip the update: every weight
    unchanged, grad_norm NaN, the scale halved, the LR schedule not advanced, and no error."""
    model_dir, reference, ref_weights = setup
    result = run_distributed(_fp16_steps, 1, str(model_dir), str(tmp_path))[0]
    trained, overflow = result["trained"], result["overflow"]
    assert trained["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-2)
    assert trained["loss"] == pytest.approx(reference["loss"], rel=1e-2)
    assert trained["loss_scale"] == 2.0**16 and trained["lr_steps"] == 1
    weights, lr = hf_tensors(tmp_path / "trained"), 1e-3
    assert all(t.dtype == torch.float16 for t in weights.values()) and sorted(weights) == sorted(ref_weights)
    for name, ref in ref_weights.items():
        diff = (weights[name].double() - ref.double()).abs()
        assert (diff <= 2 * lr + ref.double().abs() * 2.0**-11).all(), f"{name}: max |diff| {float(diff.max()):.3g}"
        assert float((diff > lr / 2).double().mean()) <= 0.01, f"{name}: the fp16 step moved other weights"
    assert overflow["grad_norm"] != overflow["grad_norm"], "an overflowed step reports grad_norm NaN"
    assert overflow["loss_scale"] == 2.0**39 and overflow["lr_steps"] == 0
    original, kept = hf_tensors(model_dir), hf_tensors(tmp_path / "overflow")
    for name, weight in original.items():
        assert torch.equal(kept[name], weight.to(torch.float16)), f"{name}: an overflowed step changed the weight"
