"""The ``rlhf-lab serve`` trust boundaries: the shared secret (where the server gets it: ``--token-file``,
``RLHF_LAB_SERVE_TOKEN``, or one generated at start into the sync folder, mode 0600; and where the trainer reads it),
the folders a load may name (inside the sync folder, regular files only), and whether an address is loopback (a
server bound elsewhere warns: plain HTTP carries the token in clear)."""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import Any

from rlhf_lab.errors import ConfigError, ToolError


class RequestError(Exception):
    """A request the server refuses: its HTTP status and one line."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


TOKEN_ENV = "RLHF_LAB_SERVE_TOKEN"
TOKEN_FILE = ".serve_token"  # in the sync folder, mode 0600


def need(request: dict[str, Any], *keys: str) -> None:
    """A 400 naming the first of ``keys`` a request's body lacks."""
    missing = [key for key in keys if key not in request]
    if missing:
        raise RequestError(400, f"the request has no {missing[0]!r}")


def _read_token(path: Path, where: str) -> str:
    """The secret in ``path``; a file others may read is refused (a shared machine's other users would hold the
    server's token: ``chmod 600``)."""
    try:
        mode = Path(path).expanduser().stat().st_mode
    except OSError:
        mode = 0
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{where}={str(path)!r} can be read or written by others (mode {stat.S_IMODE(mode):o}); the "
                          f"server's token must be its owner's alone: chmod 600 {str(path)!r}")
    try:
        token = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{where}={str(path)!r} cannot be read ({type(error).__name__}); give the file rlhf-lab "
                          "serve wrote or was given (--token-file)") from None
    if not token:
        raise ConfigError(f"{where}={str(path)!r} is empty; give the file rlhf-lab serve wrote or was given")
    return token


def server_token(sync_folder: Path | None, token_file: str | None = None) -> str:
    """The server's secret: ``token_file``'s, else the environment's, else a new one written 0600 to the sync
    folder for the trainer to read."""
    if token_file:
        return _read_token(Path(token_file), "--token-file")
    if os.environ.get(TOKEN_ENV, "").strip():  # a blank one is no secret
        return os.environ[TOKEN_ENV].strip()
    if sync_folder is None:
        raise ToolError(f"no --sync-folder to write a new token to: give the token with --token-file FILE or "
                        f"{TOKEN_ENV}, or a --sync-folder")
    token = secrets.token_urlsafe(32)
    path = Path(sync_folder) / TOKEN_FILE
    if path.is_symlink():
        raise ToolError(f"{str(path)!r} is a symbolic link; remove it (rlhf-lab serve writes its token there)")
    path.unlink(missing_ok=True)  # a new file, created 0600, never an older one's mode
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(token + "\n")
    return token


def client_token(sync_folder: str | None, token_file: str | None) -> str:
    """The trainer's copy of the server's secret, from where the server put it (see :func:`server_token`)."""
    if token_file:
        return _read_token(Path(token_file), "generation.token_file")
    if os.environ.get(TOKEN_ENV, "").strip():  # a blank one is no secret
        return os.environ[TOKEN_ENV].strip()
    if sync_folder:
        path = Path(sync_folder).expanduser() / TOKEN_FILE
        if path.is_file():
            return _read_token(path, "the server's token file")
        raise ConfigError(f"no rlhf-lab serve token at {str(path)!r}: start the server with --sync-folder "
                          f"{sync_folder} first (it writes the token there), or give generation.token_file or "
                          f"{TOKEN_ENV}")
    raise ConfigError(f"generation=vllm_server needs the server's token: give generation.sync_folder (the server "
                      f"writes it there), generation.token_file, or {TOKEN_ENV}")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------ the routes


def folder_inside(sync_folder: Path | None, given: Any, what: str) -> Path:
    """``given`` (relative to the sync folder, or absolute) as a folder inside the server's sync folder; a 4xx
    naming it where it is not one (None: the server was started without a sync folder)."""
    if sync_folder is None:
        raise RequestError(409, f"this server was started without --sync-folder: it loads no {what} from a folder "
                                "(start it with --sync-folder, or send weights over the group)")
    if not isinstance(given, str) or not given:
        raise RequestError(400, f"{what} must be a folder name in the sync folder")
    path = (sync_folder / given).resolve()
    if not path.is_relative_to(sync_folder):
        raise RequestError(403, f"{what}={given!r} is outside the sync folder {sync_folder}; nothing loaded, the "
                                "previous weights still serve")
    if not path.is_dir():
        raise RequestError(400, f"{what}={given!r} is not a folder in {sync_folder}; nothing loaded, the previous "
                                "weights still serve")
    return path


def regular_files(folder: Path, pattern: str) -> list[Path]:
    """The files of ``folder`` matching ``pattern``; a 403 where one is a symbolic link or not a regular file."""
    found = sorted(folder.glob(pattern))
    for path in found:
        mode = path.lstat().st_mode
        if not stat.S_ISREG(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            raise RequestError(403, f"{path.name} in {folder} is {kind}; nothing loaded, the previous weights still "
                                    "serve")
    return found
