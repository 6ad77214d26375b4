"""GRPOTrainer with objects instead of names, end to end on CPU (real Megatron, real in-process vLLM): a
`PreTrainedModel` instance, a tokenizer (`processing_class`) whose chat template is switched by
`chat_template_kwargs`, a conversational train dataset and an eval dataset; `train()` returns TRL's TrainOutput and
`save_model()` writes the trained model with that tokenizer.

The switch makes the test able to fail: the tiny model answers in the `<think>/<answer>` format only to the plain
prompt the custom template renders with `plain=True`; under its own ChatML template (what runs if the tokenizer or
the template kwargs were dropped) it ends its turn at once and the format reward is 0 (examples/001_*).
~50 s (TP=1) and ~80 s (TP=2, two ranks on gloo) on 2 CPU cores.

A user's script run as `python script.py` with its GFPO filter (an instance of a class) and its curriculum hook
(a function) defined in `__main__`, through `engine.experimental.gfpo`, saved and resumed: ~35 s (two runs)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.launcher import run_distributed
from tests.helpers import warm_python

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
    from engine.models.tiny_model import resolve_builtin_model

    source = resolve_builtin_model("builtin:tiny-qwen2-arith", Path(output_dir) / "cache")
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = SWITCHED_TEMPLATE
    dataset = datasets.load_dataset("json", data_files=str(REPO / "examples/data/math_conversational.jsonl"),
                                    split="train")
    args = GRPOConfig(output_dir=str(Path(output_dir) / "run"), max_steps=2, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=32, learning_rate=1e-5, logging_steps=1,
                      use_vllm=True, vllm_gpu_memory_utilization=0.15, vllm_max_model_length=256,
                      chat_template_kwargs={"plain": True}, report_to="none", tp_size=tp,
                      num_generations_eval=2, eval_max_prompts=6, eval_strategy="steps", eval_steps=2)
    recorder = _recording_callback()
    trainer = GRPOTrainer(model=model, reward_funcs=answer_tag, args=args, train_dataset=dataset,
                          eval_dataset=dataset.select(range(8)), processing_class=tokenizer, callbacks=[recorder])
    result = trainer.train()
    trainer.save_model()
    return {"step_ends": [s for name, s in recorder.events if name == "on_step_end"], "evals": recorder.evals,
            "global_step": result.global_step, "training_loss": result.training_loss, "metrics": result.metrics,
            "state_step": trainer.state.global_step, "history": trainer.state.log_history, "num_prompts": len(dataset)}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_trainer_uses_the_given_model_tokenizer_template_kwargs_and_eval_dataset(tmp_path, tp, capfd):
    """At TP=2 both ranks run the same script (as under torchrun): rank 0 saves the model object, rank 1 waits.
    The held-out evaluation takes num_generations_eval completions of the first eval_max_prompts prompts, and says so."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = run_distributed(_train_with_objects, tp, str(tmp_path), tp)
    printed = capfd.readouterr()
    cut = "evaluation: the first 6 of 8 held-out prompts (data.eval_max_prompts=6), 2 completions each"
    assert (printed.out + printed.err).count(cut) == 2, "printed once by rank 0 before and once after training"
    assert [r["global_step"] for r in results] == [2] * tp  # every rank's train() returns the run's step count
    # callbacks: once per step in the user's process (rank 0), however many ranks train
    assert [r["step_ends"] for r in results] == [[1, 2]] + [[]] * (tp - 1)
    result = results[0]
    # eval_strategy="steps", eval_steps=2: one scheduled evaluation (its loss over the TP ranks), in log_history
    [evaluation] = result["evals"]
    assert math.isfinite(evaluation["eval_loss"]) and evaluation["eval_rewards/answer_tag/mean"] > 0.5
    evaluations = [r for r in result["history"] if "eval_loss" in r]
    assert [(r["step"], r["eval_loss"]) for r in evaluations] == [(2, evaluation["eval_loss"])]
    assert result["global_step"] == result["state_step"] == 2
    # log_history as HF's Trainer leaves it: one record per logged step, then the final record
    *steps, final = [r for r in result["history"] if "eval_loss" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    rounds_per_epoch = result["num_prompts"] // 2  # 8 completions per round / 4 generations = 2 prompts
    assert [r["epoch"] for r in steps] == [1 / rounds_per_epoch, 2 / rounds_per_epoch]
    assert list(final) == ["train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos",
                           "train_loss", "epoch", "step"]
    assert final["step"] == 2 and final["epoch"] == steps[-1]["epoch"] and final["total_flos"] > 0
    assert final["train_loss"] == pytest.approx(sum(r["loss"] for r in steps) / 2)
    assert final["train_samples_per_second"] == pytest.approx(2 * 8 / final["train_runtime"], rel=0.01)
    assert math.isfinite(result["training_loss"]) and result["training_loss"] == final["train_loss"]
    assert {k: v for k, v in result["metrics"].items() if not k.startswith("eval_")} == {
        k: v for k, v in final.items() if k != "step"}
    assert result["metrics"]["eval_reward_before"] > 0.5  # eval_dataset scored, with the plain template
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "eval_loss" not in r]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rewards/answer_tag/mean"] > 0.5 for r in records), records
    assert (run_dir / "initial_model" / "config.json").is_file()  # the model object, saved for Megatron and vLLM
    assert AutoTokenizer.from_pretrained(run_dir).chat_template == SWITCHED_TEMPLATE  # save_model: our tokenizer
    AutoModelForCausalLM.from_pretrained(run_dir)


