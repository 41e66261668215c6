"""REINFORCE (Williams 1992) with a baseline, and RLOO (Ahmadian et al. 2024) as its leave-one-out case.

Baselines are registered under kind ``baseline`` (``algorithm.baseline``): returns [B] -> advantages [B].
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlhf_lab import distributed
from rlhf_lab.algorithms.base import Algorithm
from rlhf_lab.registry import get, register


@register("baseline", "none")
def no_baseline(returns: Tensor, group_size: int) -> Tensor:
    """A_i = R_i (b = 0)."""
    return returns.clone()


@register("baseline", "batch_mean")
def batch_mean_baseline(returns: Tensor, group_size: int) -> Tensor:
    """A_i = R_i − mean over the whole batch (every rank's samples)."""
    return returns - distributed.mean(returns)


@register("baseline", "loo")
def leave_one_out_baseline(returns: Tensor, group_size: int) -> Tensor:
    """A_i = R_i − mean of the other G−1 samples of the same prompt = G/(G−1) · (R_i − mean_group(R)).

    Unbiased: b_i does not depend on sample i.
    """
    if group_size < 2:
        raise ValueError(f"algorithm.baseline=loo needs algorithm.group_size >= 2, got {group_size}")
    groups = returns.reshape(-1, group_size)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others_mean).reshape(-1)


def baseline_advantages(returns: Tensor, group_size: int, baseline: str) -> Tensor:
    """A_i = R_i − b_i with the registered ``baseline``, returns [B] -> [B]."""
    return get("baseline", baseline)(returns, group_size)


@register("algorithm", "reinforce")
class Reinforce(Algorithm):
    @classmethod
    def min_group_size(cls, cfg: Any) -> int:
        return 2 if cfg.baseline == "loo" else 1

    def sequence_advantages(self, returns: Tensor, group_size: int) -> Tensor:
        return baseline_advantages(returns, group_size, self.cfg.baseline)


# `rloo` is REINFORCE whose config sets baseline: loo; both names resolve to the same code.
register("algorithm", "rloo")(Reinforce)
