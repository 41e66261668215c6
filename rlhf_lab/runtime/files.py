"""A run folder's own files: opened never through a symbolic link, written whole (a temporary file and a rename).

The JSON Lines tracker, the CSV tracker and the precision's measured answers write through these.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from rlhf_lab.errors import RunFolderError


def jsonable(value: Any) -> Any:
    """A value ``json`` writes: a tensor's or array's scalar as a Python number. Non-finite floats stay floats and
    are written as the ``NaN`` / ``Infinity`` tokens, which Python's ``json``, pandas and ``datasets`` read back as
    floats (a string "nan" would make a numeric column text)."""
    return value.item() if hasattr(value, "item") else value


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


def write_json_atomic(path: Path, payload: Any, lines: list[dict[str, Any]] | None = None) -> None:
    """Write a JSON file (or JSON Lines when ``lines`` is given) via a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open_in_folder(tmp, "w") as handle:
        if lines is None:
            json.dump(payload, handle, indent=2, default=jsonable)
        else:
            for record in lines:
                handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
