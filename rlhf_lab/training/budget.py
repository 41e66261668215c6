"""``trainer.max_train_seconds``: a wall-clock budget for training, so arms can be given equal time.

The clock adds up the wall time of the training steps (each ``train_step``: sampling or collating, scoring,
the update) over every segment of a run: it is saved with each checkpoint (``train_seconds`` in
``trainer_state.json``) and restored on resume, so a resumed run continues the same budget (or a larger one:
the key may change on resume). Start-up, evaluation and checkpoint writing do not count.

After each step the run stops once the clock has reached the budget, so the step during which it was
reached is the last; the run then ends as one that ran all ``trainer.steps`` does (final evaluation, final
checkpoint, ``summary.json``), which records ``stopped_by``. Under N processes rank 0's clock decides and
every rank reads it, so all ranks stop after the same step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import say

STOPPED_BY_STEPS = "steps"  # every configured step ran
STOPPED_BY_BUDGET = "max_train_seconds"


def rank_zero_value(value: float, device: torch.device | str = "cpu") -> float:
    """Rank 0's ``value`` on every rank: a broadcast as a sum to which only rank 0 contributes (one
    :func:`rlhf_lab.runtime.distributed.all_reduce_sum`; ``value`` itself in one process)."""
    if distributed.world_size() == 1:
        return value
    local = torch.tensor([value if distributed.is_main_process() else 0.0], dtype=torch.float64, device=device)
    return float(distributed.all_reduce_sum(local)[0])


class TrainingClock:
    """Seconds spent in training steps so far (every segment of the run) against an optional budget."""

    def __init__(self, budget: float | None, seconds: float = 0.0) -> None:
        self.budget = budget
        self.seconds = seconds

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Add the block's wall time to the clock."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def reached(self, device: torch.device | str = "cpu") -> bool:
        """Whether the budget is spent. Every rank takes rank 0's clock first, so all decide alike (no
        collective without a budget)."""
        if self.budget is None:
            return False
        self.seconds = rank_zero_value(self.seconds, device)
        return self.seconds >= self.budget

    def announce(self, step: int) -> None:
        """One line (rank 0) saying that the budget ends training after ``step``."""
        if distributed.is_main_process():
            say(
                f"trainer.max_train_seconds={self.budget:g} reached after step {step} ({self.seconds:.1f} s of "
                "training): finishing the run",
                __name__,
            )

    def state_dict(self) -> dict[str, float]:
        return {"train_seconds": self.seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's clock (0 for a checkpoint written before the clock was kept)."""
        self.seconds = float(state.get("train_seconds", 0.0))

    def summary(self, steps_done: int, steps: int) -> dict[str, Any]:
        """``summary.json``'s record of the end: why training stopped (``steps``: every one of ``steps`` ran;
        ``max_train_seconds``: the budget stopped it first) and the training time over every segment."""
        stopped_by = STOPPED_BY_STEPS if steps_done >= steps else STOPPED_BY_BUDGET
        return {"stopped_by": stopped_by, "time/train_s": self.seconds}
