"""CSV tracker (``logger=csv``): ``metrics.csv`` in the run folder, one row per logged step, a column per metric.

A step that brings a new metric (evaluation keys) rewrites the file with the wider header; otherwise rows
are appended. A resumed run drops the rows from the resume step on before appending, as ``metrics.jsonl`` does.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from rlhf_lab.registry import register
from rlhf_lab.runtime.files import open_in_folder
from rlhf_lab.trackers.base import Tracker


def _cell(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def keep_damaged(path: Path) -> Path | None:
    """A ``metrics.csv`` that is not UTF-8 text is copied aside, byte for byte, before the resumed run rewrites it
    (its damaged bytes as U+FFFD), with a warning line naming the copy; returns the copy."""
    try:
        path.read_bytes().decode("utf-8")
        return None
    except UnicodeDecodeError as error:
        copies = (path.with_name(f"{path.name}.damaged" + (f".{n}" if n else "")) for n in range(1000))
        damaged = next(copy for copy in copies if not copy.exists())
        shutil.copyfile(path, damaged)
        print(f"warning: {path} is not UTF-8 text (byte {error.start}); kept as {damaged.name}, and the resumed "
              "run rewrites it with the damaged bytes replaced", file=sys.stderr, flush=True)
        return damaged


@register("logger", "csv")
class CsvTracker(Tracker):
    def __init__(self, logger_cfg: Any, config: dict[str, Any], run_dir: Path, resuming: bool = False) -> None:
        super().__init__(logger_cfg, config, run_dir)
        self.path = Path(run_dir) / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        self._trim_from: bool = resuming and self.path.is_file()
        if self._trim_from:
            keep_damaged(self.path)
            with open(self.path, newline="", encoding="utf-8", errors="replace") as handle:  # damaged bytes kept out
                reader = csv.DictReader(handle)
                self.columns = list(reader.fieldnames or ["step"])
                self.rows = list(reader)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._trim_from:  # the first step after a resume: forget the rows it replaces
            self._trim_from = False
            self.rows = [row for row in self.rows if str(row.get("step", "")).lstrip("-").isdigit()
                         and int(row["step"]) < step]
            self._rewrite()
        row = {"step": step, **{key: _cell(value) for key, value in metrics.items() if key != "step"}}
        self.rows.append(row)
        new = [key for key in row if key not in self.columns]
        if new or not self.path.is_file():
            self.columns += new
            self._rewrite()
            return
        with open_in_folder(self.path, "a", newline="") as handle:
            csv.DictWriter(handle, self.columns).writerow(row)

    def _rewrite(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open_in_folder(tmp, "w", newline="") as handle:
            writer = csv.DictWriter(handle, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.path)
