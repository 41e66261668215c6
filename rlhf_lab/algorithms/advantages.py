"""Advantage estimators (kind ``advantage``, ``algorithm.advantage``): token rewards -> per-token advantages.

Each is ``estimator(token_rewards [B, T], mask [B, T], group_size, cfg) -> advantages [B, T]`` (0 on
padding), where ``token_rewards`` hold the sequence score on each response's last token minus the per-token KL
penalty of a reward-placed KL; rows are grouped (row i answers prompt i // group_size). Sequence-level
estimators reduce to the return R = Σ_t r_t and give every token of a response the same advantage.
Batch statistics (means, whitening) run over every rank's samples. ``gae`` belongs to PPO (it needs a critic).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_lab.masked import masked_sum, masked_whiten
from rlhf_lab.registry import get, register
from rlhf_lab.runtime import distributed


def sequence_returns(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Undiscounted return of each sequence: Σ_t r_t over valid tokens, [B, T] -> [B]."""
    return masked_sum(token_rewards, mask, dim=-1)


def rewards_to_go(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """Σ_{t' ≥ t} r_t' over valid tokens (γ = 1), [B, T] -> [B, T], 0 on padding."""
    rewards = token_rewards * mask
    return rewards.flip(-1).cumsum(-1).flip(-1) * mask


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


# ----------------------------------------------------------------------------------------- baselines
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


# ---------------------------------------------------------------------- the scale of a loss-placed KL
# What an estimator's advantages do to the task reward's expected gradient, per sample [B], so a loss-placed KL
# term can be given the same factor (``kl.loss_scale=advantage``). REINFORCE's R (or R minus a baseline that does
# not depend on the sample: leave-one-out, ReMax's greedy score) is exact: 1. A mean baseline that includes the
# sample scales it by (1 − 1/n). GRPO also divides a group by (std + ε): its samples get (1 − 1/G) / (std + ε), and
# a group whose returns are all equal the mean factor of the others. Estimators without a factor here (REINFORCE++'s
# whitening, GAE) refuse the option.
def _exact_scale(returns: Tensor, group_size: int, cfg: Any) -> Tensor:
    return torch.ones_like(returns)


def _group_mean_scale(returns: Tensor, group_size: int, cfg: Any) -> Tensor:
    return torch.full_like(returns, 1 - 1 / group_size)


def _grpo_scale(returns: Tensor, group_size: int, cfg: Any) -> Tensor:
    if not getattr(cfg, "scale_by_std", True):
        return _group_mean_scale(returns, group_size, cfg)
    groups = returns.reshape(-1, group_size)
    std = groups.std(dim=1, keepdim=True)
    factor = (1 - 1 / group_size) / (std + getattr(cfg, "std_eps", 1e-4))
    untied = std > 0
    # A group of equal returns has no advantage to match (and 1/ε would be its factor): it takes the mean factor of
    # every rank's other groups, so the KL keeps its weight where the policy has stopped exploring.
    total, count = distributed.all_reduce_sum(torch.stack([factor[untied].sum(), untied.sum().to(factor.dtype)]))
    fill = torch.where(count > 0, total / count.clamp(min=1), 1 - 1 / group_size)  # on the device: no host sync
    return torch.where(untied, factor, fill).expand_as(groups).reshape(-1)


def _reinforce_scale(returns: Tensor, group_size: int, cfg: Any) -> Tensor:
    if cfg.baseline == "batch_mean":  # the mean over every rank's samples includes the sample itself
        return torch.full_like(returns, 1 - 1 / (returns.numel() * distributed.world_size()))
    return _exact_scale(returns, group_size, cfg)


def kl_loss_scale(advantage: str, returns: Tensor, group_size: int, cfg: Any) -> Tensor | None:
    """The factor [B] the estimator ``advantage`` gives each sample's task-reward gradient; None where it has
    none (see the comment above)."""
    scale = getattr(get("advantage", advantage), "kl_loss_scale", None)
    return None if scale is None else scale(returns, group_size, cfg)


# ---------------------------------------------------------------------------------------- estimators
def per_token(sequence_advantages: Tensor, mask: Tensor) -> Tensor:
    return sequence_advantages[:, None] * mask


@register("advantage", "grpo")
def grpo(token_rewards: Tensor, mask: Tensor, group_size: int, cfg: Any) -> Tensor:
    """GRPO (Shao et al. 2024): (R − mean_group) / (std_group + ε), ε = ``algorithm.std_eps`` (1e-4, TRL's;
    verl's is 1e-6); ``algorithm.scale_by_std=false`` skips the division."""
    returns = sequence_returns(token_rewards, mask)
    return per_token(group_advantages(returns, group_size, cfg.scale_by_std, getattr(cfg, "std_eps", 1e-4)), mask)


@register("advantage", "dr_grpo")
def dr_grpo(token_rewards: Tensor, mask: Tensor, group_size: int, cfg: Any) -> Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): R − mean_group, no std division."""
    return per_token(group_advantages(sequence_returns(token_rewards, mask), group_size, False), mask)


@register("advantage", "rloo")
def rloo(token_rewards: Tensor, mask: Tensor, group_size: int, cfg: Any) -> Tensor:
    """RLOO (Ahmadian et al. 2024): R_i − mean of the group's other samples."""
    return per_token(leave_one_out_baseline(sequence_returns(token_rewards, mask), group_size), mask)


