"""LoRA on the Megatron policy: the adapters are PEFT's, at every layout.

1. Logits and outputs: with adapters on every linear of the tiny Qwen2 (q/k/v in the fused QKV, gate/up in the fused
   fc1, o_proj and down_proj row-parallel; B perturbed, since PEFT's B = 0 would make every check trivial), at TP1
   and TP2 the engine's logits equal `peft.PeftModel.from_pretrained(hf_base, saved_adapter)`'s, the adapters change
   the logits, the merged view (`merged_lora`: W + scaling B A) gives the same logits, the merged HF export loads in
   transformers with the same logits, and leaving the merged view restores the base exactly.
2. The GRPO step (tests/helpers/policy.py grpo_step_and_export: DAPO, beta > 0, clipping, the distributed
   optimizer, full recompute) with adapters at TP2, TP2 + sequence parallelism, PP2 and DP2 equals the
   single-process step in fp32: loss, gradient norm and every updated adapter tensor (read back from the saved PEFT
   adapters); the base is frozen (the optimizer state holds exactly the adapters' elements).
3. The KL reference of a LoRA policy at TP2 (`ReferencePolicy.base_of`: the policy's chunks with the adapters
   disabled, TRL's PEFT reference) gives exactly the log-probs of the separate reference copy it replaces, which
   held a whole second copy of the weights; the adapters are back on after it. lora_dropout (0.5) at TP2 acts in
   training forwards (the logits differ from the eval forward's, and reproduce under the same seed) and not in eval.
4. bf16 (TRL's default precision) with PEFT's fp32 adapters (lora.lora_adapter_dtype=float32): the base stays bf16,
   adapters, their gradients and optimizer state are fp32 (no bf16 copy anywhere; `lora_adapter_dtype=model` holds
   them in bf16, and its step is further from the fp32 step); the step is within bf16 tolerance of the fp32 step; at
   DP2 (the distributed optimizer sharding the fp32 adapter buffers) it equals the single-process bf16 step, at TP2
   it is within the same bf16 tolerance.
5. MoE (Qwen3-MoE): expert adapters (PEFT's target_parameters, per expert) give peft.PeftModel's logits, merged or
   not; with attention adapters at EP2 x DP2 they equal the single-process step; their checkpoint resumes exactly
   at EP2; MLP target_modules (which PEFT would not match on the 3-D experts) are refused on the built
   policy, naming the setting. GPT-OSS's interleaved experts, DeepSeek-V3's: the engine's logits = PEFT's.
"""

from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers.lora import lora_logits_and_exports, lora_settings
from tests.helpers.policy import grpo_step_and_export, tokens


