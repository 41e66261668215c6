"""The algorithm interface and the pure tensor functions the critic-free algorithms share.

An algorithm turns a scored rollout into advantages (``prepare``) and, for a mini-batch, the new
policy's log-probs into a loss (``loss``). The trainer calls only these methods; it never asks which
algorithm it runs. Per-token tensors are [B, T]; ``mask`` is the response mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.ops import masked_mean, masked_sum, masked_whiten
from rlhf_lab.rollout import Rollout

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean")
WEIGHT_SOURCES = ("advantage", "reward")


@dataclass
class LossContext:
    """How a micro-batch's loss is normalised so accumulated micro-batches equal one mini-batch."""

    minibatch_tokens: float  # valid response tokens in the mini-batch
    minibatch_rows: int  # samples in the mini-batch


@dataclass
class PolicyOutput:
    """The training forward pass over a micro-batch."""

    logprobs: Tensor  # [B, T] with gradient
    logits: Tensor  # [B, T, V] temperature-scaled, with gradient
    hidden: Tensor | None  # [B, T, H] last hidden states predicting each response token (if requested)


def sequence_returns(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Undiscounted return of each sequence: Σ_t r_t over valid tokens, [B, T] -> [B]."""
    return masked_sum(token_rewards, mask, dim=-1)


def aggregate(per_token: Tensor, mask: Tensor, mode: str, context: LossContext) -> Tensor:
    """Reduce a per-token loss to a scalar.

    token_mean: Σ loss·mask / (tokens in the mini-batch), every token weighs the same (DAPO, Dr. GRPO);
    sequence_mean: mean over sequences of each sequence's token mean (the original GRPO).
    Dividing by mini-batch totals makes gradient accumulation over micro-batches exact.
    """
    if mode == "token_mean":
        return masked_sum(per_token, mask) / max(context.minibatch_tokens, 1.0)
    if mode == "sequence_mean":
        return masked_mean(per_token, mask, dim=-1).sum() / max(context.minibatch_rows, 1)
    raise ValueError(f"algorithm.loss_aggregation={mode!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")


def clipped_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float | None,
    clip_high: float | None,
) -> tuple[Tensor, Tensor]:
    """Per-token clipped surrogate (Schulman et al. 2017) and where the clip binds.

    ratio = exp(log π − log π_old); loss = max(−A·ratio, −A·clip(ratio, 1−ε_low, 1+ε_high)).
    With no clip it is −A·ratio, whose gradient at ratio = 1 is the REINFORCE gradient −A·∇log π.
    Returns (loss [B, T], clipped [B, T] as 0/1 floats).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    if clip_low is None and clip_high is None:
        return unclipped * mask, torch.zeros_like(mask)
    low = 1.0 - (clip_low if clip_low is not None else float("inf"))
    high = 1.0 + (clip_high if clip_high is not None else float("inf"))
    clipped = -advantages * ratio.clamp(low, high)
    loss = torch.maximum(unclipped, clipped)
    binds = (clipped > unclipped).float()
    return loss * mask, binds * mask


def policy_weights(advantages: Tensor, returns: Tensor, weight_by: str, clamp_negative: bool) -> Tensor:
    """The per-sequence weight of ∇log π: the advantage, or (TapeAgents rl_step option) the raw return.

    ``clamp_negative`` sets negative weights to 0, so only better-than-baseline samples are reinforced.
    Inputs and output are [B].
    """
    if weight_by not in WEIGHT_SOURCES:
        raise ValueError(f"algorithm.weight_by={weight_by!r}; valid: {', '.join(WEIGHT_SOURCES)}")
    weights = advantages if weight_by == "advantage" else returns
    return weights.clamp(min=0.0) if clamp_negative else weights


class Algorithm:
    """A critic-free policy-gradient algorithm; subclasses define ``sequence_advantages``."""

    needs_hidden_states = False  # True when the loss needs the trunk's hidden states (a value head)

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.clip_low = cfg.clip_eps_low if cfg.clip_eps_low is not None else cfg.clip_eps
        self.clip_high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps

    def sequence_advantages(self, returns: Tensor, group_size: int) -> Tensor:  # [B] -> [B]
        raise NotImplementedError

    def modules(self) -> dict[str, nn.Module]:
        """Extra trainable modules (a critic), saved and restored with checkpoints."""
        return {}

    def setup(self, policy: nn.Module) -> None:
        """Build extra modules once the policy exists."""

    def prepare(self, rollout: Rollout, forward: Any = None) -> dict[str, float]:
        """Fill ``rollout.advantages`` ([B, T]) from ``rollout.token_rewards``; return statistics."""
        mask = rollout.response_mask
        returns = sequence_returns(rollout.token_rewards, mask)
        advantages = self.sequence_advantages(returns, rollout.group_size)
        weights = policy_weights(advantages, returns, self.cfg.weight_by, self.cfg.clamp_negative_weights)
        token_weights = weights[:, None] * mask
        if self.cfg.whiten_advantages:
            token_weights = masked_whiten(token_weights, mask)
        rollout.advantages = token_weights
        rollout.returns = returns[:, None] * mask
        return {"advantages/mean": masked_mean(token_weights, mask).item(), "returns/mean": returns.mean().item()}

    def loss(self, batch: Rollout, output: PolicyOutput, context: LossContext) -> tuple[Tensor, dict[str, Tensor]]:
        """Policy loss of a micro-batch and its statistics (sums over the micro-batch's tokens)."""
        mask = batch.response_mask
        per_token, clipped = clipped_policy_loss(
            output.logprobs, batch.logprobs, batch.advantages, mask, self.clip_low, self.clip_high
        )
        loss = aggregate(per_token, mask, self.cfg.loss_aggregation, context)
        log_ratio = (output.logprobs - batch.logprobs).detach()
        stats = {
            "loss/policy": loss.detach(),
            "policy/clipfrac": masked_sum(clipped, mask) / context.minibatch_tokens,
            # k3 estimate of KL(π_old‖π_new), the PPO "approx_kl".
            "policy/approxkl": masked_sum(torch.expm1(log_ratio) - log_ratio, mask) / context.minibatch_tokens,
        }
        return loss, stats

    def should_stop_epochs(self, stats: dict[str, float]) -> bool:
        """Early stop of the update epochs (PPO's target_kl); never for critic-free algorithms."""
        return False

    def summarize(self, metrics: dict[str, float], n_updates: int) -> dict[str, float]:
        """Extra step metrics from the update metrics (averages over ``n_updates`` mini-batches).

        A loss statistic ``skip_minibatch`` whose sum over a mini-batch's micro-batches is > 0 vetoes that
        mini-batch (no optimizer step); the trainer then reports it as 0/1 per mini-batch, so its average
        here is the fraction of vetoed mini-batches.
        """
        return {}
