"""Mixtral (issue #30: routed experts under Mixtral's checkpoint names, Llama attention, the expert width in
`intermediate_size`) through the sharded Megatron policy on gloo, in ONE launch of 2 ranks (layouts one after another;
Megatron's groups are rebuilt between them, the process group is kept):

(a) for every layout, Megatron's logits equal Hugging Face transformers' MixtralForCausalLM logits of the same
    checkpoint, and the HF export gives back every tensor bit for bit (the checkpoint round trip): EP1 (x DP2), EP2
    (x DP2, each rank holds 2 of the 4 experts), TP2 x EP2 with sequence parallelism, PP2 (2 MoE layers per stage);
(b) one GRPO optimizer step at EP2 (x DP2) and at TP2 x EP2 with sequence parallelism equals the step at EP1 (x DP2,
    the same micro-batches): summed loss, gradient norm and every updated weight, with the load-balancing aux loss
    on (z-loss too where no SP: test_qwen3_layouts.py says why not under SP), so the router's extra gradients go
    through expert parallelism; the router and the experts move;
(c) routing replay (R3) and the router-agreement metric at EP2: test_routing_replay.py's checks, on Mixtral.
The Qwen3-MoE cases (tests/distributed/test_qwen3_layouts.py) cover bf16, recompute on / off and packed rows on the
same MoE code path; this file checks what Mixtral adds: its config translation and its names.
"""

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.distributed.test_routing_replay import _check as _replay_check
from tests.distributed.test_routing_replay import check_replay_results
from tests.helpers.policy import grpo_step_and_export, hf_logits, hf_tensors, logits_and_export

LOGIT_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1)]
"""(tp, pp, ep) on 2 ranks: dp = 2 / (tp * pp); sequence parallelism at tp > 1."""
STEP_LAYOUTS = [("ep1", 1, 1, 1e-3), ("ep2", 1, 2, 1e-3), ("ep1_no_z", 1, 1, 0.0), ("tp2_ep2_sp", 2, 2, 0.0)]
"""(name, tp, ep, z-loss) of the GRPO step (pp1, float32, aux loss 1e-2)."""


def _layout_name(tp: int, pp: int, ep: int) -> str:
    return f"mixtral-tp{tp}_pp{pp}_ep{ep}"


def _all_layouts(model_dir: str, out_root: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel

    results = {}
    for tp, pp, ep in LOGIT_LAYOUTS:
        name = _layout_name(tp, pp, ep)
        parallel = ParallelConfig(tp_size=tp, pp_size=pp, ep_size=ep, sequence_parallel=tp > 1)
        results[name] = logits_and_export(model_dir, parallel, f"{out_root}/{name}")
        destroy_parallel(keep_process_group=True)
    for name, tp, ep, z_loss in STEP_LAYOUTS:
        parallel = ParallelConfig(tp_size=tp, ep_size=ep, sequence_parallel=tp > 1)
        model_cfg = ModelConfig(dtype="float32", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=z_loss)
        results[f"step-{name}"] = grpo_step_and_export(model_dir, parallel, model_cfg, f"{out_root}/step-{name}",
                                                       width_multiple=2)
        destroy_parallel(keep_process_group=True)
    results["replay-ep2"] = _replay_check(model_dir, 1, 2)
    destroy_parallel(keep_process_group=True)
    return results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("mixtral")
    model_dir = str(build_tiny_model(root / "mixtral", "mixtral", seed=7))
    return model_dir, root / "out", run_distributed(_all_layouts, 2, model_dir, str(root / "out"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LOGIT_LAYOUTS, ids=[_layout_name(*x) for x in LOGIT_LAYOUTS])
def test_mixtral_logits_match_hf_and_export_is_byte_exact(launched, layout):
    model_dir, out_root, results = launched
    name = _layout_name(*layout)
    logits = [r[name] for r in results if r[name] is not None]
    assert logits, "some rank (last stage, TP rank 0) reports logits"
    reference = hf_logits(model_dir)
    for got in logits:
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    original, exported = hf_tensors(model_dir), hf_tensors(out_root / name)
    assert sorted(exported) == sorted(original)
    assert any(".block_sparse_moe.experts.3.w3." in n for n in original)
    for tensor_name, tensor in original.items():
        assert exported[tensor_name].dtype == tensor.dtype and torch.equal(exported[tensor_name], tensor), tensor_name


def _step(launched, name: str):
    """(loss summed over the reporting ranks, grad norm, weights after the step) of one step layout."""
    _, out_root, results = launched
    loss = sum(r[f"step-{name}"]["loss"] for r in results if r[f"step-{name}"]["loss"] is not None)
    return loss, results[0][f"step-{name}"]["grad_norm"], hf_tensors(out_root / f"step-{name}")


@pytest.mark.slow
@pytest.mark.parametrize("layout,reference", [("ep2", "ep1"), ("tp2_ep2_sp", "ep1_no_z")], ids=["ep2", "tp2_ep2_sp"])
def test_mixtral_grpo_step_equals_ep1(launched, layout, reference):
    loss1, grad_norm1, after1 = _step(launched, reference)
    loss, grad_norm, after = _step(launched, layout)
    assert loss == pytest.approx(loss1, rel=1e-5)
    assert grad_norm == pytest.approx(grad_norm1, rel=1e-5)
    before = hf_tensors(launched[0])
    assert sorted(after) == sorted(after1) == sorted(before)
    moved = [n for n in before if not torch.equal(before[n], after1[n])]
    assert any(".block_sparse_moe.gate." in n for n in moved), "the router trains"
    assert any(".block_sparse_moe.experts.3." in n for n in moved), "the experts train"
    for name, weight in after1.items():
        torch.testing.assert_close(after[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_mixtral_routing_replay_and_router_agreement_at_ep2(launched):
    check_replay_results([r["replay-ep2"] for r in launched[2]])