def _hf_logits_plain_peft_merged(model_dir, exports_dir):
    """HF's fp32 logits of `tokens`: the base, the base with `<exports_dir>/adapter` loaded by peft.PeftModel, and
    the merged export `<exports_dir>/merged` (as lora_logits_and_exports writes them); asserts the perturbed adapters
    move the logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokens(base.config.vocab_size)
    with torch.no_grad():
        plain = base(ids).logits
        with_peft = PeftModel.from_pretrained(base, Path(exports_dir) / "adapter").eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(Path(exports_dir) / "merged",
                                                      dtype=torch.float32).eval()(ids).logits
    assert (with_peft - plain).abs().max() > 0.1, "the perturbed adapters should move the logits"
    return plain, with_peft, merged


def _lora_step(tp, pp, dp, sp, model_dir, out_dir, dtype="float32", adapter_dtype="float32", saved=(),
               loss_scale=None):
    from engine.config import ModelConfig, ParallelConfig

    parallel = ParallelConfig(tp_size=tp, pp_size=pp, dp_size=dp, sequence_parallel=sp)
    return grpo_step_and_export(model_dir, parallel, ModelConfig(dtype=dtype), out_dir, tp if sp else 1,
                                lora=lora_settings(adapter_dtype=adapter_dtype, modules_to_save=saved),
                                loss_scale=loss_scale)


def _adapter_tensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lora") / "qwen2", "qwen2", seed=5)


@pytest.mark.parametrize("tp,saved", [(1, ()), (2, ("embed_tokens", "lm_head"))], ids=["tp1", "tp2_modules_to_save"])
def test_lora_logits_equal_peft_and_merged_export(model_dir, tmp_path, tp, saved):
    """At TP2 with PEFT's modules_to_save (the vocab-parallel LM head and embedding trained in full, perturbed): PEFT
    loads them from the adapter (its key names) and gives the engine's logits; the merged export holds them; with the
    adapters disabled (the KL reference) the logits are the loaded base's (PEFT's original_module)."""

    from engine.config import ParallelConfig

    result = run_distributed(lora_logits_and_exports, tp, str(model_dir), ParallelConfig(tp_size=tp), str(tmp_path),
                             {"modules_to_save": saved})[0]
    plain, with_peft, merged = _hf_logits_plain_peft_merged(model_dir, tmp_path)
    torch.testing.assert_close(result["logits"], with_peft, rtol=0, atol=1e-5)
    torch.testing.assert_close(result["merged_logits"], result["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, with_peft, rtol=0, atol=1e-5)
    assert torch.equal(result["after_merge"], result["logits"]), "leaving merged_lora must restore the base exactly"
    torch.testing.assert_close(result["disabled"], plain, rtol=0, atol=1e-5)
    if saved:  # PEFT 0.21's keys (its `modules_to_save.default.` infix dropped), HF's vocabulary rows
        tensors, vocab = _adapter_tensors(tmp_path / "adapter"), plain.shape[-1]  # plain: (B, T, V) of HF's base
        for key in ("base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"):
            assert tensors[key].shape[0] == vocab and tensors[key].ndim == 2, key


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_ref") / "adapter"
    result = run_distributed(_lora_step, 1, 1, 1, 1, False, str(model_dir), str(out))[0]
    return result, _adapter_tensors(out), _adapter_tensors(out.with_name("adapter_initial"))


def _num_adapter_elements(tensors: dict) -> int:
    return sum(t.numel() for t in tensors.values())


def test_lora_step_trains_only_adapters(reference):
    from tests.helpers.lora import SETTINGS

    result, tensors, initial = reference
    assert len(tensors) == 2 * 7 * 4, "A and B of 7 modules in each of the 4 layers"
    unchanged = [name for name, t in tensors.items() if torch.equal(t, initial[name])]
    assert not unchanged, f"the step left adapters unchanged (no gradient reached them): {unchanged}"
    assert result["optimizer_numel"] == _num_adapter_elements(tensors), "the optimizer holds adapter state only"
    assert result["grad_norm"] > 0 and SETTINGS["r"] == 4


def _assert_step_equals(results: list, ref: dict, ref_tensors: dict, adapter_dir) -> None:
    """A layout's LoRA step equals the single-process one (fp32): summed loss, every rank's grad norm, and every
    tensor of the exported adapter."""
    loss = sum(r["loss"] for r in results if r["loss"] is not None)
    assert loss == pytest.approx(ref["loss"], rel=1e-5)
    assert all(r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5) for r in results)
    tensors = _adapter_tensors(adapter_dir)
    assert sorted(tensors) == sorted(ref_tensors)
    for name, expected in ref_tensors.items():
        torch.testing.assert_close(tensors[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp,sp", [(2, 1, 1, False), (2, 1, 1, True), (1, 2, 1, False), (1, 1, 2, False)],
                         ids=["tp2", "tp2_sp", "pp2", "dp2"])
def test_lora_grpo_step_matches_single_process(model_dir, reference, tmp_path, tp, pp, dp, sp):
    ref, ref_tensors, _ = reference
    results = run_distributed(_lora_step, tp * pp * dp, tp, pp, dp, sp, str(model_dir), str(tmp_path / "adapter"))
    _assert_step_equals(results, ref, ref_tensors, tmp_path / "adapter")
    if tp == 1:  # PP stages hold their layers' adapters, DP ranks their shares of them: each element once
        assert sum(r["optimizer_numel"] for r in results) == _num_adapter_elements(ref_tensors)


SAVED = ("embed_tokens", "lm_head")
SAVED_KEYS = ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight")


@pytest.fixture(scope="module")
def saved_reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_saved_ref") / "adapter"
    result = run_distributed(_lora_step, 1, 1, 1, 1, False, str(model_dir), str(out), "float32", "float32", SAVED)[0]
    return result, _adapter_tensors(out), _adapter_tensors(out.with_name("adapter_initial"))


def test_lora_modules_to_save_train_the_lm_head_and_embedding_in_full(reference, saved_reference):
    """modules_to_save=[embed_tokens, lm_head]: both weights change in the step (the LM head's gradient comes through
    the log-prob kernel), the optimizer holds the adapters and both (padded) vocab-parallel weights, nothing else."""
    result, tensors, initial = saved_reference
    for key in SAVED_KEYS:
        assert not torch.equal(tensors[key], initial[key]), f"{key}: unchanged by the step"
    adapters = _num_adapter_elements({k: v for k, v in tensors.items() if k not in SAVED_KEYS})
    assert adapters == _num_adapter_elements(reference[1])
    padded = 512 * tensors[SAVED_KEYS[0]].shape[1]  # vocabulary 400 padded to 512 rows (make_vocab_size_divisible_by)
    assert result["optimizer_numel"] == adapters + 2 * padded, "the optimizer holds adapters + both modules only"


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2", "pp2", "dp2"])
def test_lora_modules_to_save_step_matches_single_process(model_dir, saved_reference, tmp_path, tp, pp, dp):
    """The step with modules_to_save at TP2 (vocab-parallel LM head and embedding), PP2 (the embedding on the first
    stage, the LM head on the last) and DP2 (the distributed optimizer sharding them with the adapters) equals the
    single-process step in fp32: loss, gradient norm, every tensor of the exported adapter."""
    ref, ref_tensors, _ = saved_reference
    results = run_distributed(_lora_step, tp * pp * dp, tp, pp, dp, False, str(model_dir), str(tmp_path / "adapter"),
                              "float32", "float32", SAVED)
    _assert_step_equals(results, ref, ref_tensors, tmp_path / "adapter")
    if tp == 1:
        assert sum(r["optimizer_numel"] for r in results) == ref["optimizer_numel"]


@torch.no_grad()
def _adapter_step(chunks, popt, ps, seed: int) -> None:
    """One optimizer step whose adapter gradients are fixed functions of (seed, global name): layout-independent."""
    import zlib

    from engine.policy.model import global_param_names, take_tp_shard

    popt.zero_grad()
    for chunk in chunks:
        for name, global_name in global_param_names(chunk).items():
            param = chunk.get_parameter(name)
            if not param.requires_grad:
                continue
            shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= ps.tp_size
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
            param.main_grad.copy_(take_tp_shard(1e-4 * torch.randn(shape, generator=gen), param, ps.tp_rank,
                                                ps.tp_size))
    popt.step()


def _lora_checkpoint(tp: int, model_dir: str, run_dir: str, save: bool, dtype: str = "float32",
                     distributed: bool = True, moe: bool = False, saved: tuple = SAVED) -> dict:
    """Source (`save`): adapters, one fixed step, save, a second step. Target: load, the same second step. Returns
    the adapters (PEFT names, full tensors) after loading / saving and after the second step. `dtype`: the base's
    (the adapters float32); `distributed`: optimizer.use_distributed_optimizer; `moe`: `tp` is the EP size and the
    adapters are attention + expert ones; `saved` (not `moe`): modules_to_save (trained in full: in the checkpoint
    with their optimizer state)."""
    from engine.config import ModelConfig, OptimizerConfig, ParallelConfig
    from engine.policy.lora import apply_lora, lora_tensors_for_peft
    from engine.policy.optimizer import build_optimizer
    from engine.train.checkpoint import Progress, find_latest_checkpoint, load_checkpoint, save_checkpoint
    from tests.helpers.lora import perturb_lora_b
    from tests.helpers.policy import build_from_hf

    parallel = ParallelConfig(ep_size=tp) if moe else ParallelConfig(tp_size=tp)
    ps, hf_config, chunks, dims = build_from_hf(model_dir, parallel, ModelConfig(dtype=dtype))
    apply_lora(chunks, lora_settings(target_modules=ATTENTION, target_parameters=EXPERTS) if moe else
               lora_settings(modules_to_save=saved), ps)
    perturb_lora_b(chunks, ps, seed=3 if save else 4)  # the target starts elsewhere: loading must overwrite it
    popt = build_optimizer(OptimizerConfig(learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=3,
                                           use_distributed_optimizer=distributed), chunks, ps, total_steps=10)
    identity = {"model_type": hf_config.model_type, "padded_vocab_size": dims.padded_vocab}
    if save:
        _adapter_step(chunks, popt, ps, seed=1)
        save_checkpoint(run_dir, Progress(step=1, rounds_done=1), popt, ps, model=identity)
    else:
        load_checkpoint(find_latest_checkpoint(run_dir), popt, ps, model=identity)
    at_checkpoint = lora_tensors_for_peft(chunks, ps)
    _adapter_step(chunks, popt, ps, seed=2)
    return {"checkpoint": at_checkpoint, "next": lora_tensors_for_peft(chunks, ps)}


@pytest.mark.slow
def test_lora_checkpoint_resumes_exactly_at_tp2_and_resharded_to_tp1(model_dir, tmp_path):
    """Saved at TP2 (adapters, modules_to_save's LM head and embedding, and their optimizer state only: smaller than
    the base), loaded at TP2 and at TP1: the adapters and both modules equal the saved ones bit for bit, and the next
    step (Adam moments, step count and the warmup LR restored) lands on the source's next tensors bit for bit."""
    source = run_distributed(_lora_checkpoint, 2, 2, str(model_dir), str(tmp_path), True)[0]
    saved = sum(f.stat().st_size for f in tmp_path.glob("checkpoint-1/**/*") if f.is_file())
    adapters = sum(t.numel() * 4 for k, t in source["checkpoint"].items() if k not in SAVED_KEYS)  # fp32
    modules = 512 * 128 * 4 * 2  # both padded vocab-parallel weights, fp32
    base = (model_dir / "model.safetensors").stat().st_size
    # weights, then Adam m, v: the base's other tensors (~3 MB) must not be in it
    assert saved < 4 * (adapters + modules) + 2**20 < base + 2**20, f"{saved} B saved (base: {base} B)"
    assert set(SAVED_KEYS) <= set(source["checkpoint"])
    for tp in (2, 1):
        _assert_resumed(source, run_distributed(_lora_checkpoint, tp, tp, str(model_dir), str(tmp_path), False)[0],
                        f"tp{tp}")


