"""A training step's metrics over every rank's samples (``reward/*``, ``kl/*``, ``policy/entropy``, ...).

Each rank holds whole prompt groups, in rank order; the statistics here gather or reduce them, so N processes log
what one process logs on the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.masked import masked_mean
from rlhf_lab.runtime import distributed


def rollout_metrics(rollout: Rollout, valid: Tensor, coef: float, kl_per_sequence: Tensor) -> dict[str, Any]:
    """Rewards of the valid samples, the KL estimate and the exact KL beside it (where ``kl.exact=step`` computed
    it), entropy, lengths, and each reward component (``rollout.extras``); ``kl_per_sequence`` [every rank's B] is
    the exact KL (else the estimate) summed over each response."""
    mask = rollout.response_mask
    scores, all_valid = distributed.gather_rows(rollout.scores), distributed.gather_rows(valid)
    metrics: dict[str, Any] = {
        "reward/mean": scores[all_valid].mean().item(),
        "reward/std": scores[all_valid].std().item() if int(all_valid.sum()) > 1 else 0.0,
        "reward/dropped": int((~all_valid).sum()),
        "kl/estimate": masked_mean(rollout.kl_estimate, mask, across_ranks=True).item(),
        "kl/coef": coef,
        "policy/entropy": masked_mean(rollout.entropy, mask, across_ranks=True).item(),
        "response/length_mean": distributed.gather_rows(mask.sum(-1)).mean().item(),
    }
    if rollout.kl_exact is not None:
        metrics["kl/exact"] = masked_mean(rollout.kl_exact, mask, across_ranks=True).item()
        metrics["kl/exact_sequence"] = kl_per_sequence.mean().item()
    for key, value in rollout.extras.items():
        metrics[key] = distributed.gather_rows(value)[all_valid].mean().item()
    return metrics


def sampling_metrics(stats: dict[str, float], samples: int, device: torch.device) -> dict[str, float]:
    """The sampling rules' counts over every rank: refill rounds and groups, truncated and masked shares
    (``samples``: every rank's samples of the step)."""
    keys = sorted(stats)
    counts = distributed.all_reduce_sum(torch.tensor([stats[k] for k in keys], device=device))
    totals = dict(zip(keys, counts.tolist()))
    metrics = {"response/truncated_frac": totals.get("truncated", 0.0) / max(samples, 1)}
    if "masked_truncated" in totals:
        metrics["overlong/masked_frac"] = totals["masked_truncated"] / max(samples, 1)
    if "rounds" in totals:
        metrics["sampling/rounds"] = totals["rounds"] / distributed.world_size()
        for key in ("groups_dropped", "groups_filled", "refill_prompts"):
            metrics[f"sampling/{key}"] = totals[key]
    return metrics