GFPO_CURRICULUM_SCRIPT = '''
"""A TRL user's GFPO + curriculum script: the filter (an instance) and the hook (a function) live in __main__."""
import json
import sys

from engine.train.data import build_arithmetic_dataset
from engine.experimental.gfpo import GFPOConfig, GFPOTrainer

out, max_steps, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "resume"


def accuracy(completions, answer, **kwargs):  # reads the `answer` column: the curriculum must carry it over
    return [float(f"<answer>{a}" in c) for c, a in zip(completions, answer, strict=True)]


def curriculum_fn(prompts, completions, rewards, metas):
    with open(f"{out}/curriculum.jsonl", "a") as log:
        log.write(json.dumps({"prompts": prompts, "metas": metas, "num_completions": len(completions),
                              "floats": all(type(r) is float for r in rewards)}) + "\\n")
    return prompts[::-1]  # one per sample: the groups in reverse order


class GroupFilter:
    def __call__(self, group_completions, group_rewards, **kwargs):
        with open(f"{out}/filter.jsonl", "a") as log:
            log.write(json.dumps(group_completions) + "\\n")
        return [[-len(c) for c in group] for group in group_completions]


args = GFPOConfig(output_dir=out, max_steps=max_steps, per_device_train_batch_size=8, num_generations=4,
                  num_remains_in_group=2, max_completion_length=12, learning_rate=1e-5, logging_steps=1,
                  vllm_gpu_memory_utilization=0.15, vllm_max_model_length=256, report_to="none",
                  dynamic_prompts_fn=curriculum_fn)
trainer = GFPOTrainer(model="builtin:tiny-qwen2-arith", reward_funcs=accuracy, args=args,
                      train_dataset=build_arithmetic_dataset("train").select(range(32)),
                      group_filter_func=GroupFilter())
trainer.train(resume_from_checkpoint=True if resume else None)
'''


@pytest.mark.slow
def test_script_hooks_defined_in_main_train_save_and_resume(tmp_path):
    """`python script.py`: step 1 (checkpoint at the end), then a second run resumes it for step 2. The hook sees one
    element per sample with the `answer` column; the round after it (across the checkpoint) samples what it chose;
    the config records the objects by description and the resumed run does not try to import them."""
    script, out = tmp_path / "gfpo_curriculum.py", tmp_path / "run"
    script.write_text(GFPO_CURRICULUM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}
    for max_steps, mode in ((1, "fresh"), (2, "resume")):
        proc = warm_python.run([sys.executable, str(script), str(out), str(max_steps), mode], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=420)
        assert proc.returncode == 0, f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "resumed from" in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rewards/accuracy/mean"] > 0.5 for r in records), records  # `answer` reached the reward both times
    calls = [json.loads(line) for line in (out / "curriculum.jsonl").read_text().splitlines()]
    assert len(calls) == 2 and all(c["floats"] and len(c["prompts"]) == c["num_completions"] == 16 for c in calls)
    assert calls[1]["prompts"] == calls[0]["prompts"][::-1], "the resumed round must sample the hook's choice"
    for call in calls:
        assert all("answer" in meta for meta in call["metas"])
    groups = [json.loads(line) for line in (out / "filter.jsonl").read_text().splitlines()]
    assert [len(g) for g in groups] == [4, 4] and all(len(group) == 4 for g in groups for group in g)
    config = (out / "config.yaml").read_text()
    assert "group_filter_func: __main__:GroupFilter()" in config
    assert "dynamic_prompts_fn: __main__:curriculum_fn" in config


