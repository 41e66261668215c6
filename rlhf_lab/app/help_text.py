"""``--help`` in plain text: a module docstring's reStructuredText markup (````code````, ``:mod:`x```) as a terminal
shows it; and the command lines the program prints for a user to run again (a stopped run's, an unfinished job's)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|ref):`~?([^`]+)`")


def plain(text: str) -> str:
    """``text`` without reST roles and literal markup: ``:mod:`rlhf_lab.x``` -> rlhf_lab.x, ````a=b```` -> a=b."""
    return ROLE.sub(r"\1", text).replace("``", "")


RUN_FOLDER_KEYS = ("trainer.resume", "trainer.output_dir")  # what a run's resume line sets again


def resume_command(task_overrides: list[str], resume_overrides: tuple[str, ...],
                   replaced_keys: tuple[str, ...] = RUN_FOLDER_KEYS) -> str:
    """The command line that continues a stopped run (or sweep): its overrides, with ``replaced_keys`` (resume and
    folder) left out and ``resume_overrides`` added."""
    replaced = tuple(f"{prefix}{key}=" for key in replaced_keys for prefix in ("", "+"))
    kept = [o for o in task_overrides if not o.startswith(replaced)]
    return " ".join([program_in_shell(), *map(shlex.quote, [*kept, *resume_overrides])])


def program_in_shell() -> str:
    """How the user's shell starts this program again: ``rlhf-lab`` when that name on PATH is this program, else the
    path it was started by (``make train`` runs ``.venv/bin/rlhf-lab``, whose folder is not on PATH); ``python -m
    rlhf_lab`` when that ``python`` is this interpreter, else this interpreter's path."""
    invoked = sys.argv[0]
    if Path(invoked).name == "rlhf-lab":
        found = shutil.which("rlhf-lab")
        if found and os.path.abspath(found) == os.path.abspath(invoked):
            return "rlhf-lab"
        return shlex.quote(invoked if os.sep in invoked else os.path.abspath(invoked))
    python = shutil.which("python")
    if python and os.path.abspath(python) == os.path.abspath(sys.executable):
        return "python -m rlhf_lab"
    return f"{shlex.quote(sys.executable)} -m rlhf_lab"
