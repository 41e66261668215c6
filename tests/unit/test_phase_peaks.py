"""Each phase's peak memory on a GPU (``perf/peak_memory_gib/<phase>``): the step's timer resets the allocator's
peak at every phase boundary and reads it at the next, a phase inside another counting in both; the step's peak is
the largest of them all. On a stand-in allocator that keeps torch.cuda's contract (``max_memory_allocated``: the
largest allocation since the last ``reset_peak_memory_stats``, which starts it from what is allocated then)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.training.perf import GIB, PLAN_PHASES, StepPerformance


class ScriptedAllocator:
    """Allocated bytes as the test sets them; the peak since the last reset."""

    def __init__(self, allocated: int = 0) -> None:
        self.allocated = self._peak = allocated
        self.resets = 0

    def set(self, allocated: int) -> None:
        self.allocated, self._peak = allocated, max(self._peak, allocated)

    def peak(self) -> int:
        return self._peak

    def reset(self) -> None:
        self._peak, self.resets = self.allocated, self.resets + 1


def scripted_step(timer: StepTimer, memory: ScriptedAllocator) -> None:
    memory.set(90)  # before any phase: counts for the step, for no phase
    memory.set(10)
    with timer.phase("generate"):
        memory.set(50)
        memory.set(20)
        with timer.phase("sync_check"):  # inside generate: its 70 is generate's too
            memory.set(70)
            memory.set(20)
        memory.set(15)
    with timer.phase("reference"):
        memory.set(40)
    with timer.phase("policy_forward_backward"):
        memory.set(100)
        memory.set(30)
    with timer.phase("optimizer"):
        memory.set(60)
    with timer.phase("policy_forward_backward"):  # a second epoch: the larger of the two
        memory.set(80)
    memory.set(5)


def test_each_phase_keeps_its_own_peak_and_the_step_the_largest() -> None:
    memory = ScriptedAllocator(10)
    timer = StepTimer(memory)
    scripted_step(timer, memory)
    assert timer.peaks == {"generate": 70, "sync_check": 70, "reference": 40, "policy_forward_backward": 100,
                           "optimizer": 60}
    assert timer.step_peak() == 100 and memory.resets == 13  # each of 6 phases' two boundaries, and the last read
    assert set(timer.times) == set(timer.peaks)


def test_the_step_peak_counts_what_no_phase_holds() -> None:
    memory = ScriptedAllocator(10)
    timer = StepTimer(memory)
    memory.set(200)  # e.g. the step's record, outside every phase
    memory.set(10)
    with timer.phase("generate"):
        memory.set(30)
    assert timer.peaks == {"generate": 30} and timer.step_peak() == 200


def test_the_perf_metrics_give_the_plans_phases(compose, tiny_overrides, tiny_tokenizer) -> None:
    from rlhf_lab.runtime.precision import Precision

    performance = StepPerformance(compose(tiny_overrides(None)), tiny_tokenizer, Precision("fp32", "cpu"),
                                  torch.device("cpu"))
    memory = ScriptedAllocator(10)
    timer = StepTimer(memory)
    scripted_step(timer, memory)
    values = performance.metrics(1.0, 10, 10, timer=timer)
    assert values["perf/peak_memory_gib"] == pytest.approx(100 / GIB)
    assert {key: value * GIB for key, value in values.items() if key.startswith("perf/peak_memory_gib/")} == \
        pytest.approx({"perf/peak_memory_gib/generation": 70, "perf/peak_memory_gib/scoring": 40,
                       "perf/peak_memory_gib/training": 100})
    assert set(PLAN_PHASES) == {"generation", "scoring", "training"}  # the plan's (rlhf_lab/planner/report.py)
    # On the CPU the step's timer keeps no peaks (the process's resident peak cannot be reset): no phase values.
    cpu_timer = performance.timer()
    assert cpu_timer.memory is None
    assert not any(key.startswith("perf/peak_memory_gib/") for key in performance.metrics(1.0, 10, 10, timer=cpu_timer))
