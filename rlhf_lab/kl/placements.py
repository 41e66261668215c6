"""Where the KL penalty acts (``kl.placement``), and the run's KL penalty applied at its two points of a step.

The placements (kind ``kl_placement``) are registered as ready-made instances (they hold no state), so
``get("kl_placement", "reward").shape_rewards(...)`` works without constructing anything:

- ``reward``: coef × estimate per token comes out of the token rewards when the rollout is scored, with no
  gradient through the estimate (PPO-style);
- ``loss``: coef × the aggregated estimate is added to every micro-batch's loss, with gradient (GRPO-style).

:class:`KLPenalty` is the run's penalty: the configured estimator with its options, at both points of the step —
:meth:`KLPenalty.reward_terms` when the rollout is scored (the estimate, the exact KL beside it, the reward half)
and :meth:`KLPenalty.loss_term` in every micro-batch's loss (the loss half). The trainer calls those two and
never asks which placement it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import rlhf_lab.kl.corrections  # noqa: F401  (registers kind kl_correction)
from rlhf_lab.kl.estimators import estimate, importance_weights
from rlhf_lab.kl.exact import exact_kl
from rlhf_lab.masked import masked_mean
from rlhf_lab.registry import get, register

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


class KLPenalty:
    """The run's KL penalty (``cfg.kl``): estimator ``kl.name``, placement ``kl.placement``, and the estimate's
    options (``clamp_log_ratio``, ``clamp_value``, ``importance_weight``, ``off_policy_correction``)."""

    def __init__(self, kl_cfg: Any) -> None:
        self.estimator = get("kl", kl_cfg.name)
        self.placement = get("kl_placement", kl_cfg.placement)
        self.clamp_log_ratio = kl_cfg.get("clamp_log_ratio")
        self.clamp_value = kl_cfg.get("clamp_value")
        self.importance_weight = bool(kl_cfg.get("importance_weight", False))
        self.scale_like_advantages = kl_cfg.get("loss_scale", "none") == "advantage"
        self.off_policy_weights = get("kl_correction", kl_cfg.get("off_policy_correction", "policy"))

    @property
    def reads_logits(self) -> bool:
        """Whether the estimator reads the full-vocabulary logits (``full``, ``sequence_full``)."""
        return bool(getattr(self.estimator, "needs_logits", False))

    @property
    def in_loss(self) -> bool:
        """Whether a loss term is added (``kl.placement=loss``)."""
        return bool(self.placement.needs_grad)

    @property
    def loss_reads_ref_logits(self) -> bool:
        """Whether the loss term needs the reference's full logits kept until the update."""
        return self.in_loss and self.reads_logits

    def estimate(self, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, logits: Tensor | None = None,
                 ref_logits: Tensor | None = None) -> Tensor:
        """The configured estimator's per-token values [B, T], with its clamps (:func:`~rlhf_lab.kl.estimate`)."""
        return estimate(self.estimator, logprobs, ref_logprobs, logits=logits, ref_logits=ref_logits, mask=mask,
                        clamp_log_ratio=self.clamp_log_ratio, clamp_value=self.clamp_value)

    @torch.no_grad()
    def sampled_terms(self, rollout: Any, exact: bool = True) -> tuple[Tensor, Tensor | None]:
        """(estimate, exact) per-token KL of π_old from the reference, masked: [B, T] each; the exact one from
        both full logits (the ``kl/exact`` diagnostic) only with ``exact`` (else None)."""
        mask = rollout.response_mask
        estimated = self.estimate(rollout.logprobs, rollout.ref_logprobs, mask, rollout.policy_logits,
                                  rollout.ref_logits) * mask
        return estimated, exact_kl(rollout.policy_logits, rollout.ref_logits) * mask if exact else None

    def reward_terms(self, rollout: Any, coef: float) -> dict[str, Any]:
        """When the rollout is scored, its ``kl_coef`` and ``kl_penalty``: what the placement takes out of the token
        rewards (coef × estimate for ``reward``, zeros for ``loss``), from the ``kl_estimate`` the reference pass
        gave it (:meth:`sampled_terms`). Returned, for the experience to put into its scored batch."""
        return {"kl_coef": coef,
                "kl_penalty": self.placement.reward_penalty(rollout.kl_estimate, coef, rollout.response_mask)}

    def loss_term(self, logprobs: Tensor, logits: Tensor | None, batch: Any, coef: float,
                  reduce: Reduce) -> Tensor | None:
        """In a micro-batch's loss: coef × reduce(estimate) with gradient under ``kl.placement=loss`` (``reduce``
        is the policy loss's aggregation, so the two keep the ratio β); None under ``reward``. With
        ``importance_weight`` the estimate on samples of π_old (later epochs or mini-batches) is reweighted by
        sg(π_θ/π_old), so its expectation is under π_θ. With ``loss_scale=advantage`` each sample's estimate is
        multiplied by the factor its advantage gave the task reward (``Rollout.kl_loss_scale``): under GRPO's
        std division the regulariser keeps its weight β against the task reward as the groups' spread shrinks.
        ``off_policy_correction`` weighs it for samples of a behaviour policy μ (:mod:`.corrections`): by default
        (``policy``) as the policy loss under ``algorithm.tis_cap`` — the samples are the engine's, the KL is the
        trainer's policy's (``SAMPLER_CORRECTION`` in :mod:`.truth`) — or by the estimator's own ratio π_θ/μ
        (``token_ratio``, ``prefix_ratio``: ``OFF_POLICY_KL_GRADIENT``)."""
        if not self.in_loss:
            return None
        mask = batch.response_mask
        values = self.estimate(logprobs, batch.ref_logprobs, mask, logits, batch.ref_logits)
        if self.importance_weight:
            values = values * importance_weights(logprobs, batch.logprobs, mask)
        if self.scale_like_advantages:  # each sample's term × the factor its advantage gave the task reward
            values = values * batch.kl_loss_scale[:, None].to(values.dtype)
        weights = self.off_policy_weights(logprobs, batch, mask)  # samples of μ, expectation under π
        if weights is not None:
            values = values * weights
        return self.placement.loss_term(values, mask, coef, reduce=reduce)
