"""Mixtral (routed experts under Mixtral's checkpoint names, Llama attention, the expert width in
`intermediate_size`), GLM-4.5 MoE (sigmoid routing on float32 scores + the expert-score correction bias, 2 expert
groups with 1 chosen per token, routed weights x 2.5, a shared expert, a dense first layer, QKV bias, q/k norms, RoPE
on half of each head) and GPT-OSS (learned sinks, sliding-window layers of 4 keys alternating with full ones, YaRN,
q/k/v/o, router and expert biases, the clamped SwiGLU, experts stacked in HF's tensors) and DeepSeek-V3 (multi-latent
attention with YaRN and interleaved rope dims, GLM-4.5's router and layer pattern over 8 experts in 2 groups, where
the group choice and the top-2 within it both act) through the sharded Megatron
policy on gloo, one launch of 2 ranks per family (its layouts one after another; the layout's groups are rebuilt
between them, the process group is kept), each with a budget that grows with the layouts it builds:

(a) for every layout, Megatron's logits equal Hugging Face transformers' logits of the same checkpoint
    (MixtralForCausalLM, Glm4MoeForCausalLM, GptOssForCausalLM), and the HF export gives back every tensor bit for bit, GLM's float32
    expert bias included (the checkpoint round trip; DeepSeek-V3's checkpoint carries a multi-token-prediction layer,
    neither built nor trained, which every export copies byte for byte into its own shard, keeping
    num_nextn_predict_layers=1, and the export loads in transformers): EP1 (x DP2), EP2 (x DP2, each rank holds 2 of the 4 experts),
    TP2 x EP2 with sequence parallelism, PP2 (2 layers per stage: GLM's first stage holds the dense layer and an MoE
    layer);
(b) one GRPO optimizer step at EP2 (x DP2) and at TP2 x EP2 with sequence parallelism equals the step at EP1 (x DP2,
    the same micro-batches): summed loss, gradient norm and every updated weight, with the load-balancing aux loss
    on (z-loss too where no SP: test_qwen3_layouts.py says why not under SP), so the router's extra gradients go
    through expert parallelism; the router and the experts move (GLM: the shared expert too; its expert bias stays
    frozen, bit for bit: engine/policy/moe_config.py sigmoid_router_settings says why; GPT-OSS: sinks, o_proj and expert
    biases too, and the grad norm at TP2 x EP2 counts every expert's fc2 bias once: engine/policy/optimizer.py);
(c) routing replay (R3) and the router-agreement metric at EP2: test_routing_replay.py's checks, on both families
    (GLM: the dense layer has no routes; the agreement counts its 3 MoE layers).
Gemma 3 text (dense; sliding / full layers with two RoPE bases, (1 + w) norms, post-norms, scaled embeddings, tied)
runs in the same launch: (a) at TP1 (x DP2), TP2 with sequence parallelism and PP2; (b) the GRPO step at TP2 + SP
and with packed rows (block-causal mask AND the window, TP1) equals the padded TP1 step, every norm moving. Gemma 2
(the same layer code, attention logits soft-capped, no q/k norms, one RoPE base, final logits soft-capped): (a) at TP1
and TP2 + SP, against HF's eager attention (tests/helpers/policy.py hf_logits says why), the soft-capped logits and
the fused LM-head kernel's log-probs at temperature 0.9 (the cap applied inside the kernel, vocab-parallel at TP2);
(b) the GRPO step at TP2 + SP equals the TP1 step. Cohere 2 (attention and MLP in parallel off one bias-free
LayerNorm, interleaved RoPE on the sliding layers only, none on the global ones, logits x logit_scale 0.25, tied): (a)
at TP1, TP2 + SP and PP2, logits and the kernel's log-probs at temperature 0.9 (logit_scale folded into the kernel's
temperature); (b) the GRPO step at TP2 + SP and with packed rows (TP1) equals the padded TP1 step, every norm, the tied
embedding and the MLP moving. Nemotron-H (Mamba-2 / attention without RoPE / relu2 MLP / MoE layers, 'ME*-EM', the
mixer in pure PyTorch: engine/models/nemotron_h/layers.py; the MoE layers' non-gated relu2 experts with GLM-4.5's router
and a shared expert): (a) at TP1, TP2 + SP (8 Mamba heads, 2 groups: one group per rank), PP2 and EP2, logits and the
kernel's log-probs; (b) the GRPO step at TP2 + SP and with packed rows (the conv and scan restarted at each sequence,
TP1) equals the padded TP1 step, every Mamba-2 parameter (in_proj, conv weight and bias, dt_bias, A_log, D, the gated
norm, out_proj), the router, the experts and the shared expert moving, the expert bias frozen; the MoE variant's step
at TP2 + SP (TP2 x EP1, expert TP 1: the experts' gradients summed over both TP ranks' token halves) and at EP2 too.
The Qwen3-MoE cases (tests/distributed/test_qwen3_layouts.py) cover bf16, recompute on / off and packed rows on the
same MoE code path; this file checks what Mixtral and GLM-4.5 add: their config translation and their names.
"""

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.distributed.test_routing_replay import _check as _replay_check
from tests.distributed.test_routing_replay import check_replay_results
from tests.helpers.policy import grpo_step_and_export, hf_logits, hf_logprobs, hf_tensors, logits_and_export

