"""Optimizer steps over generation rounds (engine/train/step_schedule.py): TRL 1.16's micro-step order under the HF
Trainer's accumulation (slices carried across rounds, a pass's end flushed as a shorter step) and HF's step count."""

from engine.grpo.policy_loss import LossNormalizer
from engine.train.step_schedule import (
    OptimizerStep,
    StepSchedule,
    count_total_steps,
    deferred_save_warning,
    rounds_for_steps,
    uses_carried_slices,
)


def _slices(round_index: int, num_slices: int) -> list[OptimizerStep]:
    """Slices labelled (round, slice), each counting 10 * round + slice tokens and 2 sequences."""
    return [OptimizerStep([{"id": (round_index, s)}], LossNormalizer(num_tokens=10 * round_index + s, num_sequences=2))
            for s in range(num_slices)]


def _ids(step: OptimizerStep) -> list[tuple[int, int]]:
    return [mb["id"] for mb in step.microbatches]


def test_steps_span_rounds_with_carried_slices_and_summed_normalisers():
    schedule = StepSchedule(3, 1)  # steps_per_generation=4, gradient_accumulation_steps=3
    taken = [schedule.take(_slices(r, 4), ends_pass=False, steps_left=100) for r in range(3)]
    assert [len(steps) for steps in taken] == [1, 1, 2]  # 4 optimizer steps per 3 rounds, no slice dropped
    flat = [_ids(step) for steps in taken for step in steps]
    assert flat == [[(0, 0), (0, 1), (0, 2)], [(0, 3), (1, 0), (1, 1)], [(1, 2), (1, 3), (2, 0)],
                    [(2, 1), (2, 2), (2, 3)]]
    spanning = taken[1][0].normalizer
    assert (spanning.num_tokens, spanning.num_sequences) == (3 + 10 + 11, 6)
    assert schedule.carried == []


def test_num_iterations_repeats_the_round_in_trl_order_and_a_pass_end_flushes_a_shorter_step():
    schedule = StepSchedule(3, 2)  # TRL's test_prepare_input_called_with_correct_data: spg=4, mu=2, GA=3
    first = schedule.take(_slices(0, 4), ends_pass=False, steps_left=100)
    assert [_ids(s) for s in first] == [[(0, 0), (0, 1), (0, 2)], [(0, 3), (0, 0), (0, 1)]]
    assert [mb["id"] for mb in schedule.carried[0].microbatches] == [(0, 2)]
    second = schedule.take(_slices(1, 4), ends_pass=True, steps_left=100)  # 2 rounds per pass: HF's last window
    assert [_ids(s) for s in second] == [[(0, 2), (0, 3), (1, 0)], [(1, 1), (1, 2), (1, 3)], [(1, 0), (1, 1), (1, 2)],
                                         [(1, 3)]]
    assert schedule.carried == []


def test_the_run_ends_at_steps_left_and_drops_the_rest():
    schedule = StepSchedule(3, 1)
    assert len(schedule.take(_slices(0, 4), ends_pass=False, steps_left=1)) == 1
    assert schedule.carried == []


def test_whole_step_units_never_carry():
    schedule = StepSchedule(1, 2)  # steps_per_generation = 2 * GA: the round's two steps, twice
    steps = schedule.take(_slices(0, 2), ends_pass=False, steps_left=100)
    assert [_ids(s) for s in steps] == [[(0, 0)], [(0, 1)], [(0, 0)], [(0, 1)]]
    assert not uses_carried_slices(4, 1, 2) and uses_carried_slices(4, 1, 3) and not uses_carried_slices(3, 2, 3)


def test_counts_steps_as_the_hf_trainer_does():
    # TRL's test: 12 prompts, 6 per round (2 rounds per pass), spg=4, mu=2, GA=3, 3 epochs: 16 micro-steps per pass
    # = 3+3+3+3+3+1, 6 optimizer steps per pass, 18 in all (48 training_step calls)
    assert count_total_steps(2, 8, 3, 3) == 18
    assert count_total_steps(2, 8, 3, 1.5) == 9
    assert rounds_for_steps(4, 4, 3) == 3 and rounds_for_steps(5, 4, 3) == 4


def test_deferred_save_warning_names_the_interval():
    message = deferred_save_warning(2, 4, 1, 3)
    assert "checkpoint.save_steps=2" in message and "every 3 rounds = 4 optimizer steps" in message
    assert deferred_save_warning(0, 4, 1, 3) is None and deferred_save_warning(2, 4, 1, 2) is None


def test_rounds_smaller_than_a_step_train_none_until_enough_are_carried():
    schedule = StepSchedule(3, 1)  # steps_per_generation=1, gradient_accumulation_steps=3
    taken = [schedule.take(_slices(r, 1), ends_pass=False, steps_left=100) for r in range(3)]
    assert [len(steps) for steps in taken] == [0, 0, 1]
    assert _ids(taken[2][0]) == [(0, 0), (1, 0), (2, 0)]
