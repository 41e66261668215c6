"""rlhf_lab's cache folder (a leaf: the standard library only): the embedded model's conversion, built preference
sets, the CPU's measured bf16-vs-float32 answer (:mod:`rlhf_lab.runtime.precision`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$RLHF_LAB_CACHE``, else ``$XDG_CACHE_HOME/rlhf_lab``, else ``~/.cache/rlhf_lab``."""
    if os.environ.get("RLHF_LAB_CACHE"):
        return Path(os.environ["RLHF_LAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf_lab"