@register("advantage", "reinforce")
def reinforce(token_rewards: Tensor, mask: Tensor, group_size: int, cfg: Any) -> Tensor:
    """REINFORCE (Williams 1992): R − b with ``algorithm.baseline`` none | batch_mean | loo."""
    return per_token(baseline_advantages(sequence_returns(token_rewards, mask), group_size, cfg.baseline), mask)


@register("advantage", "reinforce_pp")
def reinforce_pp(token_rewards: Tensor, mask: Tensor, group_size: int, cfg: Any) -> Tensor:
    """REINFORCE++ (Hu 2025): token-level rewards-to-go (the KL penalty per token when ``kl.placement=reward``),
    whitened over every valid token of the batch (global normalisation, no critic, no groups)."""
    return masked_whiten(rewards_to_go(token_rewards, mask), mask, across_ranks=True)


@register("advantage", "reinforce_pp_baseline")
def reinforce_pp_baseline(token_rewards: Tensor, mask: Tensor, group_size: int, cfg: Any) -> Tensor:
    """REINFORCE++-baseline (Hu 2025): R − mean_group, then whitened over every valid token of the batch."""
    centred = group_advantages(sequence_returns(token_rewards, mask), group_size, scale_by_std=False)
    return masked_whiten(per_token(centred, mask), mask, across_ranks=True)


REMAX_RETURNS = ("total", "to_go")  # algorithm.remax_return


@register("advantage", "remax")
def remax(token_rewards: Tensor, mask: Tensor, group_size: int, cfg: Any,
          baseline_scores: Tensor | None = None) -> Tensor:
    """ReMax (Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models"): return − r(x, ȳ), the baseline being the reward of the prompt's greedy
    response ȳ (``baseline_scores`` [B], one extra greedy generation per prompt, made by the experience step).

    ``algorithm.remax_return``: ``total`` puts the whole return R_i on every token, as every other sequence
    estimator here (GRPO, RLOO, REINFORCE), so under a reward-placed KL the arms differ by their baseline only;
    ``to_go`` puts token t's reward-to-go Σ_{t' ≥ t} r_t' there (verl's ``compute_remax_outcome_advantage``),
    which leaves out the KL terms of earlier tokens, which token t cannot change. Both are unbiased; they are the
    same without a reward-placed KL (the only reward is the score on the last token)."""
    if baseline_scores is None:
        raise ValueError("algorithm.advantage=remax needs the greedy responses' scores (baseline_scores)")
    if getattr(cfg, "remax_return", "total") == "to_go":
        return (rewards_to_go(token_rewards, mask) - baseline_scores[:, None]) * mask
    return per_token(sequence_returns(token_rewards, mask) - baseline_scores, mask)


remax.needs_greedy_baseline = True  # type: ignore[attr-defined]  (read by the experience step)
for _estimator, _scale in ((grpo, _grpo_scale), (dr_grpo, _group_mean_scale), (rloo, _exact_scale),
                           (reinforce, _reinforce_scale), (remax, _exact_scale)):
    _estimator.kl_loss_scale = _scale  # type: ignore[attr-defined]


@register("advantage", "gae")
def gae(token_rewards: Tensor, mask: Tensor, group_size: int, cfg: Any) -> Tensor:
    """GAE (Schulman et al. 2016) needs a critic: it is computed by ``algorithm=ppo`` (algorithms/ppo.py)."""
    raise ValueError("algorithm.advantage=gae needs a critic; use algorithm=ppo")


GROUP_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # need G >= 2 samples per prompt