FAMILIES = {"mixtral": {"router": ".block_sparse_moe.gate.", "expert": ".block_sparse_moe.experts.3.w3."},
            "glm4_moe": {"router": ".mlp.gate.weight", "expert": ".mlp.experts.3.up_proj.",
                         "shared": ".mlp.shared_experts.", "frozen": ".e_score_correction_bias"},
            "gpt_oss": {"router": ".mlp.router.bias", "expert": ".mlp.experts.gate_up_proj_bias",
                        "moved": (".self_attn.sinks", ".self_attn.o_proj.bias", ".mlp.experts.down_proj_bias")},
            "deepseek_v3": {"router": ".mlp.gate.weight", "expert": ".mlp.experts.7.up_proj.",
                            "shared": ".mlp.shared_experts.", "frozen": ".e_score_correction_bias",
                            "mtp": "model.layers.4.",
                            "moved": (".self_attn.q_a_proj.weight", ".self_attn.q_a_layernorm.weight",
                                      ".self_attn.q_b_proj.weight", ".self_attn.kv_a_proj_with_mqa.weight",
                                      ".self_attn.kv_a_layernorm.weight", ".self_attn.kv_b_proj.weight")}}
"""Each family's tiny model (engine/models/tiny_model.py) and the HF names its checks look for; "mtp": the prefix of
the multi-token-prediction layer added to its checkpoint (tests/helpers/mtp.py), which every export must carry."""

DENSE_FAMILIES = {
    "gemma3_text": {"logits": [(1, 1, 1), (2, 1, 1), (1, 2, 1)], "steps": ("tp1", "tp2_sp", "tp1_packed"),
                    "moved": (".post_attention_layernorm.", ".post_feedforward_layernorm.", ".pre_feedforward_layernorm.",
                              ".self_attn.q_norm.", ".mlp.gate_proj.")},
    # Gemma 3's code path + attention and final-logit soft-capping: the log-probs too, and the step at TP2
    "gemma2": {"logits": [(1, 1, 1), (2, 1, 1)], "logprob_temperature": 0.9, "steps": ("tp1", "tp2_sp"),
               "moved": (".post_attention_layernorm.", ".mlp.gate_proj.")},
    # parallel attention + MLP off one bias-free LayerNorm, RoPE on the sliding layers only, logits x logit_scale
    "cohere2": {"logits": [(1, 1, 1), (2, 1, 1), (1, 2, 1)], "logprob_temperature": 0.9,
                "steps": ("tp1", "tp2_sp", "tp1_packed"),
                "moved": (".input_layernorm.", "model.norm.", ".self_attn.k_proj.", ".mlp.gate_proj.",
                          "model.embed_tokens.")},
    # hybrid Mamba-2 / attention (no RoPE) / relu2 MLP, one mixer per layer; the mixer's conv, scan and gated norm
    "nemotron_h": {"logits": [(1, 1, 1), (2, 1, 1), (1, 2, 1)], "logprob_temperature": 0.9,
                   "steps": ("tp1", "tp2_sp", "tp1_packed"),
                   "moved": (".mixer.in_proj.", ".mixer.conv1d.weight", ".mixer.conv1d.bias", ".mixer.dt_bias",
                             ".mixer.A_log", ".mixer.D", ".mixer.norm.", ".mixer.out_proj.", ".mixer.k_proj.",
                             ".mixer.up_proj.", "backbone.norm_f.", "lm_head.")},
    # its variant with MoE ('E') layers, 'ME*-EM': non-gated relu2 experts, GLM-4.5's router, a shared expert
    # TP2 + SP is TP2 x EP1 with expert TP 1: whole experts replicated on both TP ranks, each seeing half the tokens
    # (engine/policy/moe_config.py mark_expert_params); EP2: 2 experts per rank
    "nemotron_h_moe": {"logits": [(1, 1, 1), (2, 1, 1), (1, 1, 2)], "logprob_temperature": 0.9,
                       "steps": ("tp1", "tp2_sp", "tp1_packed", "ep2"),
                       "moved": (".mixer.gate.weight", ".mixer.experts.3.up_proj.", ".mixer.experts.0.down_proj.",
                                 ".mixer.shared_experts.down_proj.", ".mixer.in_proj."),
                       "frozen": ".mixer.gate.e_score_correction_bias"},
}
"""Dense families (no expert layouts, no routing): their logit layouts (tp, pp, ep), the temperature of a log-prob
check against HF's (none where absent), their GRPO step layouts (`DENSE_STEP_LAYOUTS` names) and the HF names the step
must move."""
MOE_VARIANTS = {"nemotron_h_moe": "nemotron_h"}
"""Keys above whose tiny model is a family's variant with MoE layers (engine/models/tiny_model.py `moe_layers`)."""

