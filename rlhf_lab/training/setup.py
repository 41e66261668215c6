"""What a run sets up before anything loads: its device, its process settings, its seeds."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from rlhf_lab.hardware import HardwareProfile
from rlhf_lab.runtime import distributed


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
