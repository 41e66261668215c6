"""The metric names the mode-collapse, diversity and reward-rescale code logs are in docs/reference/metrics.md
(``<k>`` stands for a mode's index)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rlhf_lab.testbed.modes import mode_metrics
from rlhf_lab.training.diversity import group_metrics

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md"


def documented() -> set[str]:
    return set(re.findall(r"`([a-z_]+(?:/[a-z_@<>0-9]+)+)`", METRICS_PAGE.read_text(encoding="utf-8")))


def test_every_logged_name_is_documented() -> None:
    log_ref = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=torch.float64).log()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5], dtype=torch.float64)
    names = set(mode_metrics(log_ref, log_ref, log_ref, rewards))
    names |= set(group_metrics(torch.ones(16), ["a b"] * 16, 16, threshold=1.0))
    names |= {"reward/task"}  # rlhf_lab/step/experience.py, under reward.rescale
    names = {re.sub(r"/\d+$", "/<k>", name) for name in names}
    assert names <= documented(), names - documented()
