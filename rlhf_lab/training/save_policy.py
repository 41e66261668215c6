"""What a run's checkpoints hold (``trainer.save``) and whether they fit on the disk, checked before training.

``trainer.save`` follows the Hugging Face Trainer's choices (``save_only_model``, ``save_strategy="no"``):

- ``all``: model, optimizer state, scheduler, generators: a checkpoint that resumes exactly;
- ``model``: the model (or its LoRA adapter), the tokenizer and the run's small state, no optimizer state (AdamW
  keeps two moments per trainable weight: two thirds of a full fine-tuning checkpoint). ``rlhf-lab eval`` and
  ``rlhf-lab export`` read it; a resume from it is refused in one line;
- ``none``: no checkpoint at the end or every ``trainer.checkpoint_every`` (``summary.json``, the metrics and
  samples files are written as always);
- ``auto`` (default): ``all`` for a single run, ``model`` for each job of a sweep (``-m``, an experiment, a
  search), the lightest save that keeps every job's evaluation and export working.

A stop by signal (Ctrl-C, SIGTERM) always writes a full checkpoint: the command it prints resumes from it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from rlhf_lab.errors import CheckpointError

SAVE_POLICIES = ("auto", "all", "model", "none")
GB = 1e9


def in_sweep() -> bool:
    """Whether this process runs a job of a Hydra multirun (a sweep, an experiment, a search)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # Hydra's config incomplete (a run built by the Python API): a single run
        return False


def resolve_save(trainer: Any, sweep: bool | None = None) -> str:
    """``trainer.save`` as ``all``, ``model`` or ``none`` (``auto``: ``model`` in a sweep job, else ``all``)."""
    save = str(trainer.get("save", "auto"))
    if save != "auto":
        return save
    return "model" if (in_sweep() if sweep is None else sweep) else "all"


@dataclass
class CheckpointSize:
    """Bytes of one checkpoint (``model``: the weights or adapter ``save_pretrained`` writes, with the algorithm's own
    modules; ``optimizer``: AdamW's two moments of every trainable weight) and how many are on disk at once."""

    model: int
    optimizer: int
    at_once: int

    @property
    def total(self) -> int:
        return (self.model + self.optimizer) * self.at_once

    def describe(self) -> str:
        one = (self.model + self.optimizer) / GB
        parts = f"model {self.model / GB:.3g} GB" + (f", optimizer {self.optimizer / GB:.3g} GB" if self.optimizer else "")
        return f"{self.total / GB:.3g} GB ({self.at_once} × {one:.3g} GB: {parts})"


def saves_in_run(trainer: Any) -> int:
    """Checkpoints a run of ``trainer.steps`` writes: every ``checkpoint_every`` updates and one at the end."""
    every, steps = int(trainer.checkpoint_every), int(trainer.steps)
    periodic = steps // every if every > 0 else 0
    return periodic + (0 if every > 0 and steps % every == 0 else 1)


def checkpoint_size(trainer: Any, policy: nn.Module, modules: dict[str, nn.Module], uses_adapter: bool,
                    save: str) -> CheckpointSize:
    """The disk one run's checkpoints take at their peak: the newest ``keep_last_n`` plus the one being written."""
    saved = [p for p in policy.parameters() if p.requires_grad] if uses_adapter else list(policy.parameters())
    if not uses_adapter:  # a tied LM head is one tensor, written once
        saved = list({id(p): p for p in saved}.values())
    trainable = [p for p in policy.parameters() if p.requires_grad]
    for module in modules.values():
        saved += list(module.parameters())
        trainable += [p for p in module.parameters() if p.requires_grad]
    model_bytes = sum(p.numel() * p.element_size() for p in saved)
    optimizer_bytes = 2 * sum(p.numel() * p.element_size() for p in trainable) if save == "all" else 0
    saves = saves_in_run(trainer) if save != "none" else 0
    return CheckpointSize(model_bytes, optimizer_bytes, min(saves, int(trainer.keep_last_n) + 1))


def check_disk(trainer: Any, size: CheckpointSize, run_dir: Path) -> None:
    """Refuse in one line a run whose checkpoints would not fit on the disk of ``run_dir`` (before any step: a full
    disk otherwise stops the run at its last save)."""
    free = shutil.disk_usage(Path(run_dir)).free
    if size.total > free:
        raise CheckpointError(
            f"this run's checkpoints need about {size.describe()} and {run_dir} has {free / GB:.3g} GB free; "
            f"set trainer.save=model (no optimizer state) or trainer.save=none, lower trainer.keep_last_n "
            f"(now {trainer.keep_last_n}) or trainer.checkpoint_every, or free space")
