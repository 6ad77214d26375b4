"""engine/train/run_summary.py: the end-of-run table names the held-out reward before -> after and only the outputs
that exist."""

from engine.config import build_config
from engine.train.run_summary import format_run_summary


def _cfg(tmp_path, **checkpoint):
    return build_config({"train": {"output_dir": str(tmp_path)}, "checkpoint": checkpoint})


def test_summary_table_shows_reward_steps_time_and_existing_outputs(tmp_path):
    for name in ("metrics.jsonl", "metrics.png"):
        (tmp_path / name).write_text("")
    (tmp_path / "checkpoint-20").mkdir()
    (tmp_path / "hf").mkdir()
    summary = {"eval_reward_before": 0.25, "eval_reward_after": 0.76, "steps": 20, "start_step": 0}
    lines = format_run_summary(_cfg(tmp_path), summary, 125.4).splitlines()
    assert lines[0] == "run summary"
    rows = {line.split("   ")[0].strip(): line.split("   ", 1)[1].strip() for line in lines[1:]}
    assert rows["held-out reward"].startswith("0.250 -> 0.760")
    assert rows["optimizer steps"] == "20" and rows["wall time"] == "2 min 05 s"
    assert rows["checkpoint"] == str(tmp_path / "checkpoint-20") and rows["HF export"] == str(tmp_path / "hf")
    assert rows["curves"] == str(tmp_path / "metrics.png")


def test_summary_leaves_out_what_a_run_did_not_produce(tmp_path):
    (tmp_path / "hf").mkdir()  # stale: this run does not export
    summary = {"eval_reward_before": None, "eval_reward_after": None, "steps": 6, "start_step": 2}
    text = format_run_summary(_cfg(tmp_path, save_hf_at_end=False), summary, 9.6)
    assert "held-out" not in text and "HF export" not in text and "checkpoint" not in text and "curves" not in text
    assert "6 (resumed at 2)" in text and "10 s" in text