# ---------------------------------------------------------------------------------------------------------------
# TRL's trainer surface in one process: callbacks, scheduled evaluation of a dict of eval sets, a streaming train
# set resumed at its position, trainer.model before / after, a failed train() and a new trainer training after it


def _arithmetic_rows(start: int, stop: int):
    from engine.train.data import build_arithmetic_dataset

    yield from build_arithmetic_dataset("train").select(range(start, stop))


def accuracy(completions, answer, **kwargs):
    return [float(f"<answer>{a}" in c) for c, a in zip(completions, answer, strict=True)]


def accuracy_logged(completions, answer, log_extra=None, **kwargs):
    """`accuracy`, also logging each completion's first 5 characters as a completions-table column."""
    log_extra("head", [c[:5] for c in completions])
    return accuracy(completions, answer)


class _FailingReward:
    """Records the prompts of its first call, then raises: a train() that fails mid-run in a user's code."""

    __name__ = "accuracy"

    def __init__(self):
        self.prompts = None

    def __call__(self, prompts, completions, answer, **kwargs):
        if self.prompts is None:  # the engine calls again row by row to name the failing row
            self.prompts = list(prompts)
        raise RuntimeError("reward service unavailable")


class _TokenCount:
    """Reward = the completion's length in tokens (recorded): the eval loss is then known in closed form."""

    __name__ = "token_count"

    def __init__(self):
        self.rewards = []

    def __call__(self, completions, completion_ids, **kwargs):
        self.rewards += [float(len(ids)) for ids in completion_ids]
        return [float(len(ids)) for ids in completion_ids]


def _recording_callback(save_at: int | None = None, stop_at: int | None = None):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """Every event with the state's step; asks for a checkpoint after step `save_at` and a stop after `stop_at`."""

        def __init__(self):
            self.events, self.logs, self.evals = [], [], []

        def __getattribute__(self, name):
            if name.startswith("on_") and name not in ("on_step_end", "on_log", "on_evaluate"):
                def record(args, state, control, **kwargs):
                    self.events.append((name, state.global_step))
                return record
            return super().__getattribute__(name)

        def on_step_end(self, args, state, control, **kwargs):
            self.events.append(("on_step_end", state.global_step))
            control.should_save = state.global_step == save_at
            control.should_training_stop = state.global_step == stop_at

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.events.append(("on_log", state.global_step))
            self.logs.append(dict(logs))

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.events.append(("on_evaluate", state.global_step))
            self.evals.append(dict(metrics))

    return Recorder()


def _held() -> tuple[int, int]:
    """(threads alive, process groups alive) in this process: what a finished trainer must give back."""
    import threading

    from torch.distributed import distributed_c10d

    return threading.active_count(), len(distributed_c10d._world.pg_map)


