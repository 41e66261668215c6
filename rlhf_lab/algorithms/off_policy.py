"""Off-policy corrections that take samples or tokens out of the loss, beside the weights of
:func:`~rlhf_lab.algorithms.losses.sampler_correction` (``algorithm.tis_mode``).

A weight of 0 leaves a token in the loss's denominator (TIS, IcePop, AReaL's decoupled PPO); the rejections here
remove it from the response mask, so the tokens that remain are averaged among themselves (verl's rejection
sampling, AReaL's M2PO). μ is the sampler's per-token log-probs (each token's own policy version's), π_old the
trainer's.

- ``geo_mask`` (verl's geometric-mean rejection, Geo-RS): a sequence whose geometric mean ratio
  exp(mean_t log π_old(y_t)/μ(y_t)) lies outside [floor, cap] leaves the loss.
- ``m2po`` (M2PO, arXiv 2510.01161, as AReaL runs it): the rank's tokens of largest (log μ − log π_old)² leave the
  loss, largest first, until the mean second moment of those that remain is below τ (``algorithm.m2po_tau``).
- :func:`off_policy_sequence_mask` (DeepSeek-V3.2, TRL's ``off_policy_mask_threshold``): in the loss, a token of
  negative advantage whose sequence's mean log(μ/π_θ) exceeds δ leaves the policy term.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_lab.algorithms.losses import band_floor


def rejected(train_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, mode: str, cap: float,
             floor: float | None = None, tau: float = 0.04) -> Tensor | None:
    """The tokens ``algorithm.tis_mode`` keeps in the loss ([B, T] 0/1, a subset of ``mask``), None where it removes
    none by rule (every other mode)."""
    log_ratio = (train_logprobs - sampler_logprobs).detach() * mask
    if mode == "geo_mask":
        tokens = mask.sum(-1, keepdim=True).clamp(min=1.0)
        geometric = torch.exp(log_ratio.sum(-1, keepdim=True) / tokens)
        inside = (geometric >= band_floor(cap, floor)) & (geometric <= cap)
        return mask * inside
    if mode == "m2po":
        return mask * second_moment_keep(log_ratio, mask, tau)
    return None


def second_moment_keep(log_ratio: Tensor, mask: Tensor, tau: float) -> Tensor:
    """M2PO's greedy rule: the valid tokens sorted by (log r)², largest first; the fewest largest dropped such that
    the mean of those left is below ``tau`` (strictly). [B, T] 0/1."""
    squared = (log_ratio ** 2)[mask > 0]
    order = squared.argsort(descending=True)
    ranked = squared[order]
    # Mean of the tokens left after dropping the first k, for k = 0 .. n − 1; the first k where it is below tau.
    remaining = ranked.flip(0).cumsum(0).flip(0)  # remaining[k] = Σ ranked[k:]
    counts = torch.arange(len(ranked), 0, -1, dtype=ranked.dtype, device=ranked.device)
    below = (remaining / counts) < tau
    drop = int(below.float().argmax()) if bool(below.any()) else len(ranked)
    kept = torch.ones_like(squared)
    kept[order[:drop]] = 0.0
    keep = torch.zeros_like(mask)
    keep[mask > 0] = kept
    return keep


def off_policy_sequence_mask(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                             threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence masking ([B, T] 0/1): 0 on a token whose advantage is negative and whose
    sequence's mean log μ(y_t) − log π_θ(y_t) (the current policy's, detached) exceeds ``threshold``; the
    positive-advantage tokens always stay (what the current policy learns from them is safe)."""
    tokens = mask.sum(-1, keepdim=True).clamp(min=1.0)
    divergence = ((behaviour_logprobs - logprobs.detach()) * mask).sum(-1, keepdim=True) / tokens
    return 1.0 - ((advantages < 0) & (divergence > threshold)).to(mask.dtype)
