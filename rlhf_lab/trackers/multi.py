"""``logger`` as a list: ``logger=[wandb,tensorboard]`` runs every chosen tracker behind the one interface.

Each tracker option adds itself to ``logger.trackers`` (a dict, so Hydra merges the options of a list);
:func:`active_trackers` reads it (a config without it: ``logger.name``), :func:`check_trackers` refuses an
unknown tracker or one whose package is not installed (one line, before anything loads), and
:func:`build_tracker` builds them all behind one :class:`~rlhf_lab.trackers.base.Tracker`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from rlhf_lab.errors import ConfigError
from rlhf_lab.registry import get, names
from rlhf_lab.trackers.base import Tracker

# tracker -> (module it needs, how to install it)
NEEDS = {
    "tensorboard": ("tensorboard", "install it: pip install -r requirements.txt"),
    "mlflow": ("mlflow", "install the optional `mlflow` extra: pip install -r requirements-mlflow.txt"),
    "trackio": ("trackio", "install the optional `trackio` extra: pip install -r requirements-trackio.txt"),
}  # wandb is not here: a W&B that is missing or fails warns once and the run goes on (rlhf_lab/trackers/wandb.py)


def active_trackers(logger_cfg: Any) -> list[str]:
    """The trackers a run writes to, in the order chosen (``none`` alone means none)."""
    chosen = logger_cfg.get("trackers") or {}
    active = [str(name) for name, on in chosen.items() if on]
    if not active and not chosen:
        active = [str(logger_cfg.name)]
    return [name for name in active if name != "none"]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_trackers(cfg: Any) -> None:
    """Every chosen tracker is registered and its package installed."""
    registered = names("logger")
    for name in active_trackers(cfg.logger):
        if name not in registered:
            raise ConfigError(f"logger={name!r} is not a tracker; choose from: {', '.join(registered)} "
                              "(several: logger=[wandb,tensorboard])")
        module, install = NEEDS.get(name, (None, ""))
        if module and not _installed(module):
            raise ConfigError(f"logger={name} needs {module}, which is not installed; {install}")


class MultiTracker(Tracker):
    """Every call goes to each tracker in turn."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_samples(rows, step)

    def log_eval_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        for tracker in self.trackers:
            tracker.log_eval_samples(rows, step)

    def finish(self, summary: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.finish(summary)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def build_tracker(logger_cfg: Any, config: dict[str, Any], run_dir: Path, resuming: bool = False) -> Tracker:
    """The configured trackers as one; ``resuming``: the run continues from a checkpoint in ``run_dir``."""
    trackers = []
    for name in active_trackers(logger_cfg):
        cls = get("logger", name)
        try:
            trackers.append(cls(logger_cfg, config, run_dir, resuming=resuming))
        except TypeError:  # a plug-in tracker with the plain (logger_cfg, config, run_dir) signature
            trackers.append(cls(logger_cfg, config, run_dir))
    if not trackers:
        return Tracker(logger_cfg, config, run_dir)
    return trackers[0] if len(trackers) == 1 else MultiTracker(trackers)
