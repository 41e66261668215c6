"""The run the CLI and the Python API start: the algorithm's loop class, under the run folder's lock."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from rlhf_lab.registry import get
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import final_lines, library_progress_bars, say
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
    with resume_contract.holding(run_dir), library_progress_bars(cfg.trainer.library_progress_bars):
        trainer = trainer_class(cfg, run_dir)  # (rank 0 holds the run folder's lock: one writer per folder)
        resume_contract.record_segment(trainer.start_step, cfg)
        summary = trainer.train()
    if distributed.is_main_process():
        say(final_lines(summary, Path(run_dir).resolve()))
    return summary
