"""A sweep stopped by one signal and resumed by one command, and its progress as its jobs end (a Hydra callback,
``hydra.callbacks.sweep_watch`` in conf/config.yaml).

**Stopping.** A terminal's Ctrl-C reaches every process of its group; a scheduler or a wrapper (``kill -INT PID``,
SLURM's SIGTERM) reaches the sweep's own process alone. Either way the sweep stops the same way:

- the sweep's process (:class:`SweepWatch`) takes SIGINT and SIGTERM while its jobs run: the first one writes the
  folder's stop mark (``.sweep_stopped``), sends SIGINT once to each job running in a worker process (a joblib
  worker leaves the terminal's process group when its first job starts, so a Ctrl-C reaches it through the sweep
  alone, once: a second SIGINT would abort the job at once), and waits for them;
- each running job finishes its step, writes its checkpoint and says so with its own resume line; a job that
  starts after the mark does not run (one line); a job stopped in the sweep's own process (the basic launcher)
  writes the mark itself;
- the sweep then prints how many jobs finished, stopped with a checkpoint or never started, and the one command that
  resumes it: the same command line with ``trainer.resume=auto`` and the sweep's folder. Run again so, every job goes
  on from its checkpoint, a finished job is not run again (one line), and one never started starts.

A second signal stops at once: the jobs get it too (each stops without a checkpoint; it resumes from its last one).

**Progress.** Each job that ends prints ``sweep: 3/12 jobs done; about 4 min left`` (from the finished jobs' own
times and the launcher's jobs at once), where the sweep's jobs can be counted (the basic sweeper's grid).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from rlhf_lab.runtime.console import format_duration

STOP_MARK = ".sweep_stopped"  # in the sweep's folder: the signal that stopped it
SWEEP_PID = "RLHF_LAB_SWEEP_PID"  # the sweep's process, for a job to know it runs in a worker process
SWEEP_JOBS = "RLHF_LAB_SWEEP_JOBS"  # the sweep's jobs, counted by its process (a job sees only its own overrides)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class SweepWatch(Callback):
    """The sweep's process: the signal handlers, the stop mark and the resume command (see the module's text)."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.signal: int | None = None
        self.previous: dict[int, Any] = {}
        self.total: int | None = None  # the sweep's jobs, where the basic sweeper's grid counts them

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.folder = Path(str(config.hydra.sweep.dir)).expanduser().resolve()
        (self.folder / STOP_MARK).unlink(missing_ok=True)  # a resumed sweep runs again
        os.environ[SWEEP_PID] = str(os.getpid())
        self.total = total = count_jobs(config.hydra)
        if total is not None:
            os.environ[SWEEP_JOBS] = str(total)
        _say(f"sweep: {total if total is not None else 'its'} jobs into {self.folder}")
        self.previous = {number: signal.signal(number, self._stop) for number in (signal.SIGINT, signal.SIGTERM)}

    def _stop(self, number: int, _frame: Any) -> None:
        name = signal.Signals(number).name
        if self.signal is not None:  # the second: at once, the jobs too
            _say(f"second {name}: stopping the sweep at once; a job without a checkpoint resumes from its last one")
            _signal_workers(signal.SIGINT)
            os._exit(128 + number)
        self.signal = number
        write_stop_mark(self.folder, name)
        _say(f"received {name}: each running job finishes its step and writes a checkpoint, and no further job "
             f"starts (a second {name} stops at once)")
        _signal_workers(signal.SIGINT)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        os.environ.pop(SWEEP_PID, None)
        os.environ.pop(SWEEP_JOBS, None)
        mark = None if self.folder is None else self.folder / STOP_MARK
        if mark is None or not mark.is_file():
            return
        name = mark.read_text(encoding="utf-8").strip() or "a signal"
        mark.unlink()
        finished, stopped = job_states(self.folder)
        total = self.total
        never = f", {total - finished - stopped} never started" if total is not None else ""
        _say(f"sweep stopped by {name}: {finished} jobs finished, {stopped} stopped with a checkpoint{never}\n"
             f"to resume the sweep, run: {sweep_resume_command(sys.argv[1:], self.folder)}")
        sys.exit(128 + (self.signal or _number(name)))


def _number(name: str) -> int:
    """The number of the signal a stop mark names (SIGINT's where it names none)."""
    try:
        return int(signal.Signals[name])
    except KeyError:
        return int(signal.SIGINT)


def write_stop_mark(folder: Path | None, name: str) -> None:
    """The sweep's stop mark: jobs that start after it do not run."""
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STOP_MARK).write_text(name, encoding="utf-8")


