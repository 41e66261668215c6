"""``trainer.max_train_seconds``: a wall-clock budget for training, so arms can be given equal time.

The clock adds up the wall time of the training steps (each ``train_step``: sampling or collating, scoring,
the update) over every segment of a run: it is saved with each checkpoint (``train_seconds`` in
``trainer_state.json``) and restored on resume, so a resumed run continues the same budget (or a larger one:
the key may change on resume). Start-up, evaluation and checkpoint writing do not count.

After each step the run stops once the clock has reached the budget, so the step during which it was
reached is the last; the run then ends as one that ran all ``trainer.steps`` does (final evaluation, final
checkpoint, ``summary.json``), which records ``stopped_by``.

Beside it the clock keeps the run's wall time (``time/total_s``, saved as ``total_seconds``): every segment's
loop from its first evaluation to its summary, evaluations and checkpoint writing included (start-up not), so
``time/total_s >= time/train_s``. Under N processes rank 0's clock decides and
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
        self.earlier_total = 0.0  # wall seconds of the run's earlier segments
        self.segment_start = time.perf_counter()

    def start_segment(self) -> None:
        """This segment's wall time counts from now (the loop's start)."""
        self.segment_start = time.perf_counter()

    @property
    def total_seconds(self) -> float:
        """Wall seconds of every segment so far: the earlier ones' and this one's since :meth:`start_segment`."""
        return self.earlier_total + time.perf_counter() - self.segment_start

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
        return {"train_seconds": self.seconds, "total_seconds": self.total_seconds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's clock (0 for a checkpoint written before the clock was kept; its training seconds as the
        wall time for one written before the wall time was kept)."""
        self.seconds = float(state.get("train_seconds", 0.0))
        self.earlier_total = max(float(state.get("total_seconds", 0.0)), self.seconds)

    def summary(self, steps_done: int, steps: int) -> dict[str, Any]:
        """``summary.json``'s record of the end: why training stopped (``steps``: every one of ``steps`` ran;
        ``max_train_seconds``: the budget stopped it first), the training time and the wall time over every
        segment."""
        stopped_by = STOPPED_BY_STEPS if steps_done >= steps else STOPPED_BY_BUDGET
        return {"stopped_by": stopped_by, "time/train_s": self.seconds, "time/total_s": self.total_seconds}
