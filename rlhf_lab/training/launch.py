"""The run the CLI and the Python API start: the algorithm's loop class, under the run folder's lock."""

from __future__ import annotations

import gc
import importlib
from pathlib import Path
from typing import Any

import torch

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
        try:
            trainer = trainer_class(cfg, run_dir)  # (rank 0 holds the run folder's lock: one writer per folder)
            resume_contract.record_segment(trainer.start_step, cfg)
            summary = trainer.train()
        finally:
            trainer = None
            release_memory()
    if distributed.is_main_process():
        say(final_lines(summary, Path(run_dir).resolve()))
    return summary


def release_memory() -> None:
    """Free what a finished run held, now: the next job of an in-process sweep (Hydra's basic launcher), or the next
    ``rlhf_lab.train`` call of a notebook, starts with the device empty.

    A trainer can sit in a reference cycle (a module imported for the first time during its construction leaves
    frames in one, holding the constructor's ``self``), which only Python's cyclic collector frees, whenever it next
    runs: until then its weights, reference and optimizer state stay allocated. Then the caching allocator's
    unused blocks go back to the device (another process, a vLLM engine, may need them)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
