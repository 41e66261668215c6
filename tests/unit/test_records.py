"""records: step timer, distinct-n, the summary, and the run folder's files written through one interface."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlhf_lab.trackers.base import Tracker
from rlhf_lab.training.records import Records, StepTimer, distinct_n, run_summary


class ListTracker(Tracker):
    """Keeps what it is given, to check what reaches the external tracker."""

    def __init__(self) -> None:
        self.logged, self.samples, self.summary = [], [], None

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def log_samples(self, rows, step):
        self.samples.append((step, rows))

    def finish(self, summary):
        self.summary = summary


def test_step_timer_adds_up_repeated_phases(monkeypatch) -> None:
    clock = iter([0.0, 1.5, 10.0, 10.25, 20.0, 23.0])
    monkeypatch.setattr("rlhf_lab.runtime.timer.time.perf_counter", lambda: next(clock))
    timer = StepTimer()
    with timer.phase("generate"):
        pass
    with timer.phase("generate"):
        pass
    with timer.phase("reward"):
        pass
    assert timer.times == {"generate": 1.75, "reward": 3.0}


def test_distinct_2_counts_unique_bigrams() -> None:
    # Bigrams: (a b) (b a) (a b) | (c d): 4 in all, 3 distinct.
    assert distinct_n(["a b a b", "c d"], 2) == pytest.approx(3 / 4)
    assert distinct_n(["one", ""], 2) == 0.0


def test_run_summary_from_hand_made_history() -> None:
    history = [{"reward/mean": float(r), "kl/exact": 0.1 * r, "time/step_s": 2.0 + r} for r in range(10)]
    summary = run_summary(history, 10, Path("/run"), 1, {"eval/reward/mean": 0.5}, {"eval/reward/mean": 0.9})
    # First and last 20% of 10 steps: steps 0-1 (mean 0.5) and 8-9 (mean 8.5); median of 2..11 is 6.5.
    assert summary["reward/first_20pct_mean"] == 0.5
    assert summary["reward/last_20pct_mean"] == 8.5
    assert summary["reward/final"] == 9.0
    assert summary["kl/exact_final"] == pytest.approx(0.9)
    assert summary["time/step_s_median"] == 6.5
    assert summary["optim/skipped_updates"] == 1
    assert summary["before/eval/reward/mean"] == 0.5
    assert summary["eval/reward/mean"] == 0.9
    assert run_summary([], 3, Path("/run"), 0, None, {}) == {"steps": 3, "run_dir": "/run"}


def test_records_write_files_and_tracker_and_read_history_back(tmp_path: Path) -> None:
    tracker = ListTracker()
    records = Records(tmp_path, tracker, samples_every=2)
    records.log({"step": 0, "eval/reward/mean": 0.1}, 0)
    records.log({"step": 0, "reward/mean": float("nan"), "kl/exact": 0.0}, 0)
    records.log({"step": 1, "reward/mean": 0.5, "kl/exact": 0.2}, 1)
    rows = [{"step": 1, "prompt": "p", "response": "r", "reward": float("nan"), "length": torch.tensor(3)}]
    records.log_samples(rows, 1)  # step 1: samples.jsonl only (tracker every 2 steps)
    records.log_samples(rows, 2)
    records.finish({"steps": 2})
    records.close()

    text = (tmp_path / "metrics.jsonl").read_text()
    assert '"reward/mean": NaN' in text  # the NaN token (a float to json, pandas and datasets), not a string ...
    lines = [json.loads(line) for line in text.splitlines()]
    assert math.isnan(lines[1]["reward/mean"])
    history = records.history()  # ... a float in the history; the eval-only line is not a training step
    assert [h["step"] for h in history] == [0, 1]
    assert history[0]["reward/mean"] != history[0]["reward/mean"]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and math.isnan(samples[0]["reward"]) and samples[0]["length"] == 3
    history_before = (tmp_path / "metrics.jsonl").read_text().replace("NaN", '"nan"')  # a folder written before
    (tmp_path / "metrics.jsonl").write_text(history_before)
    assert math.isnan(records.history()[0]["reward/mean"])
    assert [step for step, _ in tracker.samples] == [2]
    assert [step for step, _ in tracker.logged] == [0, 0, 1]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 2}
    assert tracker.summary == {"steps": 2}
