"""Checkpoint bookkeeping without a model (engine/train/checkpoint.py): which directory `latest` picks, what rotation
keeps, and the errors for a missing, partial or foreign checkpoint."""

import json

import pytest

from engine.train.checkpoint import (
    FORMAT,
    CheckpointError,
    Progress,
    check_compatible,
    find_latest_checkpoint,
    is_save_step,
    list_checkpoints,
    read_progress,
    resolve_resume_checkpoint,
    rotate_checkpoints,
)


def _fake_checkpoint(run_dir, name, step=0, complete=True):
    """A directory shaped like a finished save (trainer state + dist_checkpointing metadata) or a partial one."""
    path = run_dir / name
    path.mkdir(parents=True)
    (path / "metadata.json").write_text("{}")
    if complete:
        state = {"format": FORMAT, "progress": {"step": step, "rounds_done": step // 2}, "model": {"vocab_size": 400}}
        (path / "trainer_state.json").write_text(json.dumps(state))
    return path


def test_latest_is_the_highest_step_not_the_newest_name(tmp_path):
    for step in (5, 40, 10):  # lexical order would pick checkpoint-5
        _fake_checkpoint(tmp_path, f"checkpoint-{step}", step)
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-40"
    assert [s for s, _ in list_checkpoints(tmp_path)] == [5, 10, 40]


def test_latest_ignores_partial_temporaries_and_incomplete_directories(tmp_path, capsys):
    _fake_checkpoint(tmp_path, "checkpoint-10", 10)
    _fake_checkpoint(tmp_path, "checkpoint-20.tmp", 20)  # a save killed before its rename
    _fake_checkpoint(tmp_path, "checkpoint-30", 30, complete=False)  # no trainer_state.json
    (tmp_path / "checkpoint-notastep").mkdir()
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    err = capsys.readouterr().err
    assert "checkpoint-20.tmp" in err and "partial" in err
    assert "checkpoint-30" in err and "incomplete" in err


def test_latest_without_checkpoints_starts_afresh(tmp_path):
    assert resolve_resume_checkpoint("latest", tmp_path) is None
    assert resolve_resume_checkpoint("latest", tmp_path / "missing_run_dir") is None
    assert resolve_resume_checkpoint(None, tmp_path) is None


def test_a_fresh_run_over_earlier_checkpoints_says_so(tmp_path, capsys):
    _fake_checkpoint(tmp_path, "checkpoint-40", 40)
    assert resolve_resume_checkpoint(None, tmp_path) is None
    err = capsys.readouterr().err
    assert "earlier run (checkpoint-40)" in err and "resume_from_checkpoint=latest" in err


def test_resume_from_a_named_path(tmp_path):
    path = _fake_checkpoint(tmp_path, "checkpoint-8", 8)
    assert resolve_resume_checkpoint(str(path), tmp_path) == path
    assert read_progress(path) == Progress(step=8, rounds_done=4)


def test_resume_from_a_missing_or_partial_path_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-99"), tmp_path)
    partial = _fake_checkpoint(tmp_path, "checkpoint-20.tmp", 20, complete=False)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume_checkpoint(str(partial), tmp_path)


def test_corrupt_or_foreign_trainer_state_is_a_clear_error(tmp_path):
    path = _fake_checkpoint(tmp_path, "checkpoint-3", 3)
    (path / "trainer_state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read the trainer state"):
        read_progress(path)
    (path / "trainer_state.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(CheckpointError, match="format"):
        read_progress(path)


def test_checkpoint_of_another_model_is_refused_naming_the_fields(tmp_path):
    state = {"model": {"hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 400}}
    check_compatible(state, tmp_path, {"hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 400})
    with pytest.raises(CheckpointError, match=r"hidden_size: checkpoint 128, this run 256") as info:
        check_compatible(state, tmp_path, {"hidden_size": 256, "num_hidden_layers": 8, "vocab_size": 400})
    assert "num_hidden_layers" in str(info.value) and "vocab_size" not in str(info.value)


def test_rotation_keeps_the_newest_k_by_step(tmp_path):
    for step in (2, 4, 6, 8, 10):
        _fake_checkpoint(tmp_path, f"checkpoint-{step}", step)
    partial = _fake_checkpoint(tmp_path, "checkpoint-12.tmp", 12, complete=False)
    deleted = rotate_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in deleted) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [8, 10]
    assert partial.exists(), "rotation deletes only complete checkpoints"


@pytest.mark.parametrize("keep", [None, 0, 10])
def test_rotation_without_a_limit_or_under_it_keeps_everything(tmp_path, keep):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path, f"checkpoint-{step}", step)
    assert rotate_checkpoints(tmp_path, keep) == []
    assert len(list_checkpoints(tmp_path)) == 3


@pytest.mark.parametrize("save_steps,steps_per_round,saved_after", [
    (2, 1, [2, 4, 6, 8, 10, 12]),
    (2, 3, [3, 6, 9, 12]),  # every round crosses a multiple of 2: saved at its end
    (5, 3, [6, 12]),  # crossed 5 in the round 4..6, 10 in 10..12
    (0, 1, []),  # only at the end of training
])
def test_checkpoints_fall_on_the_round_that_crosses_a_multiple_of_save_steps(save_steps, steps_per_round, saved_after):
    ends = range(steps_per_round, 13, steps_per_round)
    assert [s for s in ends if is_save_step(save_steps, s, steps_per_round)] == saved_after
