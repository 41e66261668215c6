"""The tracker interface every destination of metrics implements, and ``logger=none`` (tracks nothing).

The run folder's JSON Lines files (:mod:`rlhf_lab.trackers.jsonl`) are always written; ``logger=`` adds
external trackers (``wandb``, ``tensorboard``, ``mlflow``, ``csv``, or a list of them: :mod:`.multi`) behind
the same interface.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_lab.registry import register


class Tracker:
    """An external experiment tracker; the base class tracks nothing (``logger=none``)."""

    def __init__(self, logger_cfg: Any, config: dict[str, Any], run_dir: Path) -> None:
        self.logger_cfg = logger_cfg

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record one step's metrics."""

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """Record generation samples (prompt, response, reward)."""

    def log_eval_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """Record an evaluation's samples (prompt, response, rewards), apart from the training samples."""

    def finish(self, summary: dict[str, Any]) -> None:
        """Record the final summary and close."""

    def close(self) -> None:
        """Release files or connections without a summary (a run that stopped early)."""


register("logger", "none")(Tracker)
