"""Qwen3 (per-head q/k RMSNorm, head_dim != hidden / heads) and Qwen3-MoE (routed experts, expert parallelism) through
the sharded Megatron policy on gloo, all in ONE launch of 2 ranks (several layouts one after another; Megatron's
groups are rebuilt between them, the process group is kept):

(a) for every layout, Megatron's logits equal Hugging Face transformers' logits of the same checkpoint, and the HF
    export gives back every tensor bit for bit: Qwen3 at TP1 (x DP2), TP2, PP2; Qwen3-MoE at EP1 (x DP2), EP2 (x DP2,
    each rank holds 2 of the 4 experts), PP2 (2 MoE layers per stage) and TP2 x EP2 with sequence parallelism (expert
    TP 1);
(b) one GRPO optimizer step of the tiny Qwen3-MoE at EP2 (x DP2) and at TP2 x EP2 with sequence parallelism (DP1:
    Megatron refuses MoE training at TP > 1 without SP) equals the step at EP1 (x DP2, the same micro-batches): the
    summed loss, the gradient norm and every updated weight, with the load-balancing aux loss (1e-2) and z-loss (1e-3,
    not under SP: see the test) on, so the router's extra gradients go through expert parallelism too (Megatron's
    all-to-all token dispatcher).
    Every step layout reads rows widened to 14 tokens (SP splits the sequence over 2 ranks; all layouts get the same
    rows). EP1 x DP2 is the reference: DP2 = one process
    is test_grpo_step_layouts.py's dp2 case, and the micro-batches are the single process's;
    Every step runs with activation recompute (TRL's default: full, uniform, one layer), and EP2 also without it
    (`ep2_no_recompute`): the two are equal bit for bit, with twice the layer forwards when it is on;
(c) the same step in bf16 (TRL's default precision) at EP2 against EP1, within bf16 rounding (tolerances in the test);
(d) at TP2 x EP2 with SP, the step on packed rows equals the step on right-padded rows: padding stays out of the
    aux loss; and so does the packed step at TP2 x PP2 x EP2 with SP (a second launch, 4 ranks).
"""

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers.policy import LEARNING_RATE, grpo_step_and_export, hf_logits, hf_tensors, logits_and_export

LOGIT_LAYOUTS = [  # (family, tp, pp, ep) on 2 ranks: dp = 2 / (tp * pp); sequence parallelism on at tp > 1 for MoE
    ("qwen3", 1, 1, 1), ("qwen3", 2, 1, 1), ("qwen3", 1, 2, 1),
    ("qwen3_moe", 1, 1, 1), ("qwen3_moe", 1, 1, 2), ("qwen3_moe", 2, 1, 2), ("qwen3_moe", 1, 2, 1),
]
STEP_LAYOUTS = [  # (name, tp, ep, dtype, packed, micro-batch rows, z-loss) of the Qwen3-MoE GRPO step (pp1; SP at tp2)
    ("ep1", 1, 1, "float32", False, 2, 1e-3), ("ep2", 1, 2, "float32", False, 2, 1e-3),
    ("ep1_bf16", 1, 1, "bfloat16", False, 2, 1e-3), ("ep2_bf16", 1, 2, "bfloat16", False, 2, 1e-3),
    # sequence parallel: z-loss off (see test_qwen3_moe_grpo_step_equals_ep1)
    ("ep1_no_z", 1, 1, "float32", False, 2, 0.0), ("tp2_ep2_sp", 2, 2, "float32", False, 2, 0.0),
    ("ep1_no_z_no_aux", 1, 1, "float32", False, 2, 0.0),  # the aux loss off: test_moe_aux_loss_acts_on_the_gradient
    ("tp2_ep2_sp_mb8", 2, 2, "float32", False, 8, 0.0), ("tp2_ep2_sp_packed", 2, 2, "float32", True, 8, 0.0),
    ("ep2_no_recompute", 1, 2, "float32", False, 2, 1e-3),
]


