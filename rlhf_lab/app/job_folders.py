"""Short, bounded job folder names for sweeps (a leaf: imports only OmegaConf).

``hydra.sweep.subdir`` (conf/config.yaml) is ``${hydra.job.num}_${rlhf_lab_job_label:...}``: the job
number and a label of at most :data:`LABEL_CHARS` characters, however many overrides the sweep has (Hydra's
``override_dirname`` joins them all and can pass the 255-character file-name limit). Each job's full
overrides stay in its ``.hydra/overrides.yaml``. The resolver is defined when this module is imported: the
CLI imports it, and so does every launcher's job process (it unpickles the CLI's task function).
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

LABEL_CHARS = 40


def job_label(override_dirname: str, swept: frozenset[str] | None = None, limit: int = LABEL_CHARS) -> str:
    """``kl=k3,kl.placement=loss,seed=1`` -> ``k3,placement=loss,seed=1``: a group choice by its value, a dotted
    key by its last part, only the ``swept`` keys when known; past ``limit`` characters it is cut and ends in
    ``~`` + 8 hex digits of the full text, so labels stay distinct."""
    parts = []
    for item in filter(None, str(override_dirname).split(",")):
        key, sep, value = item.partition("=")
        key = key.lstrip("+~")
        if swept and key not in swept:
            continue
        parts.append(value if sep and "." not in key and key != "seed" else f"{key.rsplit('.', 1)[-1]}={value}")
    label = re.sub(r"[^A-Za-z0-9=.,_+-]", "-", ",".join(parts)) or "job"
    if len(label) > limit:
        digest = hashlib.sha1(str(override_dirname).encode()).hexdigest()[:8]
        label = f"{label[: limit - 9]}~{digest}"
    return label


def read_swept_keys(sweep_dir: str) -> frozenset[str] | None:
    """Keys the sweep varies (command-line sweeps and ``hydra.sweeper.params``), from the ``multirun.yaml`` Hydra
    writes into the sweep folder before any job starts; None when it cannot be read."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        master = OmegaConf.load(Path(sweep_dir) / "multirun.yaml")
        lines = [str(line) for line in master.hydra.overrides.task]
        params = OmegaConf.select(master, "hydra.sweeper.params") or {}
        lines += [f"{key}={value}" for key, value in params.items()]
        parsed = OverridesParser.create().parse_overrides(lines)
    except Exception:
        return None
    return frozenset(o.key_or_group for o in parsed if o.is_sweep_override())


swept_keys = functools.cache(read_swept_keys)  # one read per sweep folder while naming its jobs


def _label(text: Any, _root_: Any) -> str:
    sweep_dir = OmegaConf.select(_root_, "hydra.sweep.dir", default=None)
    return job_label(str(text), swept_keys(str(sweep_dir)) if sweep_dir else None)


def register_job_label() -> None:
    if not OmegaConf.has_resolver("rlhf_lab_job_label"):
        OmegaConf.register_new_resolver("rlhf_lab_job_label", _label)


register_job_label()