LOGIT_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1)]
"""(tp, pp, ep) on 2 ranks: dp = 2 / (tp * pp); sequence parallelism at tp > 1."""
STEP_LAYOUTS = [("ep1", 1, 1, 1e-3), ("ep2", 1, 2, 1e-3), ("ep1_no_z", 1, 1, 0.0), ("tp2_ep2_sp", 2, 2, 0.0)]
"""(name, tp, ep, z-loss) of the GRPO step (pp1, float32, aux loss 1e-2)."""


DENSE_STEP_LAYOUTS = [("tp1", 1, 1, False), ("tp2_sp", 2, 1, False), ("tp1_packed", 1, 1, True), ("ep2", 1, 2, False)]
"""(name, tp, ep, packed rows) of a dense family's GRPO step (pp1, float32; ep2: its MoE variant). Packed
micro-batches take 4 rows' tokens: at 2 (DP2, 4 sequences per rank) no row held two sequences, and ignoring the mask
went unnoticed."""
LOGIT_CASES = ([(family, layout) for family in FAMILIES for layout in LOGIT_LAYOUTS]
               + [(family, layout) for family, case in DENSE_FAMILIES.items() for layout in case["logits"]])


BF16_MEAN_FACTOR, BF16_MAX_FACTOR = 1.1, 1.5
"""How far the policy's bf16 logits may sit from HF's fp32 ones, in multiples of HF's bf16 model's own error (mean and
max over every logit). Measured on the tiny models: the engine's mean error is 0.98-1.04x HF's, its max 0.85-1.18x;
Gemma's (1 + w) norm run in bf16 instead of fp32 gave 1.21-1.29x the mean (mutation check)."""


def _layout_name(tp: int, pp: int, ep: int) -> str:
    return f"tp{tp}_pp{pp}_ep{ep}"


def _bf16_logits(model_dir: str, out_root: str):
    """The policy's logits in bf16 (TRL's default precision) at TP1 (x DP2); None off the reporting rank."""
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel

    logits = logits_and_export(model_dir, ParallelConfig(), f"{out_root}/bf16", model_cfg=ModelConfig(dtype="bfloat16"))
    destroy_parallel(keep_process_group=True)
    return logits


def _family_layouts(model_dir: str, out_root: str) -> dict:
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
    results["bf16"] = _bf16_logits(model_dir, out_root)
    return results


def _dense_layouts(family: str, model_dir: str, out_root: str) -> dict:
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.parallel import destroy_parallel

    results = {}
    for tp, pp, ep in DENSE_FAMILIES[family]["logits"]:
        name = _layout_name(tp, pp, ep)
        parallel = ParallelConfig(tp_size=tp, pp_size=pp, ep_size=ep, sequence_parallel=tp > 1)
        results[name] = logits_and_export(model_dir, parallel, f"{out_root}/{name}",
                                          DENSE_FAMILIES[family].get("logprob_temperature"))
        destroy_parallel(keep_process_group=True)
    for name, tp, ep, packed in [s for s in DENSE_STEP_LAYOUTS if s[0] in DENSE_FAMILIES[family]["steps"]]:
        parallel = ParallelConfig(tp_size=tp, ep_size=ep, sequence_parallel=tp > 1)
        results[f"step-{name}"] = grpo_step_and_export(model_dir, parallel, ModelConfig(dtype="float32"),
                                                       f"{out_root}/step-{name}", width_multiple=2,
                                                       padding_free=packed, micro_batch_size=4 if packed else 2)
        destroy_parallel(keep_process_group=True)
    results["bf16"] = _bf16_logits(model_dir, out_root)
    return results