def _assert_resumed(source: dict, target: dict, label: str) -> None:
    for key in ("checkpoint", "next"):
        assert sorted(target[key]) == sorted(source[key])
        bad = {name: float((target[key][name] - tensor).abs().max()) for name, tensor in source[key].items()
               if not torch.equal(target[key][name], tensor)}
        assert not bad, f"{label} {key}: differ (max abs): {bad}"


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_lora_fp32_adapters_on_a_bf16_base_checkpoint_resume_exactly(model_dir, tmp_path, distributed):
    """bf16 base, fp32 adapters (TRL's defaults), the LM head and embedding trained in full in bf16 (modules_to_save:
    fp32 main copies), with the non-distributed optimizer (configs/tiny_cpu.yaml's) and the distributed one (the
    default): saved and loaded, the adapters, both modules and the next step equal the source's bit for bit.
    megatron-core 0.16.1 could save neither: its non-distributed bf16 optimizer numbers only bf16 parameters, its
    distributed one mapped a group holding both kinds to the wrong Adam state (engine/policy/optimizer.py
    `_checkpoint_fp32_params_of_mixed_optimizers`, `_index_mixed_distributed_groups`)."""
    source = run_distributed(_lora_checkpoint, 1, 1, str(model_dir), str(tmp_path), True, "bfloat16", distributed)[0]
    target = run_distributed(_lora_checkpoint, 1, 1, str(model_dir), str(tmp_path), False, "bfloat16",
                             distributed)[0]
    for key in ("checkpoint", "next"):
        assert all(t.dtype == (torch.bfloat16 if k in SAVED_KEYS else torch.float32) for k, t in source[key].items())
        bad = [name for name, tensor in source[key].items() if not torch.equal(target[key][name], tensor)]
        assert not bad and sorted(target[key]) == sorted(source[key]), f"{key}: differ: {bad}"


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = ("gate_up_proj", "down_proj")  # PEFT's target_parameters=["mlp.experts.gate_up_proj", ...]


