"""Wall time per phase of a step, shared by the RL step, the run and the offline stages; on a GPU, each phase's peak
memory too."""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch


def synchronize() -> None:
    """Wait for the GPU's queued work (nothing without CUDA in use): a wall-clock interval then covers the kernels
    its phase launched, not only their launch."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PeakMemory(Protocol):
    """A device allocator's peak: read it, and start it again from what is allocated now."""

    def peak(self) -> int: ...

    def reset(self) -> None: ...


class CudaPeak:
    """The CUDA caching allocator's peak of allocated bytes (``max_memory_allocated``) on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


class StepTimer:
    """Wall time per phase of a step (seconds): ``with timer.phase("generate"): ...`` adds to ``times``. On a GPU
    each phase synchronises at its start and end, so its time is its kernels' and not its neighbour's.

    With a ``memory`` (:class:`CudaPeak` on a GPU) the allocator's peak is reset at every phase boundary and read at
    the next: ``peaks`` holds each phase's own peak in bytes (a phase inside another counts in both), and
    :meth:`step_peak` the largest seen anywhere since the timer was made."""

    def __init__(self, memory: PeakMemory | None = None) -> None:
        self.times: dict[str, float] = {}
        self.memory = memory
        self.peaks: dict[str, int] = {}
        self._open: list[str] = []  # the phases entered and not yet left, outermost first
        self._seen = 0

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def step_peak(self) -> int:
        """The largest peak since the timer was made (0 without a ``memory``)."""
        if self.memory is not None:
            self._fold()
        return self._seen

    def _fold(self) -> None:
        """The peak since the last boundary into every open phase and the step's, then counted afresh."""
        peak = self.memory.peak()  # type: ignore[union-attr]
        self._seen = max(self._seen, peak)
        for name in self._open:
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
        self.memory.reset()  # type: ignore[union-attr]

    def _enter(self, name: str) -> None:
        if self.memory is not None:
            self._fold()
        self._open.append(name)

    def _leave(self) -> None:
        if self.memory is not None:
            self._fold()
        self._open.pop()


class _Phase:
    def __init__(self, timer: StepTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        synchronize()
        self.timer._enter(self.name)
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        synchronize()
        self.timer.times[self.name] = self.timer.times.get(self.name, 0.0) + time.perf_counter() - self.start
        self.timer._leave()
