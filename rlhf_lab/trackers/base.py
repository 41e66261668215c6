"""The tracker interface every destination of metrics implements, and ``logger=none`` (tracks nothing).

The run folder's JSON Lines files (:mod:`rlhf_lab.trackers.jsonl`) are always written; ``logger=`` adds
one external tracker (``wandb``) behind the same interface.
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

    def finish(self, summary: dict[str, Any]) -> None:
        """Record the final summary and close."""

    def close(self) -> None:
        """Release files or connections without a summary (a run that stopped early)."""


register("logger", "none")(Tracker)