def _one_family(family: str, model_dir: str, out_root: str) -> dict:
    return (_dense_layouts(family, model_dir, out_root) if family in DENSE_FAMILIES
            else _family_layouts(model_dir, out_root))


SECONDS_PER_LAYOUT = 120.0
"""A launch's budget per layout it builds (a model, a forward, an export or a GRPO step: 5-15 s each on an idle
2-core machine), so a busy machine slows a launch without failing it, and a hung one still fails."""


def _num_layouts(family: str) -> int:
    """Layouts one family's launch builds (logits and exports, GRPO steps, routing replay, bf16 logits)."""
    if family in DENSE_FAMILIES:
        return len(DENSE_FAMILIES[family]["logits"]) + len(DENSE_FAMILIES[family]["steps"]) + 1
    return len(LOGIT_LAYOUTS) + len(STEP_LAYOUTS) + 2


class _Launches:
    """{family: (model dir, its output root, [rank results])}, each family launched on first use (a failed launch
    fails every test of its family, without launching again)."""

    def __init__(self, root):
        self.root, self.done = root, {}

    def __getitem__(self, family: str):
        if family not in self.done:
            try:
                self.done[family] = self._launch(family)
            except AssertionError as error:
                self.done[family] = error
        if isinstance(self.done[family], AssertionError):
            raise self.done[family]
        return self.done[family]

    def _launch(self, family: str):
        from engine.models.tiny_model import build_tiny_model
        from tests.helpers.mtp import add_mtp_layer

        model_dir = str(build_tiny_model(self.root / family, MOE_VARIANTS.get(family, family), seed=7,
                                         moe_layers=family in MOE_VARIANTS))
        if "mtp" in FAMILIES.get(family, {}):
            add_mtp_layer(model_dir)  # DeepSeek-V3's hub layout: a second shard and an index
        out_root = self.root / "out" / family
        results = run_distributed(_one_family, 2, family, model_dir, str(out_root),
                                  timeout_s=SECONDS_PER_LAYOUT * _num_layouts(family))
        return model_dir, out_root, results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """{family: (model dir, its output root, [rank results])}: one launch of 2 ranks per family, on first use."""
    return _Launches(tmp_path_factory.mktemp("families"))


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", LOGIT_CASES, ids=[f"{f}-{_layout_name(*x)}" for f, x in LOGIT_CASES])
def test_family_logits_match_hf_and_export_is_byte_exact(launched, family, layout):
    model_dir, out_root, results = launched[family]
    name = _layout_name(*layout)
    temperature = DENSE_FAMILIES.get(family, {}).get("logprob_temperature")
    if temperature is not None:
        logprobs = [r[name][1] for r in results if r[name][1] is not None]
        assert logprobs, "the last stage reports log-probs"
        want = hf_logprobs(model_dir, temperature)
        for got in logprobs:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    logits = [r[name] if temperature is None else r[name][0] for r in results]
    logits = [got for got in logits if got is not None]
    assert logits, "some rank (last stage, TP rank 0) reports logits"
    reference = hf_logits(model_dir)
    for got in logits:
        torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)
    original, exported = hf_tensors(model_dir), hf_tensors(out_root / name)
    assert sorted(exported) == sorted(original)
    assert family in DENSE_FAMILIES or any(FAMILIES[family]["expert"] in n for n in original)
    for tensor_name, tensor in original.items():
        assert exported[tensor_name].dtype == tensor.dtype and torch.equal(exported[tensor_name], tensor), tensor_name
    if "mtp" in FAMILIES.get(family, {}):
        _check_mtp_passthrough(model_dir, out_root / name, reference)


