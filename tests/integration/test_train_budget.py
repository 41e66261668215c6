"""``trainer.max_train_seconds`` on an online run (``model=tiny``, in-process): the budget ends training after
the step that spends it, the run then ends as usual, and a resume with a larger budget continues exactly.

The budget is 1e-9 s, which any step exceeds: every run here stops after its first step, whatever the
machine's speed, so nothing depends on timing (the SFT budget run is in test_offline_stages.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_lab.trackers.jsonl import read_jsonl
from rlhf_lab.training.launch import run

COMMON = ["algorithm=grpo", "trainer.steps=3", "trainer.lr=1e-3"]
WALL_TIME_KEYS = ("time/", "throughput/", "perf/")


def train(compose, tiny_overrides, out: Path, *overrides: str) -> dict:
    cfg = compose([*tiny_overrides(None), *COMMON, *overrides, f"trainer.output_dir={out}"])
    return run(cfg, out)


def step_lines(out: Path) -> list[dict]:
    """The training steps' metrics, wall-time keys left out."""
    return [
        {k: v for k, v in line.items() if not k.startswith(WALL_TIME_KEYS)}
        for line in read_jsonl(out / "metrics.jsonl")
        if "reward/mean" in line
    ]


def test_a_budget_stops_after_the_first_step_and_a_larger_one_resumes_exactly(compose, tiny_overrides, tmp_path):
    budget = tmp_path / "budget"
    summary = train(compose, tiny_overrides, budget, "trainer.max_train_seconds=1e-9")

    # Stopped after step 0 of 3; then the normal end: final evaluation, checkpoint, summary.
    assert [line["step"] for line in step_lines(budget)] == [0]
    assert summary["stopped_by"] == "max_train_seconds" and summary["steps"] == 1
    assert summary == json.loads((budget / "summary.json").read_text())
    assert summary["time/train_s"] >= 1e-9
    evaluations = [line for line in read_jsonl(budget / "metrics.jsonl") if "eval/reward/mean" in line]
    assert [line["step"] for line in evaluations] == [0, 1]  # before training, and after the last step done
    assert summary["eval/reward/mean"] == evaluations[-1]["eval/reward/mean"]
    assert sorted(p.name for p in (budget / "checkpoints").glob("step_*")) == ["step_1"]
    state = json.loads((budget / "checkpoints" / "step_1" / "trainer_state.json").read_text())
    assert state["step"] == 0 and state["train_seconds"] == summary["time/train_s"]

    # The same budget again: it is spent, so the resume trains no step and ends at once.
    again = train(compose, tiny_overrides, budget, "trainer.max_train_seconds=1e-9", "trainer.resume=auto")
    assert (again["stopped_by"], again["steps"]) == ("max_train_seconds", 1)
    assert [line["step"] for line in step_lines(budget)] == [0]

    # A larger budget (here none) continues the run: steps 1 and 2 as an uninterrupted run has them.
    resumed = train(compose, tiny_overrides, budget, "trainer.resume=auto")
    assert (resumed["stopped_by"], resumed["steps"]) == ("steps", 3)
    assert resumed["time/train_s"] > summary["time/train_s"]  # the clock continued from the checkpoint's
    full = tmp_path / "full"
    reference = train(compose, tiny_overrides, full)
    assert (reference["stopped_by"], reference["steps"]) == ("steps", 3)
    assert step_lines(budget) == step_lines(full)
