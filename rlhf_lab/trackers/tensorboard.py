"""TensorBoard tracker (``logger=tensorboard``): torch's ``SummaryWriter`` into ``<run folder>/tensorboard/``.

Every numeric metric is a scalar at its step (``reward/mean``, ``eval/reward/mean``, ...); sample tables are text
(a Markdown table per logged step, ``samples`` and ``eval_samples``); the summary is text at the end. A resumed
run purges the events from the resume step on, so curves continue without a fold.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlhf_lab.registry import register
from rlhf_lab.trackers.base import Tracker


def markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(column, "")) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


@register("logger", "tensorboard")
class TensorboardTracker(Tracker):
    def __init__(self, logger_cfg: Any, config: dict[str, Any], run_dir: Path, resuming: bool = False) -> None:
        super().__init__(logger_cfg, config, run_dir)
        self.log_dir = Path(run_dir) / "tensorboard"
        self.resuming = resuming
        self.writer: Any = None
        self._config_text = "```\n" + json.dumps(config, indent=1, default=str)[:60_000] + "\n```"

    def _writer(self, step: int) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=step if self.resuming else None)
            if not self.resuming:
                self.writer.add_text("config", self._config_text, 0)
        return self.writer

    def log(self, metrics: dict[str, Any], step: int) -> None:
        writer = self._writer(step)
        for key, value in metrics.items():
            if key == "step":
                continue
            if hasattr(value, "item"):
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            writer.add_scalar(key, value, step)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if rows:
            self._writer(step).add_text("samples", markdown_table(rows), step)

    def log_eval_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if rows:
            self._writer(step).add_text("eval_samples", markdown_table(rows), step)

    def finish(self, summary: dict[str, Any]) -> None:
        writer = self._writer(int(summary.get("steps", 0)))
        writer.add_text("summary", markdown_table([{"key": k, "value": v} for k, v in summary.items()]),
                        int(summary.get("steps", 0)))
        self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
