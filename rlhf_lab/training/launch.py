"""The run the CLI and the Python API start: the algorithm's loop class, under the run folder's lock."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from rlhf_lab.registry import get
from rlhf_lab.training import resume_contract
from rlhf_lab.training.loop import Trainer


def run(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Train the run ``cfg`` describes in ``run_dir`` and return its summary (what the CLI calls).

    An algorithm that learns from data (sft, reward_model, dpo) names its own loop as ``module:Class`` in
    its ``trainer`` attribute; that loop subclasses :class:`Trainer`, so it is imported by name here.
    """
    trainer_class: Any = Trainer
    path = getattr(get("algorithm", cfg.algorithm.name), "trainer", None)
    if path:
        module, _, name = path.partition(":")
        trainer_class = getattr(importlib.import_module(module), name)
    with resume_contract.holding(run_dir):  # one writer per run folder (rank 0 holds its lock)
        trainer = trainer_class(cfg, run_dir)
        resume_contract.record_segment(trainer.start_step, cfg)
        return trainer.train()
