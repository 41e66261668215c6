"""REINFORCE (Williams 1992) with a baseline, and RLOO (Ahmadian et al. 2024) as its leave-one-out case."""

from __future__ import annotations

from torch import Tensor

from rlhf_lab.algorithms.base import Algorithm
from rlhf_lab.registry import register

BASELINES = ("none", "batch_mean", "loo")


def baseline_advantages(returns: Tensor, group_size: int, baseline: str) -> Tensor:
    """A_i = R_i − b_i, returns [B] -> [B].

    none: b = 0; batch_mean: b = mean over the whole batch; loo: b_i = mean of the other G−1 samples of
    the same prompt, i.e. A_i = G/(G−1) · (R_i − mean_group(R)) (unbiased: b_i does not depend on sample i).
    """
    if baseline == "none":
        return returns.clone()
    if baseline == "batch_mean":
        return returns - returns.mean()
    if baseline == "loo":
        if group_size < 2:
            raise ValueError(f"algorithm.baseline=loo needs algorithm.group_size >= 2, got {group_size}")
        groups = returns.reshape(-1, group_size)
        others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
        return (groups - others_mean).reshape(-1)
    raise ValueError(f"algorithm.baseline={baseline!r}; valid: {', '.join(BASELINES)}")


@register("algorithm", "reinforce")
class Reinforce(Algorithm):
    def sequence_advantages(self, returns: Tensor, group_size: int) -> Tensor:
        return baseline_advantages(returns, group_size, self.cfg.baseline)


# `rloo` is REINFORCE whose config sets baseline: loo; both names resolve to the same code.
register("algorithm", "rloo")(Reinforce)