def _surface_in_one_process(output_dir: str) -> dict:
    import datasets
    import torch

    from engine import GRPOConfig, GRPOTrainer
    from engine.train.data import build_arithmetic_dataset

    out = Path(output_dir)
    held_out = build_arithmetic_dataset("test")
    stream = datasets.IterableDataset.from_generator(_arithmetic_rows, gen_kwargs={"start": 0, "stop": 64})

    def args(**kw):
        return GRPOConfig(**dict(output_dir=str(out / "run"), max_steps=3, per_device_train_batch_size=8,
                                 num_generations=4, max_completion_length=12, learning_rate=1e-3, logging_steps=1,
                                 report_to="none", vllm_gpu_memory_utilization=0.15, vllm_max_model_length=256,
                                 num_generations_eval=2, per_device_eval_batch_size=2, eval_max_prompts=2) | kw)

    recorder = _recording_callback(save_at=1, stop_at=2)
    first = GRPOTrainer(model="builtin:tiny-qwen2-arith", reward_funcs=accuracy, train_dataset=stream,
                        eval_dataset={"easy": held_out.select(range(4)), "hard": held_out.select(range(4, 8))},
                        args=args(eval_strategy="steps", eval_steps=2), callbacks=[recorder])
    before = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    first.train()
    held = [_held()]
    after = dict(first.model.named_parameters())
    changed = [n for n in before if not torch.equal(before[n], after[n].detach())]
    # a build that fails after its engine started (a checkpoint that does not exist) closes that engine
    import gc

    from engine.rollout.vllm_engine import VLLMEngine

    try:
        GRPOTrainer(model="builtin:tiny-qwen2-arith", reward_funcs=accuracy, train_dataset=stream,
                    args=args()).train(resume_from_checkpoint=str(out / "no-such-checkpoint"))
        bad_build = None
    except Exception as exc:  # noqa: BLE001 - the message is checked
        bad_build = f"{type(exc).__name__}: {exc}"
    gc.collect()
    live_engines = sum(isinstance(o, VLLMEngine) and o.llm is not None for o in gc.get_objects())
    failing = _FailingReward()
    second = GRPOTrainer(model="builtin:tiny-qwen2-arith", reward_funcs=failing, train_dataset=stream, args=args())
    try:
        second.train(resume_from_checkpoint=True)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    from transformers import AutoModelForCausalLM

    from engine.models.tiny_model import resolve_builtin_model

    obj = AutoModelForCausalLM.from_pretrained(resolve_builtin_model("builtin:tiny-qwen2-arith", out / "cache"))
    initial = {n: p.detach().clone() for n, p in obj.named_parameters()}
    third = GRPOTrainer(model=obj, reward_funcs=accuracy, train_dataset=stream, args=args())
    third.train(resume_from_checkpoint=True)
    held.append(_held())
    obj_trained = third.model is obj and all(not torch.equal(initial[n], p) for n, p in obj.named_parameters())
    lengths = _TokenCount()
    fourth = GRPOTrainer(model=str(out / "run" / "hf"), reward_funcs=lengths, train_dataset=stream,
                         args=args(vllm_importance_sampling_correction=False, temperature=2.0))
    evaluated = fourth.evaluate(eval_dataset=held_out.select(range(4)))
    # (5) TR-DPO: after train(), ref_model is the reference mixed towards the policy (alpha 0.5 after its one step)
    fifth = GRPOTrainer(model="builtin:tiny-qwen2-arith", reward_funcs=accuracy_logged, train_dataset=stream,
                        args=args(max_steps=1, output_dir=str(out / "trdpo"), beta=0.1, sync_ref_model=True,
                                  ref_model_sync_steps=1, ref_model_mixup_alpha=0.5, entropy_coef=0.01,
                                  log_completions=True))
    ref_before = {n: p.detach().clone() for n, p in fifth.ref_model.named_parameters()}
    fifth.train()
    held.append(_held())
    trained, mixed = dict(fifth.model.named_parameters()), dict(fifth.ref_model.named_parameters())
    # the engine's reference holds the initial weights in model.dtype (bf16, TRL's default)
    expected = {n: 0.5 * ref_before[n].to(mixed[n].dtype).float() + 0.5 * trained[n].float() for n in ref_before}
    # in half bf16 spacings of the expected value (one rounding into bf16 is <= 1)
    mix_error = max(float(((mixed[n].float() - e).abs() / (e.abs() * 2**-8 + 1e-30)).max()) for n, e in expected.items())
    return {"events": recorder.events, "logs": recorder.logs, "evals": recorder.evals, "changed": changed,
            "num_params": len(before), "history": first.state.log_history, "global_step": first.state.global_step,
            "error": error, "failing_prompts": failing.prompts, "third_step": third.state.global_step,
            "fourth_history": fourth.state.log_history, "object_trained_in_place": obj_trained,
            "eval_lengths": lengths.rewards, "evaluated": evaluated,
            "stream_prompts": [r["prompt"] for r in _arithmetic_rows(0, 6)],
            "checkpoints": sorted(p.name for p in (out / "run").glob("checkpoint-*")),
            "bad_build": bad_build, "live_engines": live_engines, "mix_error": mix_error,
            "trdpo_entropy_coef": fifth.entropy_coef, "trdpo_history": fifth.state.log_history,
            "trdpo_logs": fifth._logs, "held": held}


