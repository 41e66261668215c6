"""One writer per run folder: an OS file lock (``flock``) on ``<run folder>/.rlhf_lab.lock``.

The lock is held for the life of the run and released by the kernel on any exit, SIGKILL included, so a
lock left by a killed process is never "stale": the next run takes it. The file holds the holder's PID
(emptied on a clean release), which names the holder when a second process is refused and tells a new
holder that the previous one ended without releasing it. Only rank 0 of a multi-process run takes it.

Within one process the lock is counted: the CLI takes it before Hydra writes ``.hydra/`` into the folder,
and :func:`rlhf_lab.training.launch.run` takes it again (a multirun job's own folder); the last release unlocks.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlhf_lab.errors import ConfigError, RunFolderError, UserError

LOCK_FILE = ".rlhf_lab.lock"


class RunFolderInUse(UserError):
    """Another process holds the run folder's lock; the message names its PID."""


@dataclass
class _Held:
    descriptor: int
    count: int


_held: dict[str, _Held] = {}


def is_rank_zero() -> bool:
    """Rank 0 of a torch.distributed launch (``RANK`` unset: a single process)."""
    return os.environ.get("RANK", "0") in ("", "0")


def _key(run_dir: Path) -> str:
    return str(Path(run_dir).expanduser().resolve())


def acquire(run_dir: Path, instead: str = "choose another trainer.output_dir") -> None:
    """Take the lock of ``run_dir`` (created if needed), or raise :class:`RunFolderInUse` naming the holder and
    what to do ``instead`` of waiting."""
    key = _key(run_dir)
    if key in _held:
        _held[key].count += 1
        return
    folder = Path(key)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    try:  # never through a link: one planted in the folder would truncate a file outside it
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise RunFolderError(f"{str(path)!r} is a symbolic link; the run folder's lock is never taken through "
                                 "one (remove it, or choose another trainer.output_dir)") from None
        raise
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(descriptor)
        os.close(descriptor)
        who = f"process {holder}" if holder else "another process"
        raise RunFolderInUse(
            f"run folder {key!r} is in use by {who} (lock {path}); wait for it to end or {instead}"
        ) from None
    previous = _read_pid(descriptor)
    if previous and previous != os.getpid():
        print(f"note: the last run in {key} (process {previous}) ended without releasing its lock (killed?); "
              "taking the folder over", file=sys.stderr, flush=True)
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    _held[key] = _Held(descriptor, 1)


def release(run_dir: Path) -> None:
    """Give back one :func:`acquire`; the last one empties the PID file and unlocks."""
    key = _key(run_dir)
    held = _held.get(key)
    if held is None:
        return
    held.count -= 1
    if held.count > 0:
        return
    del _held[key]
    try:
        os.ftruncate(held.descriptor, 0)
    finally:
        os.close(held.descriptor)  # closing the last descriptor releases the flock


def check_writable(folder: Path, key: str = "trainer.output_dir") -> None:
    """``folder`` (or the nearest folder above it that exists) must be a folder this process can write in."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{key}={str(folder)!r} is a file, not a folder; choose a folder")
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}={str(folder)!r} cannot be created: {str(existing)!r} is a file")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ConfigError(
            f"{key}={str(folder)!r} is not writable ({str(existing)!r}: {error.strerror}); choose another folder"
        ) from None


def new_run_folder(parent: Path) -> Path:
    """A new folder ``parent/<time>`` (``_1``, ``_2``, ... appended when taken), created here: ``mkdir`` is atomic,
    so runs started in the same second each get their own."""
    parent = Path(parent).expanduser().resolve()
    check_writable(parent, key="hydra.run.dir")
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    for attempt in range(1000):
        folder = parent / (stamp if attempt == 0 else f"{stamp}_{attempt}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise ConfigError(f"cannot create a new run folder in {str(parent)!r}; give trainer.output_dir")


def enclosing_run_folder(folder: Path) -> Path | None:
    """The nearest folder at or above ``folder`` that holds a run's lock file (a run folder), or None."""
    folder = Path(folder).expanduser().resolve()
    return next((above for above in (folder, *folder.parents) if (above / LOCK_FILE).is_file()), None)


def holds(run_dir: Path) -> bool:
    return _key(run_dir) in _held


def _read_pid(descriptor: int) -> int | None:
    try:
        text = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


@atexit.register
def _release_all() -> None:
    for key in list(_held):
        _held[key].count = 1
        release(Path(key))
