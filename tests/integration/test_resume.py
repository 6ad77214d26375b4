"""Exact resume of the GRPO loop on CPU (real Megatron, real in-process vLLM), through `python -m engine train`,
the command the SLURM templates run (engine/train/checkpoint.py, engine/train/prompt_rounds.py, the trainer's checkpoint wiring).

Runs of the tiny config (4 optimizer steps, one per round, beta > 0 so the KL term is live, a reward with signal
for a random policy, a large learning rate so that the policy moves every step, decaying linearly so that the
restored schedule matters):
- A runs uninterrupted;
- B saves every 2 steps and is SIGKILLed from outside as soon as checkpoint-2 exists (mid-round 3 or so);
- C resumes B with `resume_from_checkpoint=latest`, saving every 2 steps, and is killed *while writing*
  checkpoint-4: the test hook `GRPO_CHECKPOINT_CRASH_BEFORE_RENAME=4` SIGKILLs it after every file of the
  checkpoint is written but before the rename (a window too short to hit from outside);
- D resumes with `latest` again, which must pick checkpoint-2 (ignoring checkpoint-4.tmp), and runs to step 4
  (steps 3 and 4, both after the resume point, are compared: no more rounds are needed).
A separate pair of runs resumes with prompts waiting in the curriculum queue (the seed's documented hook, verbatim,
tests/helpers/curriculum.py, under a reward that changes sign): its prompts, with hints appended, make the tiny
model answer with an empty completion, which would leave the policy unmoved in the runs above.
The metrics file of the B/C/D run directory then holds exactly one row per step (rows logged after the checkpoint
by the killed runs are dropped on resume) and every row equals A's, bit for bit (compared as floats with
tolerance 0): the rounds are pure functions of (seed, round) — prompts, vLLM seeds, row shuffle — and the model,
its float32 main parameters, Adam moments, LR schedule and RNG are restored exactly on one CPU process, so nothing
may differ. The runs are bf16 (TRL's default and the shipped large configs'); the float32 path restores the same
state (tests/distributed/test_checkpoint_resharding.py checks both dtypes bit for bit).
Only wall-clock fields (time/*, step_time, tokens_per_s, elapsed_s, weight_sync/seconds) are left out.
The runs use TR-DPO (`grpo.sync_ref_model`, the reference mixed after steps 2 and 4 with alpha 0.5): D resumes
from checkpoint-2, after the first mix, so its KL equals A's only if the mixed reference is restored; and the
reference D saves at checkpoint-4 is TRL's formula applied to the policy saved with it and the reference restored
from checkpoint-2 (bf16, exactly: the mix is computed in float32 and rounded once, engine/policy/reference.py).
A's output is also checked to be quiet by default (engine/log_filters.py): no vLLM INFO line, no known-harmless warning.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import warm_python

REPO = Path(__file__).resolve().parents[2]
STEPS = 4
SYNC_STEPS, ALPHA = 2, 0.5
WALL_CLOCK = re.compile(r"^time/|_s$|seconds|elapsed|step_time")


def digit_fraction(completions, **kwargs):
    """A reward with signal even for a random model: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "engine", "train", "configs/tiny_cpu.yaml", f"train.output_dir={run_dir}",
            f"train.max_steps={STEPS}", "generation.max_completion_length=12", "grpo.beta=0.05",
            "reward.reward_funcs=[tests.integration.test_resume:digit_fraction]", "optimizer.learning_rate=1e-2",
            "optimizer.lr_scheduler_type=linear", "data.dataset_test_split=null", "checkpoint.save_hf_at_end=false",
            "model.dtype=bfloat16", "grpo.sync_ref_model=true", f"grpo.ref_model_sync_steps={SYNC_STEPS}",
            f"grpo.ref_model_mixup_alpha={ALPHA}", *overrides]


CURRICULUM = ("reward.reward_funcs=[tests.integration.test_resume:digit_fraction,tests.helpers.curriculum:sign_by_prompt]",
              "data.dynamic_prompts_fn=tests.helpers.curriculum:curriculum_fn")
"""The seed's documented curriculum hook, verbatim, under a reward whose sum changes sign: its prompts queue up."""


def _env(**extra: str) -> dict:
    quiet = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"} | {"GRPO_ENGINE_VERBOSE": "0"}
    return quiet | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | extra