def _moe_lora_step(model_dir: str, out_dir: str, ep: int) -> dict:
    """The LoRA step on the tiny Qwen3-MoE at `ep` with attention and expert adapters (target_parameters). At EP1
    first: MLP target_modules on its built chunks (apply_lora's own guard, Megatron's num_moe_experts): the refusal's
    message; and the policy's logits with (perturbed) expert adapters, their PEFT adapter and merged export
    (tests/helpers/lora.py lora_logits_and_exports, written to `<out_dir>_peft`)."""
    from engine.config import ModelConfig, ParallelConfig
    from engine.policy.lora import apply_lora
    from engine.policy.parallel import destroy_parallel
    from tests.helpers.policy import build_from_hf

    refusal, exports = "", {}
    if ep == 1:
        ps, _, chunks, _ = build_from_hf(model_dir, ParallelConfig(), ModelConfig(dtype="float32"))
        try:
            apply_lora(chunks, lora_settings(), ps)
        except ValueError as exc:
            refusal = str(exc)
        destroy_parallel(keep_process_group=True)
        exports = lora_logits_and_exports(model_dir, ParallelConfig(), f"{out_dir}_peft",
                                          {"target_modules": ("q_proj", "o_proj"), "target_parameters": EXPERTS})
        destroy_parallel(keep_process_group=True)
    result = grpo_step_and_export(model_dir, ParallelConfig(ep_size=ep), ModelConfig(dtype="float32"), out_dir,
                                  lora=lora_settings(target_modules=ATTENTION, target_parameters=EXPERTS))
    return result | {"refusal": refusal, "exports": exports}


