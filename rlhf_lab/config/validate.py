"""``validate(cfg)``: every check of a composed config, in order, before any model loads.

1. keys: each key belongs to its node's schema (:mod:`~rlhf_lab.config.validate_keys`);
2. values: choices, ranges, batch shapes (:mod:`~rlhf_lab.config.validate_values`); NaN/inf anywhere, integer
   ranges, LoRA dropout, the device's availability (:mod:`~rlhf_lab.config.validate_numbers`); KL options, the
   exact task and the zero-gradient warning (:mod:`~rlhf_lab.config.validate_kl`);
3. scale: strategy, precision and the batch over the ranks (:mod:`~rlhf_lab.config.validate_scale`);
4. paths: data files, model and reward-model folders, hub cache (:mod:`~rlhf_lab.config.validate_paths`);
5. code: user ``module:function`` specs import (:mod:`~rlhf_lab.config.validate_code`);
6. resume: a ``trainer.resume`` path names a complete checkpoint (``rlhf_lab.training.checkpoint``).

The first bad value raises :class:`~rlhf_lab.errors.ConfigError`, one line naming the key, the value and
what is allowed.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from rlhf_lab.app.plugins import load_plugins
from rlhf_lab.config.validate_async import check_continuous
from rlhf_lab.config.validate_code import check_code
from rlhf_lab.config.validate_env import check_env
from rlhf_lab.config.validate_eval import check_eval
from rlhf_lab.config.validate_keys import check_known_keys
from rlhf_lab.config.validate_kl import check_kl
from rlhf_lab.config.validate_numbers import check_numbers
from rlhf_lab.config.validate_offline import check_offline
from rlhf_lab.config.validate_paths import check_paths
from rlhf_lab.config.validate_scale import check_scale
from rlhf_lab.config.validate_sizes import check_sizes
from rlhf_lab.config.validate_values import check_values
from rlhf_lab.errors import CheckpointError, ConfigError
from rlhf_lab.trackers.multi import check_trackers


def check_resume(trainer: Any) -> None:
    """A resume path must name a complete checkpoint (``auto`` is resolved when the run starts)."""
    if not trainer.resume or trainer.resume == "auto":
        return
    from rlhf_lab.training.checkpoint import resolve_resume  # the training package is heavy: only when needed

    try:
        resolve_resume(trainer.resume, Path(trainer.resume))
    except CheckpointError as error:
        raise ConfigError(str(error)) from None


def validate(cfg: Any, pending_paths: Collection[str] = ()) -> None:
    """Check a composed config; raise :class:`ConfigError` on the first bad key or value (``pending_paths``: folders
    an earlier stage writes, not checked yet)."""
    load_plugins(cfg.get("plugins") or [])  # a plug-in's parts are registered before names are checked
    check_known_keys(cfg)
    check_values(cfg)
    check_continuous(cfg)
    check_trackers(cfg)  # logger=[wandb,tensorboard]: each registered and installed
    check_eval(cfg)  # eval.*: sampling settings and the eval-only rewards
    check_numbers(cfg)
    check_kl(cfg)
    check_env(cfg)
    check_offline(cfg)
    check_scale(cfg)
    check_sizes(cfg)
    check_paths(cfg, pending_paths)
    check_code(cfg)
    check_resume(cfg.trainer)