@pytest.mark.slow
def test_callbacks_eval_sets_streams_model_and_a_failed_train_in_one_process(tmp_path):
    """One process, four engine starts: (1) a streaming train set, a callback, two named eval sets evaluated every 2
    steps; the callback saves after step 1 and stops after step 2 of 3. (2) a new trainer resumes at step 2 and its
    reward function raises: train() fails mid-run. (3) a new trainer in the same process resumes and trains step 3
    (its round: the stream's next rows) from a model object, which holds the trained weights after, (4) a trainer
    of the trained model evaluates (TRL's eval loss, averaged per eval batch, checked in closed form), (5) a TR-DPO
    run's trainer.ref_model is the mixed reference and a static entropy bonus logs its coefficient. Between (1) and
    (2) a build that fails after its engine started (a missing checkpoint) leaves no engine running. After the first,
    third and fifth train() the process holds the same threads and process groups (no trainer leaks them)."""
    result = run_distributed(_surface_in_one_process, 1, str(tmp_path))[0]
    events = result["events"]
    names = [name for name, _ in events]
    assert names[:3] == ["on_init_end", "on_train_begin", "on_epoch_begin"]
    assert events[3:7] == [("on_step_begin", 0), ("on_step_end", 1), ("on_log", 1), ("on_save", 1)]
    assert ("on_evaluate", 2) in events and ("on_step_end", 3) not in events  # should_training_stop honoured
    assert names[-2:] == ["on_save", "on_train_end"] and result["global_step"] == 2
    assert result["held"][0] == result["held"][1] == result["held"][2], (
        f"(threads, process groups) after the first, third and fifth trainer: {result['held']}")
    assert result["checkpoints"] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]  # 1: the callback's should_save
    assert {"loss", "reward", "rewards/accuracy/mean", "completions/mean_length", "learning_rate", "grad_norm",
            "num_tokens", "epoch"} <= set(result["logs"][0])
    [evaluation] = result["evals"]
    for name in ("easy", "hard"):
        for key in ("loss", "reward", "reward_std", "rewards/accuracy/mean", "completions/mean_length", "runtime",
                    "samples_per_second", "steps_per_second"):
            assert f"eval_{name}_{key}" in evaluation, (name, key, sorted(evaluation))
    assert any("eval_easy_reward" in r for r in result["history"])  # log_history holds the evaluation too
    assert result["history"][-1]["step"] == 2 and "train_loss" in result["history"][-1]
    assert len(result["changed"]) == result["num_params"], "trainer.model after train() holds the trained weights"
    assert "raised RuntimeError: reward service unavailable" in result["error"]
    # the resumed round samples the stream's rows 4-5 (position 2 rounds of 2 prompts, recorded by the checkpoint)
    assert sorted(set(result["failing_prompts"])) == sorted(result["stream_prompts"][4:6])
    assert result["third_step"] == 3
    assert result["object_trained_in_place"], "a model object given to GRPOTrainer holds the trained weights after"
    assert {"eval_loss", "eval_reward", "eval_rewards/token_count/mean", "eval_completions/mean_length", "epoch"} <= set(
        result["evaluated"])
    assert all(math.isfinite(m[f"eval_{n}_loss"]) for m in result["evals"] for n in ("easy", "hard"))
    assert result["fourth_history"][-1]["eval_reward"] == result["evaluated"]["eval_reward"]
    # the eval loss in closed form: DAPO, ratio 1, no IS correction, beta 0, reward = tokens L, 2 per prompt, one
    # prompt per eval batch (per_device_eval_batch_size 2), averaged over the batches as HF's evaluation loop:
    # mean over groups of -sum(A L) / sum(L) with A = (L - group mean) / (group std + 1e-4)
    lengths = torch.tensor(result["eval_lengths"], dtype=torch.float64).view(-1, 2)
    advantages = (lengths - lengths.mean(1, keepdim=True)) / (lengths.std(1, keepdim=True) + 1e-4)
    expected = float((-(advantages * lengths).sum(1) / lengths.sum(1)).mean())
    assert abs(expected) > 1e-3, lengths  # lengths vary within groups (sampled at temperature 2): a loss to check
    assert result["evaluated"]["eval_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6), (expected, lengths)
    assert "no-such-checkpoint" in result["bad_build"] and result["live_engines"] == 0, result["bad_build"]
    assert result["mix_error"] <= 1.01, "ref_model after TR-DPO: 0.5 * initial + 0.5 * trained, rounded to bf16"
    # a static entropy bonus logs its coefficient (TRL's record; logged at step 1, before the final record)
    assert result["trdpo_entropy_coef"] == 0.01 and result["trdpo_history"][-2]["entropy_coef"] == 0.01
    logs = result["trdpo_logs"]  # TRL's private completion log: the last table, log_extra columns under "extra"
    assert len(logs["completion"]) == 8 and list(logs["rewards"]) == ["accuracy_logged"]
    assert logs["extra"]["head"] == [c[:5] for c in logs["completion"]] and len(logs["advantages"]) == 8
