"""Where the KL penalty acts (kind ``kl_placement``), registered as ready-made instances (they hold no state),
so ``get("kl_placement", "reward").shape_rewards(...)`` works without constructing anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf_lab.ops import masked_mean
from rlhf_lab.registry import register

Reduce = Callable[[Tensor, Tensor], Tensor]  # (per_token [B, T], mask [B, T]) -> scalar


class RewardPlacement:
    """PPO-style: subtract coef·KL per token from the reward; no gradient flows through the estimate."""

    needs_grad = False

    def reward_penalty(self, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
        """coef · kl.detach() · mask, the per-token amount taken out of the rewards ([B, T]; 0 where masked,
        even if kl is inf there)."""
        kl_on_response = torch.where(mask > 0, kl.detach(), torch.zeros_like(kl))
        return coef * kl_on_response * mask

    def shape_rewards(self, token_rewards: Tensor, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
        """token_rewards − :meth:`reward_penalty`."""
        return token_rewards - self.reward_penalty(kl, coef, mask)

    def loss_term(self, kl: Tensor, mask: Tensor, coef: float | Tensor, reduce: Reduce | None = None) -> Tensor:
        """Zero scalar on ``kl``'s device and dtype: the penalty already acts through the rewards."""
        return kl.new_zeros(())


class LossPlacement:
    """GRPO-style: add coef · reduce(KL) to the loss, with gradient through the estimate."""

    needs_grad = True

    def reward_penalty(self, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
        """Zeros [B, T]: the penalty acts through ``loss_term``."""
        return torch.zeros_like(mask)

    def shape_rewards(self, token_rewards: Tensor, kl: Tensor, coef: float | Tensor, mask: Tensor) -> Tensor:
        """Rewards unchanged: the penalty acts through ``loss_term``."""
        return token_rewards

    def loss_term(self, kl: Tensor, mask: Tensor, coef: float | Tensor, reduce: Reduce | None = None) -> Tensor:
        """coef · reduce(kl, mask) (scalar, differentiable); ``reduce`` defaults to Σ kl·mask / Σ mask. The
        trainer passes the algorithm's ``loss_aggregation``, so the KL term is reduced like the policy loss
        (both scale by the same token or sequence counts, and their ratio stays β)."""
        kl_on_response = torch.where(mask > 0, kl, torch.zeros_like(kl))
        return coef * (reduce or masked_mean)(kl_on_response, mask)


register("kl_placement", "reward")(RewardPlacement())
register("kl_placement", "loss")(LossPlacement())