def _signal_workers(number: int) -> None:
    """``number`` to each job running in a worker process: every process group among this process's children other
    than its own (a worker moved to a group of its own when its first job started), once each."""
    import psutil

    own = os.getpgrp()
    groups = set()
    for child in psutil.Process().children(recursive=True):
        try:
            group = os.getpgid(child.pid)
        except ProcessLookupError:
            continue
        if group != own and group == child.pid:
            groups.add(group)
    for group in groups:
        with contextlib.suppress(ProcessLookupError):  # its job ended meanwhile
            os.killpg(group, number)


def leave_terminal_group() -> None:
    """In a joblib worker process of this machine's sweep (loky's; not a SLURM, submitit or Ray worker, whose
    signals their own managers deliver): a process group of its own, so that a terminal's Ctrl-C reaches its job
    once, through the sweep (:class:`SweepWatch`)."""
    import multiprocessing

    sweep = os.environ.get(SWEEP_PID)
    loky = type(multiprocessing.current_process()).__name__ == "LokyProcess"
    if loky and sweep and sweep != str(os.getpid()) and os.getpgrp() != os.getpid():
        # Not allowed where it is a session leader: there the terminal's signal reaches the job directly.
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)


def stopped_before_start(sweep_folder: Path) -> str | None:
    """The signal that stopped the sweep before this job started (its stop mark), or None."""
    mark = sweep_folder / STOP_MARK
    return (mark.read_text(encoding="utf-8").strip() or "a signal") if mark.is_file() else None


def finished_summary(run_dir: Path, steps: int) -> dict[str, Any] | None:
    """A finished run's summary (``summary.json`` of all ``steps``): a resumed sweep does not run it again."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and int(summary.get("steps", -1)) >= steps else None


def job_states(folder: Path) -> tuple[int, int]:
    """(finished, stopped with a checkpoint) among the sweep's job folders."""
    finished = stopped = 0
    for job in folder.iterdir() if folder.is_dir() else []:
        if not job.is_dir():
            continue
        if (job / "summary.json").is_file():
            finished += 1
        elif (job / "checkpoints" / "latest").exists():
            stopped += 1
    return finished, stopped


def count_jobs(hydra: Any) -> int | None:
    """The sweep's jobs (``hydra``: the config's ``hydra`` node) where its sweeper is the basic one (the grid of its
    sweep overrides and ``hydra.sweeper.params``); None for another sweeper (Optuna's trials are its own)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if "BasicSweeper" not in str(hydra.sweeper.get("_target_", "")):
        return None
    lines = [f"{key}={value}" for key, value in (hydra.sweeper.get("params") or {}).items()]
    lines += [str(line) for line in hydra.overrides.task]
    counts = {}  # a key on the command line replaces the params' values for it, as the basic sweeper does
    for override in OverridesParser.create().parse_overrides(lines):
        counts[override.key_or_group] = len(list(override.sweep_string_iterator())) if override.is_sweep_override() else 1
    return math.prod(counts.values())


def progress_line(hydra: Any, sweep_folder: Path) -> str | None:
    """In a job that ended, ``sweep: 3/12 jobs done; about 4 min left``: the finished jobs' mean time over the
    launcher's jobs at once (``hydra``: the job config's ``hydra`` node), times the jobs left; None where the sweep's
    process could not count its jobs."""
    total = int(os.environ.get(SWEEP_JOBS, "0"))
    if total < 1:
        return None
    times = [seconds for job in sweep_folder.iterdir() if (seconds := job_seconds(job)) is not None]
    done = len(times)
    line = f"sweep: {done}/{total} jobs done"
    if 0 < done < total:
        at_once = max(1, int(hydra.launcher.get("n_jobs") or 1))
        left = sum(times) / done * math.ceil((total - done) / at_once)
        line += f"; about {format_duration(left)} left"
    return line


def job_seconds(job: Path) -> float | None:
    """A finished job's wall time: from its Hydra record (written as it starts) to its ``summary.json`` (the model's
    loading included); its training time where it has no record; None for a job not finished."""
    summary = job / "summary.json"
    if not summary.is_file():
        return None
    record = job / ".hydra" / "config.yaml"
    if record.is_file():
        return max(0.0, summary.stat().st_mtime - record.stat().st_mtime)
    try:
        return float(json.loads(summary.read_text(encoding="utf-8"))["time/total_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sweep_resume_command(argv: list[str], folder: Path) -> str:
    """The sweep's command line again, with ``trainer.resume=auto`` and its folder (``hydra.sweep.dir``)."""
    from rlhf_lab.app.help_text import resume_command

    where = f"hydra.sweep.dir='{folder}'" if "'" not in str(folder) and "\\" not in str(folder) else \
        f"hydra.sweep.dir={folder}"  # quoted for Hydra (a comma or an equals sign in the path)
    return resume_command(argv, ("trainer.resume=auto", where), ("trainer.resume", "hydra.sweep.dir"))