def _check_mtp_passthrough(model_dir, export_dir, reference) -> None:
    """The export carries the source's MTP layer (its tensors compared above, byte for byte) in its own shard, named
    by the index, its config keeps num_nextn_predict_layers=1, and transformers (which ignores the layer) loads it."""
    import json

    index = json.loads((export_dir / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = sorted(n for n in index if n.startswith("model.layers.4."))
    assert mtp and {index[n] for n in mtp} == {"model-mtp.safetensors"}
    assert "model.layers.4.shared_head.head.weight" in mtp and "model.layers.4.eh_proj.weight" in mtp
    assert json.loads((export_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    torch.testing.assert_close(hf_logits(export_dir), reference, rtol=1e-5, atol=1e-5)


def _step(launched, family: str, name: str):
    """(loss summed over the reporting ranks, grad norm, weights after the step) of one step layout."""
    _, out_root, results = launched[family]
    loss = sum(r[f"step-{name}"]["loss"] for r in results if r[f"step-{name}"]["loss"] is not None)
    return loss, results[0][f"step-{name}"]["grad_norm"], hf_tensors(out_root / f"step-{name}")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout,reference", [("ep2", "ep1"), ("tp2_ep2_sp", "ep1_no_z")], ids=["ep2", "tp2_ep2_sp"])
def test_family_grpo_step_equals_ep1(launched, family, layout, reference):
    loss1, grad_norm1, after1 = _step(launched, family, reference)
    loss, grad_norm, after = _step(launched, family, layout)
    assert loss == pytest.approx(loss1, rel=1e-5)
    assert grad_norm == pytest.approx(grad_norm1, rel=1e-5)
    before, names = hf_tensors(launched[family][0]), FAMILIES[family]
    assert sorted(after) == sorted(after1) == sorted(before)
    moved = [n for n in before if not torch.equal(before[n], after1[n])]
    assert any(names["router"] in n for n in moved), "the router trains"
    assert any(names["expert"] in n for n in moved), "the experts train"
    if "shared" in names:
        assert any(names["shared"] in n for n in moved), "the shared expert trains"
    for suffix in names.get("moved", ()):
        assert any(n.endswith(suffix) for n in moved), f"{suffix} trains"
    mtp = [n for n in before if "mtp" in names and n.startswith(names["mtp"])]
    assert not set(mtp) & set(moved), "the MTP layer is exported as the source had it"
    frozen = [n for n in before if "frozen" in names and n.endswith(names["frozen"]) and n not in mtp]
    assert not set(frozen) & set(moved) and len(frozen) == (3 if "frozen" in names else 0), "the expert bias is frozen"
    for name, weight in after1.items():
        torch.testing.assert_close(after[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_routing_replay_and_router_agreement_at_ep2(launched, family):
    check_replay_results([r["replay-ep2"] for r in launched[family][2]])


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [(f, s) for f, case in DENSE_FAMILIES.items() for s in case["steps"]
                                           if s != "tp1"])
def test_dense_family_grpo_step_equals_tp1(launched, family, layout):
    loss1, grad_norm1, after1 = _step(launched, family, "tp1")
    loss, grad_norm, after = _step(launched, family, layout)
    assert loss == pytest.approx(loss1, rel=1e-5)
    assert grad_norm == pytest.approx(grad_norm1, rel=1e-5)
    before = hf_tensors(launched[family][0])
    assert sorted(after) == sorted(after1) == sorted(before)
    moved = [n for n in before if not torch.equal(before[n], after1[n])]
    for part in DENSE_FAMILIES[family]["moved"]:
        assert any(part in n for n in moved), f"{part} trains"
    frozen = [n for n in before if "frozen" in DENSE_FAMILIES[family] and n.endswith(DENSE_FAMILIES[family]["frozen"])]
    assert not set(frozen) & set(moved), "the expert bias is frozen"
    assert len(frozen) == (2 if "frozen" in DENSE_FAMILIES[family] else 0), "both 'E' layers' expert biases checked"
    for name, weight in after1.items():
        torch.testing.assert_close(after[name], weight, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("family", [*FAMILIES, *DENSE_FAMILIES])
def test_family_bf16_logits_err_from_fp32_no_more_than_hf_bf16(launched, family):
    """In bf16 the policy's logits stay as close to HF's fp32 logits as HF's own bf16 model does: a layer that loses
    precision HF keeps (a norm, a router score, GLM's expert bias or a softmax run in bf16 where HF runs it in fp32;
    a bf16 rope table) raises the mean error above HF's (`BF16_MEAN_FACTOR`), a routing flip the max."""
    model_dir, _, results = launched[family]
    reference = hf_logits(model_dir)  # (B, T, V) fp32
    hf_error = (hf_logits(model_dir, torch.bfloat16).float() - reference).abs()
    logits = [r["bf16"] for r in results if r["bf16"] is not None]
    assert logits and all(got.dtype == torch.bfloat16 or got.dtype == torch.float32 for got in logits)
    for got in logits:
        error = (got.float() - reference).abs()
        print(f"{family}: bf16 mean |err| engine {float(error.mean()):.3g} HF {float(hf_error.mean()):.3g}, "
              f"max engine {float(error.max()):.3g} HF {float(hf_error.max()):.3g}")
        assert error.mean() <= BF16_MEAN_FACTOR * hf_error.mean(), "mean |logit error| beyond HF's own bf16 error"
        assert error.max() <= BF16_MAX_FACTOR * hf_error.max(), "max |logit error| beyond HF's own bf16 error"
