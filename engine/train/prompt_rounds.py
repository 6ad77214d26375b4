"""Which prompts each generation round uses, and the sampling seeds it generates with: pure functions of the run's
seed and the round's index, never of what ran before, so a resumed run replays the rounds an uninterrupted run
would have seen (exact resume, engine/train/checkpoint.py).

Owns: `PromptRounds` (the endless sequence of rounds of P prompt indices: each epoch a permutation seeded by
(seed, epoch), TRL's RepeatSampler with mini_repeat_count G, the G copies made by the engine's n=G; an incomplete
last chunk is dropped; `position` counts the rounds drawn, which is the data position a checkpoint stores and
`start` resumes from), `sampling_seeds` (one vLLM seed per prompt from (seed, step, attempt, prompt index)) and
`shuffle_order` (the seeded row permutation of a round).

Must not: hold datasets or call vLLM (the trainer passes indices and seeds).

Test: tests/unit/test_prompt_rounds.py.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any tuple of ints / strings (stable across processes and Python versions)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def epoch_order(num_prompts: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """(num_prompts,) prompt indices of one epoch. Epoch e is the (e+1)-th permutation of a generator seeded with
    `seed` (what a single generator drawing one permutation per epoch gives, so runs keep their historical order)."""
    if not shuffle:
        return torch.arange(num_prompts)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epoch):
        torch.randperm(num_prompts, generator=gen)
    return torch.randperm(num_prompts, generator=gen)


class PromptRounds:
    """Endless rounds of `per_round` prompt indices; round r is a pure function of (seed, r) (module docstring)."""

    def __init__(self, num_prompts: int, per_round: int, seed: int, shuffle: bool, start: int = 0):
        """Args:
            num_prompts: rows in the training dataset.
            per_round: P, prompts per generation round.
            seed: `train.seed`.
            shuffle: `train.shuffle_dataset`.
            start: rounds already consumed (a checkpoint's data position).
        """
        if per_round > num_prompts:
            raise ValueError(f"a round needs {per_round} prompts but the dataset has {num_prompts}")
        self.num_prompts, self.per_round, self.seed, self.shuffle = num_prompts, per_round, seed, shuffle
        self.rounds_per_epoch = num_prompts // per_round
        self.position = start
        self._epoch, self._order = None, None

    def round(self, index: int) -> list[int]:
        """The prompt indices of round `index`."""
        epoch, offset = divmod(index, self.rounds_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, epoch_order(self.num_prompts, self.seed, epoch, self.shuffle)
        return self._order[offset * self.per_round : (offset + 1) * self.per_round].tolist()

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        indices = self.round(self.position)
        self.position += 1
        return indices


def sampling_seeds(seed: int, step: int, attempt: int, prompt_indices: list[int]) -> list[int]:
    """One vLLM sampling seed per prompt of a round: the round is named by the optimizer step it starts at and the
    attempt within that step (dynamic sampling draws several rounds per step), the prompt by its dataset index.
    vLLM's seeds are 64-bit signed: 63-bit values."""
    return [derive_seed(seed, "sample", step, attempt, int(i)) for i in prompt_indices]


def shuffle_order(num_rows: int, seed: int, step: int) -> torch.Tensor:
    """(num_rows,) the seeded permutation of a round's rows, for the round that starts at optimizer step `step`."""
    return torch.randperm(num_rows, generator=torch.Generator().manual_seed(derive_seed(seed, "shuffle", step)))