@pytest.mark.slow
def test_lora_on_moe_expert_adapters_equal_peft_and_at_ep2_match_single_process(tmp_path):
    """Qwen3-MoE with PEFT's target_parameters (one (A, B) per expert of mlp.experts.gate_up_proj / down_proj) and
    q / o_proj adapters: the engine's logits equal peft.PeftModel's loading the saved adapter (ParamWrapper layout),
    the merged view and the merged HF export give them too. Attention + expert adapters train at EP2 x DP2 as in one
    process (loss, grad norm, every adapter; the frozen base holds no optimizer state); the initial adapter written
    without the policy (save_model() before train()) has apply_lora's A; a checkpoint saved at EP2
    resumes bit for bit at EP2 (adapters and the next step); MLP target_modules (which PEFT would not match
    on transformers 5's 3-D experts) are refused on the built policy."""
    from transformers import AutoConfig

    from engine.models.tiny_model import build_tiny_model
    from engine.policy.peft_adapter import initial_peft_tensors

    model_dir = str(build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=7))
    (single,) = run_distributed(_moe_lora_step, 1, model_dir, str(tmp_path / "ep1"), 1)
    assert "routes its MLP through 4 experts" in single["refusal"] and "ep_size" in single["refusal"], single["refusal"]
    exports = single["exports"]
    _, with_peft, merged = _hf_logits_plain_peft_merged(model_dir, tmp_path / "ep1_peft")
    torch.testing.assert_close(exports["logits"], with_peft, rtol=0, atol=1e-5)
    torch.testing.assert_close(exports["merged_logits"], exports["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, with_peft, rtol=0, atol=1e-5)
    assert torch.equal(exports["after_merge"], exports["logits"]), "leaving merged_lora must restore the base exactly"
    results = run_distributed(_moe_lora_step, 2, model_dir, str(tmp_path / "ep2"), 2)
    assert sum(r["loss"] for r in results) == pytest.approx(single["loss"], rel=1e-5)
    assert all(r["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5) for r in results)
    expected, initial = _adapter_tensors(tmp_path / "ep1"), _adapter_tensors(tmp_path / "ep1_initial")
    tensors = _adapter_tensors(tmp_path / "ep2")
    assert sorted(tensors) == sorted(expected) and len(expected) == 2 * (4 + 2) * _num_layers(model_dir)
    assert sum(r["optimizer_numel"] for r in results) == single["optimizer_numel"] == _num_adapter_elements(expected)
    # save_model() before train(): the initial adapter without the policy (its A = apply_lora's; B is 0 there)
    fresh = initial_peft_tensors(lora_settings(target_modules=ATTENTION, target_parameters=EXPERTS),
                                 AutoConfig.from_pretrained(model_dir), seed=0)
    assert sorted(fresh) == sorted(initial)
    assert all(torch.equal(fresh[k], initial[k]) for k in fresh if ".lora_A." in k)
    for kind in ("self_attn", "mlp.experts.base_layer", "mlp.experts.lora"):
        assert any(not torch.equal(expected[k], initial[k]) for k in expected if kind in k), f"no {kind} moved"
    for name, value in expected.items():
        torch.testing.assert_close(tensors[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # checkpoint saved at EP2 (the expert adapters and their Adam state with them), loaded at EP2 (the expert
    # optimizer is a second one at EP > 1 only: engine/train/checkpoint.py refuses an EP2 -> EP1 load by name)
    source = run_distributed(_lora_checkpoint, 2, 2, model_dir, str(tmp_path / "ckpt"), True, "float32", True, True)[0]
    assert any(".mlp.experts." in name for name in source["checkpoint"])
    target = run_distributed(_lora_checkpoint, 2, 2, model_dir, str(tmp_path / "ckpt"), False, "float32", True, True)
    _assert_resumed(source, target[0], "ep2")


@pytest.mark.slow
@pytest.mark.parametrize("family,targets", [("gpt_oss", ("q_proj",)), ("deepseek_v3", ())])
def test_lora_on_other_moe_families_expert_adapters_equal_peft(tmp_path, family, targets):
    """GPT-OSS's experts are transposed (E, h, 2f) with gate / up interleaved (TRL's MoE PEFT test's model): the
    exported adapter (B's gate_up rows interleaved) loaded by peft.PeftModel gives the engine's logits, and so does
    the merged export. DeepSeek-V3 (GLM-4.5's MoE: dense first layer, shared expert, not adapted; MLA attention, no
    q_proj): the same with expert adapters alone."""
    from engine.config import ParallelConfig
    from engine.models.tiny_model import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path / family, family, seed=7))
    result = run_distributed(lora_logits_and_exports, 1, model_dir, ParallelConfig(), str(tmp_path),
                             {"target_modules": targets, "target_parameters": EXPERTS})[0]
    plain, with_peft, merged = _hf_logits_plain_peft_merged(model_dir, tmp_path)
    torch.testing.assert_close(result["logits"], with_peft, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, with_peft, rtol=0, atol=1e-5)


def _num_layers(model_dir: str) -> int:
    import json
    from pathlib import Path

    return json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]


def _reference_and_dropout(model_dir: str) -> dict:
    from engine.config import KernelsConfig, ModelConfig, ParallelConfig
    from engine.policy.batch import pack_completions
    from engine.policy.lora import apply_lora
    from engine.policy.microbatch import MicroBatch
    from engine.policy.reference import ReferencePolicy
    from engine.policy.step import LogprobSettings, forward_logprobs, run_schedule
    from tests.helpers.lora import perturb_lora_b
    from tests.helpers.policy import BATCH, SEQ, build_from_hf, gathered_logits_fn

    ps, hf_config, chunks, dims = build_from_hf(model_dir, ParallelConfig(tp_size=2), ModelConfig(dtype="float32"))
    copy = ReferencePolicy.build(hf_config, ModelConfig(dtype="float32"), ps, model_dir, dims)
    apply_lora(chunks, lora_settings(lora_dropout=0.5), ps)
    perturb_lora_b(chunks, ps)
    ids = tokens(hf_config.vocab_size).tolist()
    batch = pack_completions([row[:4] for row in ids], [row[4:] for row in ids], pad_token_id=0)
    settings = LogprobSettings(vocab_size=hf_config.vocab_size, temperature=1.0, kernels=KernelsConfig())
    base = ReferencePolicy.base_of(chunks, ps)
    out = {"copy": copy.logprobs(ps, [batch], settings), "base": base.logprobs(ps, [batch], settings),
           "policy": forward_logprobs(chunks, ps, [batch], settings),
           "copy_bytes": sum(p.numel() * p.element_size() for c in copy.chunks for p in c.parameters())}
    full = MicroBatch(tokens=tokens(hf_config.vocab_size), position_ids=torch.arange(SEQ).expand(BATCH, SEQ))
    logits_fn = gathered_logits_fn(ps, hf_config.vocab_size)

    def logits(train: bool, seed: int = 0):
        torch.manual_seed(seed)
        for chunk in chunks:
            chunk.train(train)
        with torch.no_grad():
            values = run_schedule(chunks, ps, [full], logits_fn, forward_only=True)
        return values[0]["logits"]

    out |= {"eval": logits(False), "train": logits(True, 1), "train_again": logits(True, 1),
            "train_other": logits(True, 2)}
    return out


def test_lora_reference_is_the_base_with_adapters_off_and_dropout_acts_at_tp2(model_dir):
    results = run_distributed(_reference_and_dropout, 2, str(model_dir))
    for r in results:
        (copy, _), (base, _), (policy, _) = r["copy"][0], r["base"][0], r["policy"][0]
        assert torch.equal(base, copy), "the base with adapters off is not the separate reference"
        assert (policy - copy).abs().max() > 1e-3, "the adapters do not change the policy's log-probs"
        assert r["copy_bytes"] > 0.4e6, "the reference copy base_of saves (this rank's shard of the model)"
        assert (r["train"] - r["eval"]).abs().max() > 1e-3, "lora_dropout does nothing in training forwards"
        assert torch.equal(r["train"], r["train_again"]), "the same seed draws the same dropout masks"
        assert (r["train"] - r["train_other"]).abs().max() > 1e-3


def _update(tensors: dict, initial: dict) -> torch.Tensor:
    """Every adapter element's change in the step, float32, in key order."""
    return torch.cat([(tensors[k].float() - initial[k].float()).flatten() for k in sorted(tensors)])


@pytest.fixture(scope="module")
def bf16_reference(model_dir, tmp_path_factory):
    """The single-process LoRA step on the bf16 base with float32 adapters (lora.lora_adapter_dtype's default)."""
    out = tmp_path_factory.mktemp("lora_bf16") / "adapter"
    result = run_distributed(_lora_step, 1, 1, 1, 1, False, str(model_dir), str(out), "bfloat16")[0]
    return result, _adapter_tensors(out), _adapter_tensors(out.with_name("adapter_initial"))


def test_lora_bf16_base_trains_fp32_adapters_closer_to_the_fp32_step_than_bf16_adapters(model_dir, reference,
                                                                                         bf16_reference, tmp_path):
    """TRL's bf16 with PEFT's fp32 adapters: the base stays bf16 and frozen; A, B, their gradients, the optimizer's
    parameters and Adam state are float32 (no bf16 copy), the saved adapter too; the step is within bf16 tolerance of
    the fp32 step, and closer to it than the step with adapters in the model's dtype (lora_adapter_dtype=model:
    bf16 adapters with Megatron's fp32 main copies), whose dtypes that run shows."""
    ref, ref_tensors, ref_initial = reference
    result, tensors, initial = bf16_reference
    fp32 = ["float32"]
    assert result["dtypes"] == {"adapters": fp32, "frozen": ["bfloat16"], "main_grads": fp32,
                                "optimizer_params": fp32, "optimizer_state": fp32}, result["dtypes"]
    assert all(t.dtype == torch.float32 for t in tensors.values()), "the PEFT adapter is saved as held: fp32"
    assert result["loss"] == pytest.approx(ref["loss"], rel=2e-2, abs=1e-3)
    assert result["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-2)
    (held, *_) = run_distributed(_lora_step, 1, 1, 1, 1, False, str(model_dir), str(tmp_path / "adapter"),
                                 "bfloat16", "model")
    assert held["dtypes"] | {"optimizer_params": fp32} == {"adapters": ["bfloat16"], "frozen": ["bfloat16"],
                                                            "main_grads": fp32, "optimizer_params": fp32,
                                                            "optimizer_state": fp32}, held["dtypes"]
    in_model = _update(_adapter_tensors(tmp_path / "adapter"), _adapter_tensors(tmp_path / "adapter_initial"))
    ref_update = _update(ref_tensors, ref_initial)
    update = _update(tensors, initial)
    assert update.abs().max() > 0, "the bf16 step did not move the adapters"
    error, model_error = ((u - ref_update).norm() / ref_update.norm() for u in (update, in_model))
    # measured: fp32 adapters 0.034, bf16 adapters 0.089 (relative error of the update against the fp32 step)
    assert error < 0.06 and error < 0.7 * model_error, (float(error), float(model_error))


def _lora_fp16_steps(model_dir: str, out_dir: str) -> dict:
    """The fp16-base, fp32-adapter step at the starting loss scale, then one from the same start at a scale that
    overflows."""
    from engine.policy.parallel import destroy_parallel

    trained = _lora_step(1, 1, 1, False, model_dir, f"{out_dir}/trained", "float16")
    destroy_parallel(keep_process_group=True)
    overflow = _lora_step(1, 1, 1, False, model_dir, f"{out_dir}/overflow", "float16", loss_scale=2.0**40)
    return {"trained": trained, "overflow": overflow}


def test_lora_fp16_base_scales_the_loss_for_fp32_adapters(model_dir, reference, tmp_path):
    """TRL's `fp16=True` with PEFT: the base is fp16 (its activations and their gradients too), the adapters fp32.
    Every trained parameter being fp32 does not make the backward fp32: without the loss scale, activation gradients
    below fp16's range (2**-24) flush to zero at scale. So the dynamic loss scale runs here as in full fp16 training:
    the step is at GradScaler's starting scale 2**16 and within fp16 tolerance of the fp32 step; a scale that
    overflows the fp16 backward (2**40: possible only if the backward is multiplied by it) skips the update,
    adapters unchanged, and halves the scale."""
    ref, ref_tensors, ref_initial = reference
    result = run_distributed(_lora_fp16_steps, 1, str(model_dir), str(tmp_path))[0]
    trained, overflow = result["trained"], result["overflow"]
    assert trained["dtypes"]["adapters"] == ["float32"] and trained["dtypes"]["frozen"] == ["float16"]
    assert trained["loss_scale"] == 2.0**16 and trained["lr_steps"] == 1
    assert trained["loss"] == pytest.approx(ref["loss"], rel=1e-2, abs=1e-3)
    assert trained["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-2)
    update = _update(_adapter_tensors(tmp_path / "trained"), _adapter_tensors(tmp_path / "trained_initial"))
    ref_update = _update(ref_tensors, ref_initial)
    error = float((update - ref_update).norm() / ref_update.norm())
    assert error < 0.02, error  # measured 0.004 (relative error of the update; the bf16 base's bound above: 0.06)
    assert overflow["grad_norm"] != overflow["grad_norm"], "an overflowed step reports grad_norm NaN"
    assert overflow["loss_scale"] == 2.0**39 and overflow["lr_steps"] == 0
    kept, initial = _adapter_tensors(tmp_path / "overflow"), _adapter_tensors(tmp_path / "overflow_initial")
    assert all(torch.equal(kept[k], initial[k]) for k in initial), "an overflowed step changed the adapters"


@pytest.mark.slow
@pytest.mark.parametrize("tp,dp", [(2, 1), (1, 2)], ids=["tp2", "dp2"])
def test_lora_fp32_adapters_on_a_bf16_base_step_matches_single_process(model_dir, reference, bf16_reference,
                                                                       tmp_path, tp, dp):
    """The bf16-base, fp32-adapter step with the distributed optimizer (its fp32 buffers sharded over DP): at DP2 it
    equals the single-process bf16 step to fp32 rounding; at TP2 the bf16 base's all-reduced partial sums round
    otherwise than TP1's, so it is held to the single-process step's own bf16 tolerance of the fp32 step."""
    ref, ref_tensors, ref_initial = reference
    single, single_tensors, _ = bf16_reference
    results = run_distributed(_lora_step, tp * dp, tp, 1, dp, False, str(model_dir), str(tmp_path / "adapter"),
                              "bfloat16")
    assert all(r["dtypes"] == single["dtypes"] for r in results), [r["dtypes"] for r in results]
    tensors = _adapter_tensors(tmp_path / "adapter")
    assert sorted(tensors) == sorted(single_tensors) and all(t.dtype == torch.float32 for t in tensors.values())
    loss = sum(r["loss"] for r in results if r["loss"] is not None)
    if dp == 2:  # measured: 7e-9 at most
        assert loss == pytest.approx(single["loss"], rel=1e-5)
        assert all(r["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5) for r in results)
        for name, expected in single_tensors.items():
            torch.testing.assert_close(tensors[name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert sum(r["optimizer_numel"] for r in results) == _num_adapter_elements(single_tensors)
    else:  # measured: relative update error against the fp32 step 0.028 (TP1 bf16: 0.034)
        assert loss == pytest.approx(ref["loss"], rel=2e-2, abs=1e-3)
        ref_update = _update(ref_tensors, ref_initial)
        update = _update(tensors, _adapter_tensors(tmp_path / "adapter_initial"))
        assert (update - ref_update).norm() / ref_update.norm() < 0.06
