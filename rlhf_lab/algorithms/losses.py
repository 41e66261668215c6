"""Policy losses (kind ``policy_loss``, ``algorithm.policy_loss``): the surrogate whose gradient moves the policy.

Each is ``loss(logprobs, old_logprobs, advantages, mask, clip) -> PolicyLoss`` over [B, T] tensors: the
per-token loss (0 on padding, reduced later by ``loss_aggregation``), the importance ratio it used, and 0/1
masks of the tokens each of its rules touched (logged as shares). ``logprobs`` carry the gradient;
``old_logprobs`` are the sampling policy's (π_old).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhf_lab.registry import register


@dataclass
class ClipRange:
    """Ratio bounds: [1 − low, 1 + high] (None: unbounded on that side); ``dual``: Dual-clip's c (Ye et al.
    2020), bounding the loss of negative-advantage tokens by −c·A; None: off. ``tau``: the weight of a loss's
    squared log-ratio term (``dppo``'s τ, ``algorithm.dppo_tau``)."""

    low: float | None = 0.2
    high: float | None = 0.2
    dual: float | None = None
    tau: float = 0.0

    def bounds(self) -> tuple[float, float]:
        return (1.0 - (self.low if self.low is not None else float("inf")),
                1.0 + (self.high if self.high is not None else float("inf")))


@dataclass
class PolicyLoss:
    per_token: Tensor  # [B, T] loss, 0 on padding
    ratio: Tensor  # [B, T] importance ratio (detached), 1 where it plays no part
    events: dict[str, Tensor] = field(default_factory=dict)  # name -> [B, T] 0/1, tokens a rule touched


def _ppo_clip(ratio: Tensor, advantages: Tensor, mask: Tensor, clip: ClipRange) -> PolicyLoss:
    """max(−A·r, −A·clip(r)) (−A·r with no clip range), then Dual-clip's bound, with where each rule binds."""
    loss = -advantages * ratio
    detached = ratio.detach()
    events: dict[str, Tensor] = {}
    if clip.low is not None or clip.high is not None:
        low, high = clip.bounds()
        clipped = -advantages * ratio.clamp(low, high)
        binds = clipped > loss
        loss = torch.maximum(loss, clipped)
        events = {"clipped_low": (binds & (detached < 1)).float() * mask,
                  "clipped_high": (binds & (detached > 1)).float() * mask}
    if clip.dual is not None:  # with or without the clip range: a negative-advantage token's loss ≤ −c·A
        bound = -clip.dual * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        events["dual_clipped"] = dual.float() * mask
    return PolicyLoss(loss * mask, detached, events)


@register("policy_loss", "clip")
def clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              clip: ClipRange) -> PolicyLoss:
    """PPO's clipped surrogate (Schulman et al. 2017), per token: r = π/π_old,
    loss = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)); separate ε_low/ε_high is DAPO's clip-higher (Yu et al.
    2025); with Dual-clip c, negative-advantage tokens' loss is at most −c·A. No clip: −A·r, whose gradient at
    r = 1 is REINFORCE's (Dual-clip still bounds it: r counts at most c where A < 0)."""
    return _ppo_clip(torch.exp(logprobs - old_logprobs), advantages, mask, clip)


@register("policy_loss", "gspo")
def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              clip: ClipRange) -> PolicyLoss:
    """GSPO (Zheng et al. 2025): the sequence's length-normalised ratio s = exp(mean_t log(π/π_old)) clipped in
    place of the token ratio. Token form: s_t = sg(s)·π(y_t)/sg(π(y_t)), equal to s in value, whose gradient
    is s·∇log π(y_t); loss = max(−A·s_t, −A·clip(s_t)) with GSPO's small ε (e.g. 3e-4 / 4e-4)."""
    lengths = mask.sum(-1).clamp(min=1.0)
    sequence_log_ratio = ((logprobs - old_logprobs) * mask).sum(-1) / lengths  # [B]
    token_log_ratio = sequence_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    return _ppo_clip(torch.exp(token_log_ratio), advantages, mask, clip)


@register("policy_loss", "cispo")
def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
               clip: ClipRange) -> PolicyLoss:
    """CISPO (MiniMax-M1, 2025): the importance weight is clipped and stopped, never the gradient:
    loss = −sg(clip(r, 1−ε_low, 1+ε_high))·A·log π(y_t), so every token keeps a gradient."""
    ratio = torch.exp(logprobs - old_logprobs).detach()
    low, high = clip.bounds()
    weight = ratio.clamp(low, high)
    events = {"clipped_low": (ratio < low).float() * mask, "clipped_high": (ratio > high).float() * mask}
    return PolicyLoss(-weight * advantages * logprobs * mask, ratio, events)


