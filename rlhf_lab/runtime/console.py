"""What a run tells its user: Python ``logging`` inside a Hydra job (so the job's ``<name>.log`` holds it, as well
as the console), plain ``print`` elsewhere (a notebook, a test, ``rlhf_lab.train`` without a logging setup)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _in_hydra_job() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.initialized()
    except Exception:  # Hydra missing or not running
        return False


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # every control character but the newline and the tab


def printable(text: str) -> str:
    """``text`` with its control characters written out (``ESC`` as ``\\x1b``): a model's or an environment's text
    cannot move the cursor, clear the screen, retitle the terminal or rewrite an earlier line."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def say(message: str, logger: str = "rlhf_lab", level: int = logging.INFO) -> None:
    """One message for the user (its control characters written out: :func:`printable`)."""
    message = printable(message)
    if _in_hydra_job():
        logging.getLogger(logger).log(level, message)
    else:
        print(message, flush=True)


def progress_label() -> str:
    """The progress bar's name: ``train``, or in a multirun the job's number and label (``train job 3 k3,seed=1``),
    so the bars of jobs that run side by side (joblib, Ray) tell which is which."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return "train"
        from pathlib import Path

        folder = Path(str(HydraConfig.get().runtime.output_dir)).name  # <num>_<label> (rlhf_lab/app/job_folders.py)
        return f"train job {folder.replace('_', ' ', 1)}"
    except Exception:  # Hydra missing or its config incomplete: the plain name
        return "train"


def progress_bar(steps: range, enabled: bool, initial: int, total: int) -> Any:
    """``steps`` with a tqdm bar labelled by :func:`progress_label` (``trainer.progress_bar``), or without one a line
    at each tenth of the run's steps (:func:`progress_lines`: a sweep's job logs how far it is)."""
    if not enabled:
        return progress_lines(steps, initial, total)
    from tqdm.auto import tqdm

    return tqdm(steps, initial=initial, total=total, desc=progress_label(), dynamic_ncols=True)


PROGRESS_MIN_STEPS = 20


def progress_lines(steps: range, initial: int, total: int) -> Iterator[int]:
    """``steps``, and once each tenth of the ``total`` steps is done (from ``initial``, a resume's first step) a
    line: ``train job 3 seed=1: step 40/400 (10%), about 2 min 15 s left`` (this segment's pace so far). A run of
    fewer than ``PROGRESS_MIN_STEPS`` steps says nothing: it ends before a line would help."""
    import time

    if total < PROGRESS_MIN_STEPS:
        yield from steps
        return
    start, shown = time.perf_counter(), initial * 10 // max(total, 1)
    for step in steps:
        yield step
        done = step + 1
        tenth = done * 10 // max(total, 1)
        if tenth > shown and done < total and os.environ.get("RANK", "0") == "0":  # rank 0 speaks for the run
            shown = tenth
            left = (time.perf_counter() - start) / (done - initial) * (total - done)
            say(f"{progress_label()}: step {done}/{total} ({100 * done // total}%), about {format_duration(left)} left")


def format_duration(seconds: float) -> str:
    """``4 min 10 s`` or ``12 s``."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


@contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """The libraries' own bars (transformers': loading and writing weight shards; datasets': "Generating train split",
    "Map") on or off for the run (``trainer.library_progress_bars``, off by default: the run's own bar and lines say
    what happens), and as they were after it."""
    from datasets.utils import logging as datasets_logging
    from transformers.utils import logging as transformers_logging

    was = (transformers_logging.is_progress_bar_enabled(), datasets_logging.is_progress_bar_enabled())
    if not enabled:
        transformers_logging.disable_progress_bar()
        datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            transformers_logging.enable_progress_bar()
        if was[1]:
            datasets_logging.enable_progress_bar()


FINAL_KEYS = (("reward/first_20pct_mean", "reward, first 20% of steps"), ("reward/last_20pct_mean", "last 20%"),
              ("eval/reward/mean", "eval reward"), ("kl/exact_final", "exact KL"), ("exact/gap", "exact gap"),
              ("time/train_s", "training seconds"))


def final_lines(summary: dict[str, Any], run_dir: Path) -> str:
    """What a run says when it ends: where everything is and what it takes on disk, and the numbers a user looks at
    first."""
    parts = [f"{label} {summary[key]:.4g}" for key, label in FINAL_KEYS if isinstance(summary.get(key), int | float)]
    return (f"run folder: {run_dir} ({on_disk(run_dir)})\n"
            + (", ".join(parts) if parts else "no step metrics (no step ran)"))


def on_disk(run_dir: Path) -> str:
    """The run folder's size, and its optimizer state's share where it is a tenth or more (what ``trainer.save=model``
    leaves out)."""
    total = optimizer = 0
    for folder, _, files in os.walk(run_dir):  # symbolic links are not followed, nor counted
        for name in files:
            path = Path(folder) / name
            if path.is_symlink() or not path.is_file():
                continue
            size = path.stat().st_size
            total += size
            optimizer += size if name == "optimizer.safetensors" else 0  # (FSDP's sharded/ holds both together)
    said = f"{_size(total)} on disk"
    if optimizer and optimizer >= total // 10:
        said += f", {_size(optimizer)} of it optimizer state: trainer.save=model keeps the model only"
    return said


def _size(count: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} B"
