"""Local JSON Lines tracking, always on: ``metrics.jsonl``, ``samples.jsonl`` and ``summary.json`` in the run folder.

``metrics.jsonl`` gets one JSON object per step, appended and flushed line by line, so a killed run
loses at most the line being written; :func:`repair_jsonl` drops a torn last line and lines past a
resume point. :class:`JsonlTracker` puts these files behind the :class:`~rlhf_lab.trackers.base.Tracker`
interface that W&B implements too.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from rlhf_lab.errors import RunFolderError
from rlhf_lab.trackers.base import Tracker


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


def open_in_folder(path: Path, mode: str, newline: str | None = None) -> Any:
    """``open(path, mode)`` for a run folder's own file (``a`` or ``w``, text), never through a symbolic link: a
    link planted in a run folder (dangling or not) would make the run create or truncate a file outside it.
    A link is a one-line :class:`~rlhf_lab.errors.RunFolderError`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    try:
        descriptor = os.open(path, flags, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise RunFolderError(f"{str(path)!r} is a symbolic link; a run folder's files are never written through "
                                 "one (remove it, or choose another trainer.output_dir)") from None
        if error.errno == errno.ENXIO:  # a named pipe nobody reads: opened without waiting for one
            raise not_regular(path) from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise not_regular(path)
    return os.fdopen(descriptor, mode, encoding="utf-8", newline=newline)


def not_regular(path: Path) -> RunFolderError:
    return RunFolderError(f"{str(path)!r} is not a regular file (a named pipe or a device); a run folder's files "
                          "are only regular files (remove it, or choose another trainer.output_dir)")


class JsonlWriter:
    """Append-only JSON Lines file, flushed after every line."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_in_folder(self.path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
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


def write_json_atomic(path: Path, payload: Any, lines: list[dict[str, Any]] | None = None) -> None:
    """Write a JSON file (or JSON Lines when ``lines`` is given) via a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open_in_folder(tmp, "w") as handle:
        if lines is None:
            json.dump(payload, handle, indent=2, default=_jsonable)
        else:
            for record in lines:
                handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


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
        write_json_atomic(self.run_dir / "summary.json", summary)

    def close(self) -> None:
        self.metrics_file.close()
        self.samples_file.close()