@register("policy_loss", "reinforce")
def reinforce_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                   clip: ClipRange) -> PolicyLoss:
    """REINFORCE (Williams 1992), no ratio: loss = −A·log π(y_t); its gradient is −A·∇log π at any π_old."""
    return PolicyLoss(-advantages * logprobs * mask, torch.ones_like(logprobs), {})


@register("policy_loss", "dppo")
def dppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              clip: ClipRange) -> PolicyLoss:
    """prime-rl's default loss (its "DPPO+KL"), against the behaviour policy μ (``old_logprobs`` here are the
    sampler's: :attr:`reads_behaviour`): r = π/μ with gradient and no clip; a token leaves the policy term where the
    probabilities themselves moved past the trust region in the advantage's direction — A > 0 and π − μ > ``high``,
    or A ≤ 0 and π − μ < −``low`` (a difference of probabilities, not of ratios); every token then adds
    τ·(log r)², which pulls π back towards μ: loss_t = −keep_t·A·r + τ·(log π − log μ)²."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    difference = (logprobs.exp() - old_logprobs.exp()).detach()
    low, high = (bound if bound is not None else float("inf") for bound in (clip.low, clip.high))
    above = (advantages > 0) & (difference > high)
    below = (advantages <= 0) & (difference < -low)
    keep = (~(above | below)).float()
    per_token = -keep * advantages * ratio + clip.tau * log_ratio ** 2
    return PolicyLoss(per_token * mask, ratio.detach(),
                      {"clipped_high": above.float() * mask, "clipped_low": below.float() * mask})


dppo_loss.reads_behaviour = True  # its old_logprobs are μ's (the sampler's), not π_old's


def truncated_importance_weights(train_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
    w = min(π_train(y) / π_sampler(y), cap) per token, for when generation and training compute log-probs
    differently (another dtype or engine); [B, T], no gradient."""
    return torch.exp(train_logprobs - sampler_logprobs).clamp(max=cap).detach()


CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop", "geo_mask", "m2po",
               "none")
BANDED = ("icepop", "geo_mask")  # the corrections with a lower bound too (``algorithm.tis_floor``; null: 1 / cap)


def sampler_correction(train_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, cap: float,
                       mode: str = "token_truncate", floor: float | None = None) -> Tensor:
    """The weight of each token's loss for samples drawn by the engine (π_sampler, μ) and scored by the trainer
    (π_train = π_old, AReaL's proximal policy), no gradient, 0 off the response (``algorithm.tis_cap``,
    ``algorithm.tis_mode``). The tokens it zeroes stay in the loss's denominator; the corrections that take samples
    out of the loss altogether are :func:`rlhf_lab.algorithms.off_policy.rejected` (``geo_mask``, ``m2po``).

    - ``token_truncate``: w_t = min(r_t, C) with r_t = π_train(y_t) / μ(y_t) (TIS);
    - ``token_mask``: w_t = r_t where r_t ≤ C, else 0 (the token leaves the loss) — with the clipped surrogate this is
      AReaL's decoupled PPO (π_old the proximal policy, μ the behaviour policy, ``behav_imp_weight_cap`` C);
    - ``sequence_truncate`` / ``sequence_mask``: the same with the sequence's ratio Π_t r_t on every token;
    - ``icepop``: w_t = r_t where floor ≤ r_t ≤ C, else 0 (IcePop's two-sided token mask, arXiv 2510.18855);
    - ``geo_mask``: w_t = 1 (verl's geometric-mean rejection: the sequences outside the band leave the loss);
    - ``m2po``: ``token_mask``'s weights (M2PO's tokens of largest second moment leave the loss);
    - ``none``: w_t = 1 (the control arm: the log-probs rescored, the samples left uncorrected).

    μ's log-probs are per token: under asynchronous sampling each token's own sampler's (its policy version's), so a
    sequence's ratio Π_t π_train(y_t) / μ_t(y_t) is the ratio of the probabilities of the sequence under the two.
    The token and sequence modes are TRL's ``vllm_importance_sampling_mode`` and verl's rollout correction."""
    if mode not in CORRECTIONS:
        raise ValueError(f"algorithm.tis_mode={mode!r}; valid: {', '.join(CORRECTIONS)}")
    if mode in ("none", "geo_mask"):
        return torch.ones_like(mask) * mask
    log_ratio = (train_logprobs - sampler_logprobs).detach() * mask
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap) * mask
    low = band_floor(cap, floor) if mode == "icepop" else 0.0
    return torch.where((ratio <= cap) & (ratio >= low), ratio, 0.0) * mask


def band_floor(cap: float, floor: float | None) -> float:
    """The lower bound of a two-sided band: ``algorithm.tis_floor``, or 1 / ``tis_cap`` where it is null (verl's)."""
    return 1.0 / cap if floor is None else floor
