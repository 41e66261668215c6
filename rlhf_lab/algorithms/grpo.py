"""GRPO (Shao et al. 2024, DeepSeekMath): group-normalised advantages, clipped ratio objective."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rlhf_lab.algorithms.base import Algorithm
from rlhf_lab.registry import register


def group_advantages(returns: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-4) -> Tensor:
    """A_i = (R_i − mean_group(R)) / (std_group(R) + eps) for G consecutive samples per prompt.

    ``scale_by_std=False`` drops the division (Dr. GRPO, Liu et al. 2025), which removes the bias
    towards groups with low reward spread. std is Bessel-corrected, as in GRPO's reference code.
    returns: [B] with B = prompts × G -> [B].
    """
    groups = returns.reshape(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


@register("algorithm", "grpo")
class GRPO(Algorithm):
    @classmethod
    def min_group_size(cls, cfg: Any) -> int:
        return 2  # a group of one has no spread to normalise by

    def sequence_advantages(self, returns: Tensor, group_size: int) -> Tensor:
        return group_advantages(returns, group_size, self.cfg.scale_by_std)
