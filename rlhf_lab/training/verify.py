"""Checksums of a checkpoint: a sha256 per file in the manifest, and one over ``trainer_state.json`` itself.

A save records ``sha256`` (file -> digest), ``keys`` (the state's keys) and ``state_sha256`` (the digest of
the state without it). :func:`damage` re-reads a folder and says in a few words what is wrong with it: a
state file that is missing, torn or edited, a key that is gone, a file that is missing, of another size or
with other bytes (a flipped bit in the weights or a rewritten safetensors header). Checkpoints written
before checksums existed are checked by size, as they were.

A checkpoint holds only its own files: a symbolic link anywhere under it, a file that is not a regular file (a
named pipe would block every reader), or a manifest entry that leaves the folder (``..`` or an absolute path) is
damage, never followed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

REQUIRED_KEYS = ("step", "files", "optimizer", "rng")  # every checkpoint's state has these
CHUNK = 1 << 20
FULL_DISK = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded"}  # errno -> what to tell


class NotRegularFile(OSError):
    """A path that is a symbolic link, a named pipe, a device or a folder where a regular file was expected."""


def read_regular_text(path: Path) -> str:
    """The text of ``path`` if it is a regular file, read without following a final symbolic link and without
    blocking on a named pipe; :class:`NotRegularFile` otherwise."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        if Path(path).is_symlink():
            raise NotRegularFile(f"{path} is a symbolic link") from None
        raise error
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
        return handle.read().decode("utf-8")


def outside_entry(relative: str) -> bool:
    """A manifest entry that would name a file outside its checkpoint (absolute, or with ``..``)."""
    path = PurePosixPath(relative)
    return path.is_absolute() or ".." in path.parts or "\\" in relative


def foreign_entry(folder: Path) -> str | None:
    """The first thing under ``folder`` (itself included) that a checkpoint never holds: a symbolic link, or a file
    that is not a regular file or folder; as a short phrase, or None."""
    if Path(folder).is_symlink():
        return f"{Path(folder).name} is a symbolic link (a checkpoint holds only its own files)"
    for root, folders, files in os.walk(folder, followlinks=False):
        for name in sorted(folders + files):
            path = Path(root) / name
            mode = path.lstat().st_mode
            relative = path.relative_to(folder).as_posix()
            if stat.S_ISLNK(mode):
                return f"{relative} is a symbolic link (a checkpoint holds only its own files)"
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return f"{relative} is not a regular file"
    return None


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def folder_digests(folder: Path, skip: str, known: dict[str, str] | None = None) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative POSIX path -> hex digest), ``skip`` (a name) left out;
    ``known``: digests computed elsewhere (each rank's of its own shard files), taken as they are."""
    known = known or {}
    return {
        relative: known[relative] if relative in known else file_digest(path)
        for path in sorted(Path(folder).rglob("*"))
        if path.is_file() and path.name != skip
        for relative in [path.relative_to(folder).as_posix()]
    }


def state_checksum(state: dict[str, Any]) -> str:
    """sha256 of the state as JSON (sorted keys), without its own ``state_sha256``."""
    body = {key: value for key, value in state.items() if key != "state_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def seal(state: dict[str, Any], folder: Path, skip: str, known: dict[str, str] | None = None) -> dict[str, Any]:
    """``state`` with the digests of ``folder``'s files (``known``: those the writing ranks computed), its key list
    and its own checksum added."""
    sealed = json.loads(json.dumps({**state, "sha256": folder_digests(folder, skip, known)}))  # as it will read back
    sealed["keys"] = sorted([*sealed, "keys"])
    sealed["state_sha256"] = state_checksum(sealed)
    return sealed


def damage(folder: Path, state_file: str, hashes: Callable[[str], bool] | None = None) -> str | None:
    """What is wrong with the checkpoint in ``folder`` (a short phrase), or None when every check passes.

    ``hashes``: which files' digests this process checks (a rank of a sharded run: its own shard files and the
    small common ones, :func:`~rlhf_lab.training.checkpoint_sharded.hashed_by`); every file's size is checked."""
    folder = Path(folder)
    foreign = foreign_entry(folder)
    if foreign is not None:
        return foreign
    try:
        state = json.loads(read_regular_text(folder / state_file))
    except FileNotFoundError:
        return f"{state_file} is missing"
    except (OSError, UnicodeDecodeError) as error:
        return f"{state_file} is unreadable ({type(error).__name__})"
    except ValueError:
        return f"{state_file} is not valid JSON (torn or edited)"
    if not isinstance(state, dict):
        return f"{state_file} is not a JSON object"
    keys = state.get("keys") if isinstance(state.get("keys"), list) else []
    missing = [key for key in (*REQUIRED_KEYS, *keys) if key not in state]
    if missing:
        return f"{state_file} has no {missing[0]!r} key"
    if "state_sha256" in state and state["state_sha256"] != state_checksum(state):
        return f"{state_file} does not match its checksum (edited or corrupted)"
    sizes, digests = state["files"], state.get("sha256") or {}
    if not isinstance(sizes, dict) or not isinstance(digests, dict):
        return f"{state_file} has a malformed manifest"
    outside = next((entry for entry in [*sizes, *digests] if outside_entry(str(entry))), None)
    if outside is not None:
        return f"{state_file} names {outside!r}, outside the checkpoint (edited)"
    extra = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*")
                   if path.is_file() and path.name != state_file and path.relative_to(folder).as_posix() not in sizes)
    if extra:  # a loader would read it with the saved files (another weights shard, say)
        return f"{extra[0]} is not in the manifest (added after the save)"
    for relative, size in sizes.items():
        path = folder / relative
        if path.exists() and not path.is_file():
            return f"{relative} is unreadable (not a file)"
        try:
            actual = path.stat().st_size
            if actual != size:
                return f"{relative} has {actual} bytes, its manifest says {size}"
            hashed = hashes is None or hashes(relative)
            if relative in digests and hashed and file_digest(path) != digests[relative]:
                return f"{relative} does not match its sha256 (corrupted)"
        except OSError as error:
            return f"{relative} is {'missing' if isinstance(error, FileNotFoundError) else 'unreadable'}"
    return None


# ----------------------------------------------------------------------------- writing to disk
def fsync_tree(folder: Path) -> None:
    """Flush every file (and folder entry) under ``folder`` to disk, so a rename never outlives the data."""
    for path in sorted(folder.rglob("*"), reverse=True):
        fsync(path)
    fsync(folder)


def fsync(path: Path) -> None:
    """Flush one file or folder entry to disk (where the filesystem allows it)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some filesystems refuse fsync on folders
    finally:
        os.close(descriptor)


def full_disk(error: Exception) -> str | None:
    """What ran out ("no space left", "disk quota exceeded") when ``error`` is a write that found the disk full,
    else None. safetensors reports the OS error inside its message (``... (os error 28)``), not as ``errno``."""
    if isinstance(error, OSError):
        return FULL_DISK.get(error.errno)
    return next((told for code, told in FULL_DISK.items() if f"(os error {code})" in str(error)), None)


def manifest(folder: Path, skip: str) -> dict[str, int]:
    """Every file under ``folder`` but ``skip`` (the state file that holds this manifest) with its size."""
    return {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != skip
    }
