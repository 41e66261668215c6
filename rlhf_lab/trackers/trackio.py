"""Trackio tracker (``logger=trackio``; optional extra: ``pip install -r requirements-trackio.txt``): the
local-first tracker TRL and verl log to, with W&B's calls.

Store: trackio's own, ``$TRACKIO_DIR`` (else ``$HF_HOME/trackio``), one SQLite database per project, read when the
package is imported (view with ``trackio show``). Project: ``logger.trackio_project`` or ``experiment_name``. Run:
the run folder's parent and name (``multirun_2026-11-29_14-37-42/12``), kept in ``<run folder>/trackio_run.json``, so
a resumed run (``trainer.resume``) continues the same trackio run. Logged: the resolved config, every finite
numeric metric per step, sample tables as ``trackio.Table`` (``samples``, ``eval_samples``, as W&B's). Nothing
leaves the machine: no Space or dataset is named.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rlhf_lab.registry import register
from rlhf_lab.trackers.base import Tracker

ID_FILE = "trackio_run.json"


@register("logger", "trackio")
class TrackioTracker(Tracker):
    def __init__(self, logger_cfg: Any, config: dict[str, Any], run_dir: Path, resuming: bool = False) -> None:
        super().__init__(logger_cfg, config, run_dir)
        import trackio

        self.trackio, self.run_dir = trackio, Path(run_dir)
        id_file = self.run_dir / ID_FILE
        stored = json.loads(id_file.read_text()) if resuming and id_file.is_file() else {}
        project = logger_cfg.get("trackio_project") or str(config.get("experiment_name") or "rlhf_lab")
        resolved = self.run_dir.resolve()
        name = stored.get("name") if stored.get("project") == project else None
        self.run = trackio.init(project=project, name=name or f"{resolved.parent.name}/{resolved.name}",
                                group=logger_cfg.get("group"), config=config, resume="allow" if name else "never",
                                embed=False, auto_log_cpu=False, auto_log_gpu=False)
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(json.dumps({"project": project, "name": self.run.name}))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        numbers = {}
        for key, value in metrics.items():
            value = value.item() if hasattr(value, "item") else value
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                numbers[key] = value
        if numbers:
            self.run.log(numbers, step=step)

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        return self.trackio.Table(columns=columns, data=[[row.get(key) for key in columns] for row in rows])

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if rows:
            self.run.log({"samples": self._table(rows)}, step=step)

    def log_eval_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        if rows:
            self.run.log({"eval_samples": self._table(rows)}, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.finish()

    def close(self) -> None:
        self.run.finish()
