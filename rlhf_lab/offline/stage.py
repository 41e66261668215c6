"""What every offline stage shares: the algorithm interface the online trainer and updater call, plus the
stage's own steps (collate a batch, prepare it, held-out metrics).

A stage registers under kind ``algorithm`` like the online algorithms (``algorithm=sft|dpo|reward_model``),
with ``offline = True`` and the loop that runs it named in ``trainer`` (see :func:`rlhf_lab.training.launch.run`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from rlhf_lab.data.prompts import EVAL_CHUNK
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.offline.data import Example


class OfflineStage:
    """A loss over batches read from data; no advantages, critic or veto."""

    offline = True
    trainer = "rlhf_lab.offline.loop:OfflineTrainer"
    pairs = False  # True: preference pairs; False: demonstrations
    needs_hidden_states = False
    reads_sampling_hidden = False  # as Algorithm's: no rollouts, so no sampling-time hidden states

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    @classmethod
    def min_group_size(cls, cfg: Any) -> int:
        return 1

    # ------------------------------------------------------------------ the online algorithm interface
    def modules(self) -> dict[str, nn.Module]:
        return {}

    def setup(self, policy: nn.Module) -> None:
        """Nothing to build beside the policy."""

    def wrap_modules(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """No modules of its own."""

    def parameter_groups(self, lr: float) -> list[dict[str, Any]]:
        return []

    def should_stop_epochs(self, stats: dict[str, float]) -> bool:
        return False

    def summarize(self, metrics: dict[str, float], n_updates: int) -> dict[str, float]:
        return {}

    # ------------------------------------------------------------------ the stage's own steps
    def collate(self, collator: Any, examples: list[Example]) -> Rollout:
        return collator.pairs(examples) if self.pairs else collator.demonstrations(examples)

    def prepare(self, batch: Rollout, trainer: Any) -> Rollout:
        """The batch with what the loss needs beside the policy's forward pass (a reference pass)."""
        return batch

    def batch_metrics(self, batch: Rollout) -> dict[str, float]:
        """The stage's own metrics of a training batch's layout (logged with the step's)."""
        return {}

    def held_out_metrics(self, trainer: Any, examples: list[Example]) -> dict[str, float]:
        """``eval/…`` metrics of the stage's loss on held-out examples."""
        return {}


def to_device(batch: Rollout, device: torch.device) -> Rollout:
    """The batch (frozen) with its tensors on ``device``."""
    return replace(batch, **{name: value.to(device) for name, value in vars(batch).items()
                             if isinstance(value, torch.Tensor)})


def chunks(examples: list[Example], size: int = EVAL_CHUNK) -> list[list[Example]]:
    return [examples[start : start + size] for start in range(0, len(examples), size)]
