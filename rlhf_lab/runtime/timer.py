"""Wall time per phase of a step, shared by the RL step, the run and the offline stages."""

from __future__ import annotations

import time
from typing import Any

import torch


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing without CUDA in use): a wall-clock interval then covers the kernels
    its phase launched, not only their launch."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepTimer:
    """Wall time per phase of a step (seconds): ``with timer.phase("generate"): ...`` adds to ``times``. On a GPU
    each phase synchronises at its start and end, so its time is its kernels' and not its neighbour's."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)


class _Phase:
    def __init__(self, timer: StepTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        synchronize()
        self.timer.times[self.name] = self.timer.times.get(self.name, 0.0) + time.perf_counter() - self.start
