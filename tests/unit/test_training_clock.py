"""The clock of ``trainer.max_train_seconds`` (rlhf_lab/training/budget.py): what it counts, what it saves,
and that under torch.distributed rank 0's clock decides for every rank (two gloo processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_lab.training.budget import TrainingClock, rank_zero_value


def test_the_clock_adds_the_timed_blocks_and_stops_at_the_budget() -> None:
    clock = TrainingClock(budget=1e-9)
    assert not clock.reached()  # nothing timed yet
    with clock.timing():
        time.sleep(0.001)
    assert clock.seconds >= 0.001 and clock.reached()
    spent = clock.seconds
    with pytest.raises(RuntimeError), clock.timing():  # a failing step still counts
        raise RuntimeError
    assert clock.seconds > spent


def test_without_a_budget_the_clock_never_stops_a_run() -> None:
    assert not TrainingClock(budget=None, seconds=1e12).reached()


def test_the_clock_round_trips_through_a_checkpoint_state() -> None:
    restored = TrainingClock(budget=10.0)
    restored.load_state_dict({"step": 4, **TrainingClock(budget=5.0, seconds=7.25).state_dict()})
    assert restored.seconds == 7.25 and not restored.reached()
    restored.load_state_dict({"step": 4})  # a checkpoint from before the clock was kept
    assert restored.seconds == 0.0


def test_the_summary_names_what_ended_training() -> None:
    clock = TrainingClock(budget=2.0, seconds=2.5)
    summary = clock.summary(steps_done=3, steps=10)
    assert summary.keys() == {"stopped_by", "time/train_s", "time/total_s"}
    assert summary["stopped_by"] == "max_train_seconds" and summary["time/train_s"] == 2.5
    assert clock.summary(steps_done=10, steps=10)["stopped_by"] == "steps"


def test_the_wall_time_covers_the_training_time_and_continues_after_a_resume() -> None:
    clock = TrainingClock(budget=None)
    clock.start_segment()
    time.sleep(0.002)  # an evaluation: wall time, not training time
    with clock.timing():
        time.sleep(0.002)
    assert clock.total_seconds >= clock.seconds + 0.002
    restored = TrainingClock(budget=None)
    restored.load_state_dict({**clock.state_dict(), "total_seconds": 100.0})
    restored.start_segment()
    assert 100.0 <= restored.summary(1, 1)["time/total_s"] < 101.0
    restored.load_state_dict({"train_seconds": 7.0})  # a checkpoint from before the wall time was kept
    assert restored.total_seconds >= 7.0


def test_rank_zero_value_is_the_identity_in_one_process() -> None:
    assert rank_zero_value(3.5) == 3.5


def _decide(rank: int, store: str, results: str) -> None:
    """Each rank with its own clock; rank 0's seconds and decision must reach both ranks."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        decisions = []
        for clocks in ((5.0, 0.0), (0.0, 5.0)):  # only rank 0 over the 1 s budget, then only rank 1
            clock = TrainingClock(budget=1.0, seconds=clocks[rank])
            decisions.append([clock.reached(), clock.seconds])
        Path(results, f"{rank}.json").write_text(json.dumps(decisions))
    finally:
        dist.destroy_process_group()


def test_rank_zero_decides_for_every_rank(tmp_path) -> None:
    mp.spawn(_decide, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == [[True, 5.0], [False, 0.0]], rank