def _layout_name(family: str, tp: int, pp: int, ep: int) -> str:
    return f"{family}-tp{tp}_pp{pp}_ep{ep}"


def _all_layouts(model_dirs: dict, out_root: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig, TrainConfig
    from engine.policy.parallel import destroy_parallel

    results = {}
    for family, tp, pp, ep in LOGIT_LAYOUTS:
        name = _layout_name(family, tp, pp, ep)
        parallel = ParallelConfig(tp_size=tp, pp_size=pp, ep_size=ep, sequence_parallel=family == "qwen3_moe" and tp > 1)
        results[name] = logits_and_export(model_dirs[family], parallel, f"{out_root}/{name}")
        destroy_parallel(keep_process_group=True)
    for name, tp, ep, dtype, packed, rows, z_loss in STEP_LAYOUTS:
        parallel = ParallelConfig(tp_size=tp, ep_size=ep, sequence_parallel=tp > 1)
        model_cfg = ModelConfig(dtype=dtype, moe_aux_loss_coeff=0.0 if name.endswith("no_aux") else 1e-2,
                                moe_z_loss_coeff=z_loss)
        results[f"step-{name}"] = grpo_step_and_export(model_dirs["qwen3_moe"], parallel, model_cfg,
                                                       f"{out_root}/step-{name}", width_multiple=2,
                                                       padding_free=packed, micro_batch_size=rows,
                                                       train=TrainConfig(gradient_checkpointing="no_recompute" not in name))
        destroy_parallel(keep_process_group=True)
    return results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("qwen3")
    model_dirs = {family: str(build_tiny_model(root / family, family, seed=7)) for family in ("qwen3", "qwen3_moe")}
    results = run_distributed(_all_layouts, 2, model_dirs, str(root / "out"))
    return model_dirs, root / "out", results


@pytest.mark.slow
@pytest.mark.parametrize("layout", LOGIT_LAYOUTS, ids=[_layout_name(*x) for x in LOGIT_LAYOUTS])
def test_qwen3_logits_match_hf_and_export_is_byte_exact(launched, layout):
    model_dirs, out_root, results = launched
    name = _layout_name(*layout)
    logits = [r[name] for r in results if r[name] is not None]
    assert logits, "some rank (last stage, TP rank 0) reports logits"
    reference = hf_logits(model_dirs[layout[0]])
    for got in logits:
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    original, exported = hf_tensors(model_dirs[layout[0]]), hf_tensors(out_root / name)
    assert sorted(exported) == sorted(original)
    for tensor_name, tensor in original.items():
        assert exported[tensor_name].dtype == tensor.dtype and torch.equal(exported[tensor_name], tensor), tensor_name


def _step(launched, name: str):
    """(loss summed over the reporting ranks, grad norm, weights after the step) of one step layout."""
    model_dirs, out_root, results = launched
    loss = sum(r[f"step-{name}"]["loss"] for r in results if r[f"step-{name}"]["loss"] is not None)
    return loss, results[0][f"step-{name}"]["grad_norm"], hf_tensors(out_root / f"step-{name}")


@pytest.mark.slow
@pytest.mark.parametrize("layout,reference", [("ep2", "ep1"), ("tp2_ep2_sp", "ep1_no_z")], ids=["ep2", "tp2_ep2_sp"])
def test_qwen3_moe_grpo_step_equals_ep1(launched, layout, reference):
    """Under sequence parallelism the z-loss is off: Megatron's z-loss is the mean over each TP rank's own valid
    tokens (moe_utils.py z_loss_func), and the two halves of a padded sequence hold different numbers of them, so
    its weighting differs from one process's mean over all tokens (measured: grad norm rel 8e-5 from EP1 with z-loss
    1e-3; with the aux loss alone rel 1e-7)."""
    model_dirs = launched[0]
    loss1, grad_norm1, after1 = _step(launched, reference)
    loss, grad_norm, after = _step(launched, layout)
    assert loss == pytest.approx(loss1, rel=1e-5)
    assert grad_norm == pytest.approx(grad_norm1, rel=1e-5)
    before = hf_tensors(model_dirs["qwen3_moe"])
    assert sorted(after) == sorted(after1) == sorted(before)
    moved = [n for n in before if not torch.equal(before[n], after1[n])]
    assert any(".mlp.gate." in n for n in moved) and any(".experts.3." in n for n in moved), "router and experts train"
    for name, weight in after1.items():
        torch.testing.assert_close(after[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_moe_aux_loss_acts_on_the_gradient(launched):
    """model.moe_aux_loss_coeff (TRL's router_aux_loss_coef; by default the HF config's) acts: the same step with
    the load-balancing loss at 1e-2 and at 0 reports the same GRPO loss (the aux loss is not in it) but moves the
    routers differently, and with a larger gradient norm."""
    loss_on, norm_on, after_on = _step(launched, "ep1_no_z")
    loss_off, norm_off, after_off = _step(launched, "ep1_no_z_no_aux")
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert norm_on != pytest.approx(norm_off, rel=1e-7)
    gates = [n for n in after_on if ".mlp.gate." in n]
    assert gates and all(not torch.equal(after_on[n], after_off[n]) for n in gates), "every router feels the aux loss"


@pytest.mark.slow
def test_qwen3_moe_grpo_step_with_recompute_equals_step_without(launched):
    """EP2 (x DP2), aux loss and z-loss on: full recompute reruns every MoE layer (router, all-to-all dispatch, experts)
    in the backward; the step must not change by a bit."""
    loss, grad_norm, after = _step(launched, "ep2")
    loss_off, grad_norm_off, after_off = _step(launched, "ep2_no_recompute")
    forwards = [(r["step-ep2"]["layer_forwards"], r["step-ep2_no_recompute"]["layer_forwards"]) for r in launched[2]]
    assert all(on == 2 * off > 0 for on, off in forwards), f"recompute did not run the layers again: {forwards}"
    assert loss == loss_off and grad_norm == grad_norm_off
    for name, weight in after_off.items():
        assert torch.equal(after[name], weight), f"{name}: recompute changed the step"


@pytest.mark.slow
def test_qwen3_moe_packed_step_equals_padded_step_with_aux_loss(launched):
    """The trainer's default packed rows (engine/policy/packing.py) against right-padded rows, one micro-batch of all 8
    sequences each (the aux loss is per micro-batch: the same tokens in both), at TP2 x EP2 with sequence parallelism.
    The padding of either layout must stay out of the routers' aux loss (engine/policy/step.py moe_padding_mask):
    without it the packed step's gradient norm was 1.9e6 against the padded step's 14.8 (the aux loss's gradient
    landed on the pad token's embedding row)."""
    loss, grad_norm, after = _step(launched, "tp2_ep2_sp_mb8")
    loss_packed, grad_norm_packed, after_packed = _step(launched, "tp2_ep2_sp_packed")
    assert loss_packed == pytest.approx(loss, rel=1e-5)
    assert grad_norm_packed == pytest.approx(grad_norm, rel=1e-5)
    for name, weight in after.items():
        torch.testing.assert_close(after_packed[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _packed_step_tp2_pp2_ep2(model_dir: str, out_dir: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig

    parallel = ParallelConfig(tp_size=2, pp_size=2, ep_size=2, sequence_parallel=True)
    model_cfg = ModelConfig(dtype="float32", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=0.0)
    return grpo_step_and_export(model_dir, parallel, model_cfg, out_dir, width_multiple=2, padding_free=True,
                                micro_batch_size=8)


@pytest.mark.slow
def test_qwen3_moe_packed_step_at_tp2_pp2_ep2_sp_equals_padded_tp2_ep2_sp(launched, tmp_path):
    """4 ranks: TP2 x PP2 (2 MoE layers per stage) x EP2 with sequence parallelism on packed rows, against the 2-rank
    padded TP2 x EP2 step with the same micro-batch (aux loss on). The second stage gets its half of the padding mask
    from the engine (Megatron's GPTModel splits it on the first stage only)."""
    model_dirs = launched[0]
    loss, grad_norm, after = _step(launched, "tp2_ep2_sp_mb8")
    results = run_distributed(_packed_step_tp2_pp2_ep2, 4, model_dirs["qwen3_moe"], str(tmp_path / "out"))
    assert sum(r["loss"] for r in results if r["loss"] is not None) == pytest.approx(loss, rel=1e-5)
    assert all(r["grad_norm"] == pytest.approx(grad_norm, rel=1e-5) for r in results)
    got = hf_tensors(tmp_path / "out")
    for name, weight in after.items():
        torch.testing.assert_close(got[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_qwen3_moe_bf16_grpo_step_at_ep2_equals_ep1_within_bf16_rounding(launched):
    """bf16 parameters and activations (fp32 master weights and Adam state in the distributed optimizer). EP2 sums
    the same numbers in another order: each expert's tokens arrive through the all-to-all in another order and
    the weighted expert outputs are combined after it, and DP averages the gradients of other partial sums; so
    equality holds up to bf16 rounding, not bit for bit (test_grpo_step_layouts.py's bf16 cases argue the same):
    - loss and grad norm: relative 2e-2 (8 mantissa bits, ~4e-3 per rounding, a few roundings deep);
    - weights: Adam's first update is lr * m / (sqrt(v) + eps), at most lr in size whatever the gradient, so a
      gradient that rounds differently moves a weight by at most 2 * lr; plus one bf16 step of the weight itself
      (2^-8 relative). Every weight must be within that bound, and at most 1% of any tensor may differ by more
      than lr / 2 (an expert or router wired wrong moves most of its weights by about lr).
    A router whose top-k flips between layouts for a near-tied token sends that token to another expert: that is
    what the 1% allows (the fp32 test above is the exact one). Measured (2 CPU cores, gloo): loss and grad norm equal
    to 6 digits, 6106 weights not bit-equal, the largest by 2.4e-4 (< lr / 2), 0% of any tensor beyond lr / 2.
    """
    model_dirs = launched[0]
    loss1, grad_norm1, after1 = _step(launched, "ep1_bf16")
    loss2, grad_norm2, after2 = _step(launched, "ep2_bf16")
    assert all(t.dtype == torch.bfloat16 for t in after1.values()), "a bf16 run exports bf16 weights"
    assert loss2 == pytest.approx(loss1, rel=2e-2)
    assert grad_norm2 == pytest.approx(grad_norm1, rel=2e-2)
    assert sorted(after2) == sorted(after1)
    before = hf_tensors(model_dirs["qwen3_moe"])
    moved = [n for n in before if not torch.equal(before[n], after1[n])]
    assert any(".mlp.gate." in n for n in moved) and any(".experts.3." in n for n in moved), "router and experts train"
    worst, largest, unequal = 0.0, 0.0, 0
    for name, ref in after1.items():
        diff = (after2[name].double() - ref.double()).abs()
        bound = 2 * LEARNING_RATE + ref.double().abs() * 2.0**-8
        assert (diff <= bound).all(), f"{name}: max |diff| {float(diff.max()):.3g} beyond 2*lr + 1 bf16 step"
        far = float((diff > LEARNING_RATE / 2).double().mean())
        worst, largest, unequal = max(worst, far), max(largest, float(diff.max())), unequal + int((diff > 0).sum())
        assert far <= 0.01, f"{name}: {far:.1%} of the weights differ by more than lr / 2 (a layout error moves most)"
    print(f"bf16 EP2 vs EP1: loss {loss2:.6g} / {loss1:.6g}, grad norm {grad_norm2:.6g} / {grad_norm1:.6g}, "
          f"largest |diff| {largest:.3g}, {unequal} weights not bit-equal, largest share of a tensor beyond lr/2: "
          f"{worst:.2%}")
