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

    The loop is the algorithm's (:func:`trainer_class`).
    """
    with resume_contract.holding(run_dir), library_progress_bars(cfg.trainer.library_progress_bars):
        try:
            # (rank 0 holds the run folder's lock: one writer per folder)
            trainer = trainer_class(cfg.algorithm.name)(cfg, run_dir)
            resume_contract.record_segment(trainer.start_step, cfg)
            summary = trainer.train()
        finally:
            trainer = None
            release_memory()
    if distributed.is_main_process():
        say(final_lines(summary, Path(run_dir).resolve()))
    return summary


def trainer_class(algorithm: str) -> type[Trainer]:
    """The loop class of ``algorithm=NAME``: the one an algorithm that learns from data (sft, reward_model, dpo) names
    as ``module:Class`` in its ``trainer`` attribute (a subclass of :class:`Trainer`), else :class:`Trainer`."""
    path = getattr(get("algorithm", algorithm), "trainer", None)
    if not path:
        return Trainer
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


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
