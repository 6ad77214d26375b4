"""GRPOTrainer with objects instead of names, end to end on CPU (real Megatron, real in-process vLLM): a
`PreTrainedModel` instance, a tokenizer (`processing_class`) whose chat template is switched by
`chat_template_kwargs`, a conversational train dataset and an eval dataset; `train()` returns TRL's TrainOutput and
`save_model()` writes the trained model with that tokenizer.

The switch makes the test able to fail: the tiny model answers in the `<think>/<answer>` format only to the plain
prompt the custom template renders with `plain=True`; under its own ChatML template (what runs if the tokenizer or
the template kwargs were dropped) it ends its turn at once and the format reward is 0 (examples/001_*).
~50 s (TP=1) and ~80 s (TP=2, two ranks on gloo) on 2 CPU cores."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed.launcher import run_distributed

REPO = Path(__file__).resolve().parents[2]
SWITCHED_TEMPLATE = (
    "{%- if plain -%}{{ messages[-1]['content'] }}"
    "{%- else -%}{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}{%- endif -%}"
)


def answer_tag(completions, **kwargs):
    """1.0 when the completion opens an <answer> (the warm-started model's format), else 0.0."""
    return [1.0 if "<answer>" in c[0]["content"] else 0.0 for c in completions]


def _train_with_objects(output_dir: str, tp: int = 1) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import GRPOConfig, GRPOTrainer
    from engine.tiny_model import resolve_builtin_model

    source = resolve_builtin_model("builtin:tiny-qwen2-arith", Path(output_dir) / "cache")
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = SWITCHED_TEMPLATE
    dataset = datasets.load_dataset("json", data_files=str(REPO / "examples/data/math_conversational.jsonl"),
                                    split="train")
    args = GRPOConfig(output_dir=str(Path(output_dir) / "run"), max_steps=2, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=32, learning_rate=1e-5, logging_steps=1, bf16=False,
                      use_vllm=True, vllm_gpu_memory_utilization=0.15, vllm_max_model_length=256,
                      chat_template_kwargs={"plain": True}, report_to="none", tp_size=tp)
    trainer = GRPOTrainer(model=model, reward_funcs=answer_tag, args=args, train_dataset=dataset,
                          eval_dataset=dataset.select(range(8)), processing_class=tokenizer)
    result = trainer.train()
    trainer.save_model()
    return {"global_step": result.global_step, "training_loss": result.training_loss, "metrics": result.metrics,
            "state_step": trainer.state.global_step, "history": len(trainer.state.log_history)}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_trainer_uses_the_given_model_tokenizer_template_kwargs_and_eval_dataset(tmp_path, tp):
    """At TP=2 both ranks run the same script (as under torchrun): rank 0 saves the model object, rank 1 waits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = run_distributed(_train_with_objects, tp, str(tmp_path), tp)
    assert [r["global_step"] for r in results] == [2] * tp  # every rank's train() returns the run's step count
    result = results[0]
    assert result["global_step"] == result["state_step"] == 2 and result["history"] == 2
    assert math.isfinite(result["training_loss"]) and result["metrics"]["train_loss"] == result["training_loss"]
    assert result["metrics"]["eval_reward_before"] > 0.5  # eval_dataset scored, with the plain template
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rewards/answer_tag/mean"] > 0.5 for r in records), records
    assert (run_dir / "initial_model" / "config.json").is_file()  # the model object, saved for Megatron and vLLM
    assert AutoTokenizer.from_pretrained(run_dir).chat_template == SWITCHED_TEMPLATE  # save_model: our tokenizer
    AutoModelForCausalLM.from_pretrained(run_dir)
