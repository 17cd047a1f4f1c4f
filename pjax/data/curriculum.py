"""`data.curriculum`: a sequence-length curriculum. "64x100,128x200" trains steps 1-100 on windows of 64 tokens,
101-300 on 128, then `train.seq_len`. A short step cuts each of the full step's windows into seq_len/L windows
of L tokens, so every step predicts the same tokens, in the same order, as without a curriculum: the data
position (and so a resume, across a length change too) is the plain run's. Each length is one compiled step,
all compiled before the first (ARCHITECTURE.md, "A sequence-length curriculum")."""
from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from mesh.errors import ConfigError
from pjax.config import TrainConfig
from pjax.validate import Run, validate_run

FORMAT = 'a comma-separated list of LENGTHxSTEPS stages, e.g. "64x100,128x200"'


def parse_stages(text: str) -> tuple[tuple[int, int], ...]:
    """'64x100,128x200' -> ((64, 100), (128, 300)): each stage's length and last step, lengths increasing."""
    try:
        stages = [tuple(int(part) for part in stage.split("x")) for stage in text.split(",")]
    except ValueError:
        stages = []
    if not stages or any(len(stage) != 2 or min(stage) < 1 for stage in stages):
        raise ConfigError(f"data.curriculum={text!r} is invalid; write {FORMAT}, lengths and steps positive "
                          f"(docs/outer_loops.md#sequence-length-curriculum).")
    for (length, _), (longer, _) in zip(stages, stages[1:]):
        if longer <= length:
            raise ConfigError(f"data.curriculum={text!r} is invalid; the stages' lengths must increase "
                              f"({length} is followed by {longer}).")
    last_steps = np.cumsum([steps for _, steps in stages])
    return tuple((length, int(last)) for (length, _), last in zip(stages, last_steps))


@dataclasses.dataclass(frozen=True)
class Curriculum:
    """The sequence length of every step: `stages` (length, last step), then `seq_len`."""

    stages: tuple[tuple[int, int], ...]
    seq_len: int

    @classmethod
    def of(cls, text: str | None, seq_len: int) -> "Curriculum | None":
        """The curriculum `data.curriculum` names (None for none), each length dividing `train.seq_len`."""
        if not text:
            return None
        stages = parse_stages(text)
        for length, _ in stages:
            if length >= seq_len or seq_len % length:
                raise ConfigError(f"data.curriculum length {length} does not divide train.seq_len={seq_len} into "
                                  f"two or more windows; use lengths like {seq_len // 4} or {seq_len // 2}.")
        return cls(stages, seq_len)

    @classmethod
    def for_run(cls, text: str | None, run: Run) -> "Curriculum | None":
        """`of`, checked against the run's layout (`check`)."""
        curriculum = cls.of(text, run.train.seq_len)
        if curriculum is not None:
            curriculum.check(run)
        return curriculum

    def describe(self) -> str:
        """'16 tokens for steps 1-2, 32 for 3-4, then 64'."""
        firsts = [1, *(last + 1 for _, last in self.stages)]
        parts = [f"{length} for {first}-{last}" for (length, last), first in zip(self.stages, firsts)]
        return f"{parts[0].replace(' for ', ' tokens for steps ')}, {', '.join(parts[1:] + [f'then {self.seq_len}'])}"

    def length(self, index: int) -> int:
        """The sequence length of the batch with 0-based index `index` (that of step index + 1)."""
        return next((length for length, last in self.stages if index < last), self.seq_len)

    @property
    def lengths(self) -> tuple[int, ...]:
        """Every length the run trains on, shortest first, `seq_len` last."""
        return (*(length for length, _ in self.stages), self.seq_len)

    def split(self, ids: np.ndarray, length: int) -> np.ndarray:
        """Full-length window ids [..., rows] -> the ids [..., rows * k] of their k = seq_len / length windows of
        `length` tokens: window i's tokens i*seq_len .. +seq_len are windows i*k .. i*k+k-1 of `length`."""
        k = self.seq_len // length
        ids = np.asarray(ids)
        return (ids[..., None] * k + np.arange(k)).reshape(*ids.shape[:-1], ids.shape[-1] * k)

    def train_configs(self, tc: TrainConfig) -> Iterator[tuple[int, TrainConfig]]:
        """(length, the train config of a step at that length: rows times k, the same tokens) per short length."""
        for length, _ in self.stages:
            k = self.seq_len // length
            yield length, dataclasses.replace(tc, seq_len=length, batch_size=tc.batch_size * k)

    def check(self, run: Run) -> None:
        """A one-line ConfigError unless every length splits over the run's layout as `train.seq_len` does."""
        for length, tc in self.train_configs(run.train):
            try:
                validate_run(run.mesh, run.model, tc, run.pipeline, run.context, run.precision)
            except ConfigError as e:
                raise ConfigError(f"data.curriculum length {length} ({tc.batch_size} rows of {length} tokens) does "
                                  f"not fit this layout: {e}") from None