VLLM_INFO = re.compile(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d \[")
"""A vLLM INFO record: `(MainProcess pid=7) INFO 11-23 13:03:02 [core.py:133] ...`."""


def _assert_quiet(log: str) -> None:
    """Not verbose (engine/log_filters.py): no vLLM INFO line, none of the known-harmless warnings this bf16 run
    of a float32 checkpoint would print, and a short output ending in the summary table."""
    assert not VLLM_INFO.search(log), f"vLLM INFO lines in a quiet run:\n{log}"
    for harmless in ("Failed to load weights", "Attempted to load weight", "Transformer Engine and Apex",
                     "Loading safetensors checkpoint shards", "set_num_threads"):
        assert harmless not in log, f"{harmless!r} printed in a quiet run:\n{log}"
    assert "run summary" in log and len(log.splitlines()) < 40, log


def _start(command: list[str], env: dict, log: Path) -> warm_python.Popen:
    """Start in its own process group, its output into `log`."""
    with open(log, "w") as out:
        return warm_python.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: warm_python.Popen) -> int:
    """Wait for a started run to end; the exit status (negative: killed by that signal)."""
    try:
        return proc.wait(timeout=400)
    finally:
        _kill_group(proc)


def _run(command: list[str], env: dict, log: Path) -> int:
    """Run to the end in its own process group; the exit status (negative: killed by that signal)."""
    return _finish(_start(command, env, log))


def _run_until_then_kill(command: list[str], env: dict, log: Path, ready) -> int:
    """Start, SIGKILL the whole process group once `ready()` holds; the exit status."""
    with open(log, "w") as out:
        proc = warm_python.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 400
        while proc.poll() is None and not ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        _kill_group(proc)
        return proc.wait(timeout=60)


def _run_and_resume_beside(straight: list[str], resumed: list[str], checkpoint: Path, tmp_path: Path) -> None:
    """Run `straight` to the end and, as soon as it has written `checkpoint` (renamed into place: complete), start
    `resumed` from it beside the rest of the straight run (one core each, OMP_NUM_THREADS=1: the runs are
    independent and bit-exact either way; side by side saves the resumed run's start-up). Both must exit 0."""
    first = _start(straight, _env(), tmp_path / "a.log")
    try:
        deadline = time.monotonic() + 400
        while first.poll() is None and not (checkpoint / "trainer_state.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (checkpoint / "trainer_state.json").exists(), f"no {checkpoint.name}:\n{_tail(tmp_path / 'a.log')}"
        second = _start(resumed, _env(), tmp_path / "b.log")
        assert _finish(second) == 0, _tail(tmp_path / "b.log")
    except BaseException:
        _kill_group(first)
        raise
    assert _finish(first) == 0, _tail(tmp_path / "a.log")


def _kill_group(proc: warm_python.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and the helpers it started (checkpoint writers)
    except ProcessLookupError:
        pass


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"one row per step expected, got steps {steps}"
    return {r["step"]: {k: v for k, v in r.items() if not WALL_CLOCK.search(k)} for r in rows}


def _tail(log: Path) -> str:
    return "\n".join(log.read_text().splitlines()[-30:])


def _kill_crash_and_resume(resumed: Path, tmp_path: Path) -> None:
    """B, C and D of the test below, in `resumed`."""
    from engine.train.checkpoint import find_latest_checkpoint, list_checkpoints

    # B: SIGKILL from outside once checkpoint-2 is in place
    ready = lambda: (resumed / "checkpoint-2" / "trainer_state.json").exists()  # noqa: E731
    status = _run_until_then_kill(_command(resumed, "checkpoint.save_steps=2"), _env(), tmp_path / "b.log", ready)
    assert status == -signal.SIGKILL, f"B should have been killed mid-run (status {status}):\n{_tail(tmp_path / 'b.log')}"
    assert [s for s, _ in list_checkpoints(resumed)] == [2]
    # C: resume, then die while writing checkpoint-4 (after the files, before the rename)
    status = _run(_command(resumed, "checkpoint.save_steps=2", "checkpoint.resume_from_checkpoint=latest"),
                  _env(GRPO_CHECKPOINT_CRASH_BEFORE_RENAME="4"), tmp_path / "c.log")
    assert status == -signal.SIGKILL, f"C should have died saving checkpoint-4 (status {status}):\n{_tail(tmp_path / 'c.log')}"
    assert "resumed from" in (tmp_path / "c.log").read_text()
    assert (resumed / "checkpoint-4.tmp" / "trainer_state.json").exists() and not (resumed / "checkpoint-4").exists()
    assert find_latest_checkpoint(resumed) == resumed / "checkpoint-2", "the last good checkpoint must survive"
    # D: `latest` skips the partial checkpoint-4.tmp and resumes from checkpoint-2 to the end
    status = _run(_command(resumed, "checkpoint.save_steps=2", "checkpoint.resume_from_checkpoint=latest"), _env(),
                  tmp_path / "d.log")
    assert status == 0, _tail(tmp_path / "d.log")
    d_log = (tmp_path / "d.log").read_text()
    assert "checkpoint-4.tmp" in d_log and "partial" in d_log, "ignoring the partial checkpoint is logged"
    assert f"resumed from {resumed / 'checkpoint-2'}" in d_log
    assert [s for s, _ in list_checkpoints(resumed)] == [2, 4] and not (resumed / "checkpoint-4.tmp").exists()


@pytest.mark.slow
def test_killed_and_resumed_run_logs_the_same_metrics_as_an_uninterrupted_one(tmp_path):
    straight, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    # A: uninterrupted, beside B, C and D (independent of them; OMP_NUM_THREADS=1: one core each on 2 cores)
    uninterrupted = _start(_command(straight), _env(), tmp_path / "a.log")
    try:
        _kill_crash_and_resume(resumed, tmp_path)
    except BaseException:
        _kill_group(uninterrupted)
        raise
    assert _finish(uninterrupted) == 0, _tail(tmp_path / "a.log")
    _assert_quiet((tmp_path / "a.log").read_text())

    expected, actual = _rows(straight), _rows(resumed)
    assert sorted(actual) == sorted(expected) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        differing = {k: (expected[step].get(k), actual[step].get(k)) for k in expected[step] | actual[step]
                     if expected[step].get(k) != actual[step].get(k)}
        assert not differing, f"step {step}: uninterrupted vs resumed differ in {differing}"
    assert expected[STEPS]["kl"] > 0 and any(expected[s]["grad_norm"] > 0 for s in range(3, STEPS + 1))
    _assert_reference_mixed(resumed, tmp_path)


@pytest.mark.slow
def test_a_run_resumed_with_prompts_waiting_in_the_curriculum_queue_logs_what_the_uninterrupted_one_did(tmp_path):
    """The seed's documented curriculum hook (verbatim) queues more prompts than the rounds draw, so checkpoint-2
    holds a non-empty queue (engine/train/prompt_queue.py); a run resumed from it in another directory logs steps 3
    and 4 exactly as the uninterrupted run did (the queue, and with it every round's prompts, restored)."""
    straight, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    steps = ("train.max_steps=4", "checkpoint.save_steps=2")
    _run_and_resume_beside(_command(straight, *CURRICULUM, *steps),
                           _command(resumed, *CURRICULUM, *steps,
                                    f"checkpoint.resume_from_checkpoint={straight / 'checkpoint-2'}"),
                           straight / "checkpoint-2", tmp_path)
    expected, actual = _rows(straight), _rows(resumed)
    assert expected[2]["curriculum/queued"] > 0, "checkpoint-2 must hold prompts waiting in the curriculum queue"
    assert sorted(actual) == [3, 4]
    for step in (3, 4):
        differing = {k: (expected[step].get(k), actual[step].get(k)) for k in expected[step] | actual[step]
                     if expected[step].get(k) != actual[step].get(k)}
        assert not differing, f"step {step}: uninterrupted vs resumed differ in {differing}"


def _checkpoint_tensors(checkpoint: Path, tmp_path: Path) -> tuple[dict, dict]:
    """(reference, policy) tensors of a checkpoint by Megatron key, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    reference = {k.removeprefix("reference."): v for k, v in state.items()
                 if k.startswith("reference.") and isinstance(v, torch.Tensor)}  # not the layers' extra state
    return reference, {k: state[k] for k in reference}


def _assert_reference_mixed(run_dir: Path, tmp_path: Path) -> None:
    """ref_s = alpha * policy_s + (1 - alpha) * ref_{s-2}, from the tensors saved at steps s-2 and s."""
    import torch

    previous, _ = _checkpoint_tensors(run_dir / "checkpoint-2", tmp_path)
    for step in (4,):  # mixed from the reference D restored from checkpoint-2
        reference, policy = _checkpoint_tensors(run_dir / f"checkpoint-{step}", tmp_path)
        assert reference.keys() == previous.keys() and reference, sorted(reference)[:5]
        for key, ref in reference.items():
            mixed = previous[key].float().mul_(1 - ALPHA).add_(policy[key].float(), alpha=ALPHA).to(ref.dtype)
            assert torch.equal(ref, mixed), f"checkpoint-{step} {key}: the reference is not the TR-DPO mix"
        assert any(not torch.equal(reference[k], previous[k]) for k in reference), "the reference never moved"
        previous = reference


@pytest.mark.slow
def test_sigusr1_saves_at_the_next_round_boundary_and_exits_cleanly(tmp_path):
    """What SLURM's `--signal=USR1@600` (forwarded by torchrun to every worker) does to a run."""
    from engine.train.checkpoint import list_checkpoints, read_progress

    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    command = _command(run_dir, "train.max_steps=200", "checkpoint.save_steps=0", "checkpoint.save_hf_at_end=true")
    with open(log, "w") as out:
        proc = warm_python.Popen(command, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline and not (
                    metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
                time.sleep(0.05)
            proc.send_signal(signal.SIGUSR1)
            status = proc.wait(timeout=300)
        finally:
            _kill_group(proc)
    assert status == 0, _tail(log)
    last_step = max(_rows(run_dir))
    assert 2 <= last_step < 200, "the run stopped early, after the round in progress"
    assert [s for s, _ in list_checkpoints(run_dir)] == [last_step], "one checkpoint, at the round boundary"
    assert read_progress(run_dir / f"checkpoint-{last_step}").rounds_done == last_step  # one optimizer step per round
    assert "stopped by SIGUSR1" in log.read_text()
    assert not (run_dir / "hf").exists(), "a stopped run skips the final Hugging Face export"


SPANNING = ("train.per_device_train_batch_size=4", "train.steps_per_generation=4",
            "train.gradient_accumulation_steps=3", "train.max_steps=8", "checkpoint.save_steps=1")
"""TRL's accepted `steps_per_generation=4, gradient_accumulation_steps=3`: 4 micro-steps of 4 completions per round
(4 prompts x 4 generations), 3 per optimizer step, so steps span rounds (engine/train/step_schedule.py)."""


@pytest.mark.slow
def test_optimizer_steps_spanning_rounds_train_the_carried_slices_and_resume_exactly(tmp_path):
    """Rounds 1..6 train 1, 1, 2, 1, 1, 2 optimizer steps (the carried slices are trained with the next round's,
    never dropped: dropping them would take 8 rounds and log 8 rows); a checkpoint is due every step but holds no
    carried slice, so it is written at steps 4 and 8 only, with the warning naming why; a run resumed from
    checkpoint-4 logs what the uninterrupted one did at steps 5, 6 and 8, bit for bit."""
    from engine.train.checkpoint import list_checkpoints, read_progress

    straight, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    command = _command(resumed, *SPANNING, f"checkpoint.resume_from_checkpoint={straight / 'checkpoint-4'}")
    _run_and_resume_beside(_command(straight, *SPANNING), command, straight / "checkpoint-4", tmp_path)
    expected = _rows(straight)
    assert sorted(expected) == [1, 2, 4, 5, 6, 8], "one row per round, at its last optimizer step"
    assert [s for s, _ in list_checkpoints(straight)] == [4, 8]
    assert read_progress(straight / "checkpoint-4").rounds_done == 3
    assert "every 3 rounds = 4 optimizer steps" in (tmp_path / "a.log").read_text()
    assert all(expected[s]["grad_norm"] > 0 for s in expected)

    actual = _rows(resumed)
    assert sorted(actual) == [5, 6, 8]
    for step in actual:
        differing = {k: (expected[step].get(k), actual[step].get(k)) for k in expected[step] | actual[step]
                     if expected[step].get(k) != actual[step].get(k)}
        assert not differing, f"step {step}: uninterrupted vs resumed differ in {differing}"
