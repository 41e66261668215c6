"""Local JSON Lines tracking, always on: ``metrics.jsonl``, ``samples.jsonl`` and ``summary.json`` in the run folder.

``metrics.jsonl`` gets one JSON object per step, appended and flushed line by line, so a killed run
loses at most the line being written; :func:`repair_jsonl` drops a torn last line and lines past a
resume point. :class:`JsonlTracker` puts these files behind the :class:`~rlhf_lab.trackers.base.Tracker`
interface that W&B implements too.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from rlhf_lab.runtime.files import jsonable, not_regular, write_json_atomic
from rlhf_lab.runtime.files import open_in_folder as open_in_folder  # the CSV tracker's, too
from rlhf_lab.trackers.base import Tracker

SUMMARY_FILE = "summary.json"  # a finished run's (written last): a new run never replaces it (training/checkpoint_find.py)


class JsonlWriter:
    """Append-only JSON Lines file, flushed after every line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_in_folder(self.path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a JSON Lines file (a torn last line, or one that is not UTF-8, is skipped)."""
    records = []
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a named pipe is refused below, never waited on
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise not_regular(Path(path))
        for line in handle:
            try:
                records.append(json.loads(line.decode("utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
    return records


def repair_jsonl(path: Path, before_step: int) -> None:
    """Keep only complete records with ``step < before_step`` (resume appends from there)."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if r.get("step", -1) < before_step]
    write_json_atomic(path, None, lines=kept)


class JsonlTracker(Tracker):
    """The run folder's own record: metrics and samples appended line by line, the summary written atomically."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.metrics_file = JsonlWriter(self.run_dir / "metrics.jsonl")
        self.samples_file = JsonlWriter(self.run_dir / "samples.jsonl")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.metrics_file.write(metrics)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        for row in rows:
            self.samples_file.write(row)

    def finish(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.run_dir / SUMMARY_FILE, summary)

    def close(self) -> None:
        self.metrics_file.close()
        self.samples_file.close()
