"""What a run sets up before anything loads: its device, its process settings, its seeds."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch

from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import say


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when available; under a multi-process launch each rank takes its ``LOCAL_RANK`` GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed.launched_processes() > 1:
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device(name)


def configure_process(trainer_cfg: Any, hardware: HardwareProfile) -> None:
    """Process-wide settings of a training run, before anything loads: its thread count, and what its hardware
    profile asks of the process (:meth:`~rlhf_lab.hardware.HardwareProfile.apply_process_settings`)."""
    if trainer_cfg.num_threads > 0:
        torch.set_num_threads(trainer_cfg.num_threads)
    hardware.apply_process_settings()
    if distributed.is_main_process() and resolve_device(trainer_cfg.get("device", "auto")).type == "cpu":
        hint = thread_hint(trainer_cfg.num_threads, torch.get_num_threads(), os.getloadavg()[0], os.cpu_count() or 1)
        if hint:
            say(hint, __name__, logging.WARNING)


def thread_hint(num_threads: int, threads: int, load: float, cores: int) -> str | None:
    """A hint to set ``trainer.num_threads`` when the CPU is already busy (a 1-minute load average of at least one
    core) and torch would run several threads on it by default: they spin-wait on each other and a step takes
    several times as long (docs/guides/hardware.md). None when the setting is given or nothing suggests it helps."""
    if num_threads > 0 or threads <= 1 or load < 1.0:
        return None
    return (f"the CPU is busy before this run starts (load average {load:.1f} on {cores} cores) and torch runs "
            f"{threads} threads, which wait on each other under load: set trainer.num_threads=1 (measured on 2 "
            "shared cores: 10 s a step against 45 s with the default, docs/guides/hardware.md)")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
