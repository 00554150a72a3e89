"""A resumable batch sampler: deterministic shuffling from a seed, position (epoch, index) in checkpoints."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SamplerState:
    epoch: int = 0
    index: int = 0  # position inside this epoch's permutation


class ResumableSampler:
    """Yields batches of row indices. Epoch e uses the permutation drawn from (seed, e), so a run
    restored from `state()` continues with the next unseen prompt, across epoch boundaries too.
    The last incomplete batch of an epoch is dropped (every step has the same batch size)."""

    def __init__(self, num_rows: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 state: SamplerState | None = None):
        if batch_size > num_rows:
            raise ValueError(f"batch size {batch_size} is larger than the dataset ({num_rows} rows)")
        self.num_rows, self.batch_size, self.seed, self.shuffle = num_rows, batch_size, seed, shuffle
        self._state = dataclasses.replace(state) if state is not None else SamplerState()

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def next_batch(self) -> np.ndarray:
        s = self._state
        if s.index + self.batch_size > self.num_rows:
            s.epoch, s.index = s.epoch + 1, 0
        batch = self._order(s.epoch)[s.index:s.index + self.batch_size]
        s.index += self.batch_size
        return batch

    def state(self) -> dict[str, int]:
        return dataclasses.asdict(self._state)

    def load_state(self, state: dict[str, int]) -> None:
        self._state = SamplerState(int(state["epoch"]), int(state["index"]))
