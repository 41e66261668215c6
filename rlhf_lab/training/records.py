"""What a run leaves behind: metrics and samples (JSONL always, plus the configured tracker), and the summary
(the per-phase step timer is :mod:`rlhf_lab.runtime.timer`).

Only rank 0 writes; metrics are averaged over ranks before they are written, so every destination sees the
same numbers. ``metrics.jsonl`` is the run's own record: the summary is computed from it, so a resumed run's
summary covers the steps before the resume too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.timer import StepTimer as StepTimer  # the run's names for them
from rlhf_lab.runtime.timer import synchronize as synchronize
from rlhf_lab.trackers.base import Tracker
from rlhf_lab.trackers.jsonl import JsonlTracker, read_jsonl

NONFINITE_STRINGS = {"nan", "inf", "-inf"}  # how run folders written before NaN tokens stored non-finite floats


def distinct_n(texts: list[str], n: int = 2) -> float:
    """Distinct-n (Li et al. 2016): unique word n-grams / all word n-grams over the texts."""
    grams = [tuple(words[i : i + n]) for words in (t.split() for t in texts) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def run_summary(history: list[dict[str, Any]], steps: int, run_dir: Path, skipped_updates: int,
                first_eval: dict[str, Any] | None, final_eval: dict[str, Any],
                curve: tuple[str, str] = ("reward/mean", "reward")) -> dict[str, Any]:
    """``summary.json``: the step metric ``curve[0]`` over the first and last 20% of steps (as ``curve[1]/…``;
    the offline stages summarise ``loss/total``), final exact KL when logged, the median step time, and the
    evaluations (the run's clock adds ``time/train_s`` and ``time/total_s``: :mod:`.budget`)."""
    key, name = curve
    summary: dict[str, Any] = {"steps": steps, "run_dir": str(run_dir)}
    if history:
        values = [m[key] for m in history]
        fifth = max(1, len(values) // 5)
        summary.update({
            f"{name}/first_20pct_mean": float(np.mean(values[:fifth])),
            f"{name}/last_20pct_mean": float(np.mean(values[-fifth:])),
            f"{name}/final": values[-1],
        })
        if "kl/exact" in history[-1]:
            summary["kl/exact_final"] = history[-1]["kl/exact"]
        exact = [m for m in history if "exact/gap" in m]  # the exact task: its last measured distance to J*
        if exact:
            summary["exact/gap"] = exact[-1]["exact/gap"]
        summary.update({
            "time/step_s_median": float(np.median([m["time/step_s"] for m in history])),
            "optim/skipped_updates": skipped_updates,
        })
    if first_eval:
        summary.update({f"before/{k}": v for k, v in first_eval.items()})
    summary.update(final_eval)
    return summary


def sample_columns(rollout: Any, index: int) -> dict[str, float]:
    """A logged sample's extra columns: its response length in tokens (model tokens), its KL to the reference
    summed over them (the exact KL where the step computes it, else the configured estimate), its mean advantage
    over them, and the per-sample reward terms the rollout carries (reward components, penalties)."""
    mask = rollout.response_mask[index]
    tokens = float(mask.sum())
    columns: dict[str, float] = {"length": int(tokens)}
    per_token = rollout.kl_exact if getattr(rollout, "kl_exact", None) is not None else rollout.kl_estimate
    if per_token is not None:
        columns["kl"] = float((per_token[index] * mask).sum())
    advantages = getattr(rollout, "advantages", None)
    if advantages is not None:
        columns["advantage"] = float((advantages[index] * mask).sum()) / tokens if tokens else 0.0
    for key, values in getattr(rollout, "extras", {}).items():
        if values.dim() == 1:
            columns[key] = float(values[index])
    return columns


class Records:
    """The run folder's files and the external tracker, written by rank 0 only.

    ``samples_every``: steps between sample tables sent to the tracker (samples.jsonl gets every step's).
    """

    def __init__(self, run_dir: Path, tracker: Tracker, samples_every: int) -> None:
        self.run_dir = Path(run_dir)
        self.tracker = tracker
        self.samples_every = samples_every
        self.main = distributed.is_main_process()
        self.local = JsonlTracker(self.run_dir) if self.main else None

    def log(self, metrics: dict[str, Any], step: int) -> dict[str, Any]:
        """Average ``metrics`` over ranks and write them everywhere; returns what was written."""
        metrics = distributed.mean_across_ranks(metrics)
        if self.local is not None:
            self.local.log(metrics, step)
            self.tracker.log(metrics, step)
        return metrics

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if self.local is None:
            return
        self.local.log_samples(rows, step)
        if self.samples_every > 0 and step % self.samples_every == 0:
            self.tracker.log_samples(rows, step)

    def log_eval_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """An evaluation's samples, to the trackers' evaluation table (not samples.jsonl: training's)."""
        if self.local is not None and rows:
            self.tracker.log_eval_samples(rows, step)

    def history(self) -> list[dict[str, Any]]:
        """Every training step's metrics in this run folder, from before a resume too (floats restored)."""
        path = self.run_dir / "metrics.jsonl"
        records = read_jsonl(path) if path.is_file() else []
        return [
            {k: float(v) if isinstance(v, str) and v in NONFINITE_STRINGS else v for k, v in record.items()}
            for record in records if "reward/mean" in record
        ]

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json`` now (before the final checkpoint: a save that fails loses no result)."""
        if self.local is not None:
            self.local.finish(summary)

    def finish(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json`` and close the tracker's run."""
        if self.local is not None:
            self.local.finish(summary)
            self.tracker.finish(summary)

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
