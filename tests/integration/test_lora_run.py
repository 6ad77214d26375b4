"""LoRA end to end on CPU: the tiny config with `lora.use_peft` at TP=2 (real Megatron over gloo, real
in-process vLLM), adapters on every linear, a high learning rate so they move: every round's weight sync is verified
(digests) and vLLM's log-probs agree with the trainer's (the engine holds the merged W + scale * B A, the trainer
computes with the adapters; the merged run at bf16 with fp32 adapters, TRL's defaults); the final export is a PEFT
adapter that `peft.PeftModel.from_pretrained` loads on the HF base, close in logits to the (bf16) merged export
(`lora.lora_save_merged`), and different from the base (the adapters trained); the checkpoint resumes (the next
step continues from the saved adapters and optimizer state). That run also trains the LM head and embedding in full
(lora.lora_modules_to_save): the merged sync's digests cover them, the adapter holds them under PEFT's keys.
With `lora.lora_weight_sync=adapter` (TP=2, two ranks
sharing one engine at engine TP 2: each rank's vLLM worker shards the whole adapter itself) every round's adapter-only
sync verifies (each engine rank's share), moves the adapters only, and vLLM's log-probs (every request naming the
adapter) equal the trainer's."""

import json

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.integration.test_trainer import digit_fraction  # noqa: F401 - the reward named below


def _train(tp: int, output_dir: str, max_steps: int, resume: bool = False, *extra: str) -> dict:
    from engine.config import load_config
    from engine.train.loop import train

    cfg = load_config("configs/tiny_cpu.yaml", [
        f"parallel.tp_size={tp}", f"train.max_steps={max_steps}", f"train.output_dir={output_dir}",
        "generation.max_completion_length=12", "reward.reward_funcs=[tests.integration.test_trainer:digit_fraction]",
        "optimizer.learning_rate=2e-2", "data.dataset_test_split=null", "lora.use_peft=true", "lora.lora_r=8",
        "lora.lora_target_modules=[all-linear]", "lora.lora_dropout=0.0", "lora.lora_save_merged=true",
        "checkpoint.save_steps=1", *(["checkpoint.resume_from_checkpoint=latest"] if resume else []), *extra,
    ])
    return train(cfg)


@pytest.mark.slow
def test_lora_run_syncs_merged_weights_exports_a_peft_adapter_and_resumes(tmp_path):
    """At TRL's default precision: a bf16 base with fp32 adapters (lora.lora_adapter_dtype), the merged sync (W + scale
    * B A in fp32, rounded once to bf16) verified by digests every round, the non-distributed optimizer's checkpoint
    (configs/tiny_cpu.yaml) resumed; the PEFT adapter is saved in fp32 (the fp32 equality of the engine, PEFT and
    the merged export: tests/distributed/test_lora_layouts.py)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = "lora.lora_modules_to_save=[embed_tokens,lm_head]"  # trained in full (bf16, fp32 main copies)
    summaries = run_distributed(_train, 2, 2, str(tmp_path), 2, False, "model.dtype=bfloat16", saved)
    assert summaries[0]["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["grad_norm"] > 0 for r in records)
    for record in records:  # a sync that differs raises (digests); bf16 log-probs only roughly agree
        assert record["weight_sync/digest_s"] > 0, "every merged sync verified by digests"
        assert record["weight_sync/logprob_diff_p50"] < 0.05, "vLLM does not hold the merged adapters"
    adapter, merged = tmp_path / "hf", tmp_path / "hf_merged"
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
    tensors = load_file(adapter / "adapter_model.safetensors")
    head = "base_model.model.lm_head.weight"  # PEFT's key of modules_to_save's LM head; the embedding's likewise
    assert {t.dtype for k, t in tensors.items() if "lora_" in k} == {torch.float32}
    assert tensors[head].dtype == torch.bfloat16
    base_dir = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    base_head = load_file(f"{base_dir}/model.safetensors")["lm_head.weight"].to(torch.bfloat16)
    assert not torch.equal(tensors[head], base_head), "the LM head (modules_to_save) did not train"
    assert "base_model.model.model.embed_tokens.weight" in tensors
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the base as the run held it (bf16), computed in fp32 with the fp32 adapters
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).float().eval()
        plain = base(ids).logits
        with_adapter = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ids).logits
    effect, merge_error = (with_adapter - plain).abs().max(), (with_adapter - merged_logits).abs().max()
    assert effect > 1e-3, "the adapters did not train"
    # measured: the adapters move the logits by up to 16.7, the merged export (W + scale B A rounded once to bf16)
    # differs from base + fp32 adapters by up to 0.10 (0.6% of that)
    assert merge_error < 0.02 * effect, f"the bf16 merged export is not base + adapters: {merge_error} of {effect}"
    resumed = run_distributed(_train, 2, 2, str(tmp_path), 3, True, "model.dtype=bfloat16", saved)
    assert resumed[0]["start_step"] == 2 and resumed[0]["steps"] == 3


@pytest.mark.slow
def test_lora_run_with_adapter_only_sync(tmp_path):
    summaries = run_distributed(_train, 2, 2, str(tmp_path), 2, False, "lora.lora_weight_sync=adapter",
                                "lora.lora_save_merged=false", "checkpoint.save_steps=0",
                                "rollout.vllm_tensor_parallel_size=2")
    assert summaries[0]["steps"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r["grad_norm"] > 0 for r in records)
    for record in records:
        assert record["weight_sync/logprob_diff_max"] < 1e-3, "vLLM does not apply the synced adapter"
        assert record["weight_sync/tensors"] == 4 * 7 * 2, "the adapters' A and B only"
