"""The algorithm interface and the pure tensor functions the critic-free algorithms share.

An algorithm turns a scored rollout into advantages (``prepare``) and, for a micro-batch, the new policy's
forward pass into a :class:`LossResult` (``loss``). It builds its token rewards once, from the rollout's
sequence scores and its per-token KL penalty, contributes its own parameter groups (a critic with its own
learning rate), and may veto a mini-batch through the result's ``veto``. The trainer calls only these
methods; it never asks which algorithm it runs. Per-token tensors are [B, T]; ``mask`` is the response mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.algorithms.advantages import GROUP_ADVANTAGES, kl_loss_scale, sequence_returns
from rlhf_lab.algorithms.losses import ClipRange, band_floor, sampler_correction
from rlhf_lab.algorithms.off_policy import off_policy_sequence_mask, rejected
from rlhf_lab.generation.rollout import Rollout, task_token_rewards
from rlhf_lab.kl.corrections import behaviour_logprobs
from rlhf_lab.masked import masked_mean, masked_sum, masked_whiten
from rlhf_lab.registry import get, register
from rlhf_lab.runtime import distributed
from rlhf_lab.scoring.logprobs import entropy_from_logits

WEIGHT_SOURCES = ("advantage", "reward")


@dataclass
class LossContext:
    """How a micro-batch's loss is normalised so accumulated micro-batches equal one mini-batch."""

    minibatch_tokens: float  # valid response tokens in the mini-batch
    minibatch_rows: int  # samples in the mini-batch
    max_response_tokens: int = 0  # trainer.max_new_tokens: the constant of ``sequence_sum_constant``


@dataclass
class PolicyOutput:
    """The training forward pass over a micro-batch."""

    logprobs: Tensor  # [B, T] with gradient
    logits: Tensor  # [B, T, V] temperature-scaled, with gradient; in float32 where the loss reads them
    # (Algorithm.reads_policy_logits, a logits-reading KL estimator in the loss, temperature ≠ 1), else in the LM
    # head's dtype (the same numbers): then only the log-prob gather reads them, upcasting chunk by chunk
    hidden: Tensor | None  # [B, T, H] last hidden states predicting each response token (if requested)


@dataclass
class LossResult:
    """A micro-batch's loss, its statistics, and an optional veto of the whole mini-batch.

    ``stats`` are the micro-batch's shares of mini-batch quantities (summed over micro-batches they give
    the mini-batch's value). ``veto`` is likewise a share of a margin: when its sum over the mini-batch's
    micro-batches is > 0 the mini-batch takes no optimizer step (PPO's ratio threshold).
    """

    loss: Tensor
    stats: dict[str, Tensor]
    veto: Tensor | None = None
    extrema: dict[str, Tensor] = field(default_factory=dict)  # ``*_max`` / ``*_min``: reduced by max / min


def build_token_rewards(rollout: Rollout, scores: Tensor) -> Tensor:
    """r_t = score·[t = last valid token] − kl_penalty_t, [B, T] (0 on padding); a multi-turn trajectory's
    turn rewards in place of the score (:func:`~rlhf_lab.generation.rollout.task_token_rewards`)."""
    return task_token_rewards(rollout, scores) - rollout.kl_penalty


# --------------------------------------------------------------------------------------------------
# Loss aggregation (kind ``loss_aggregation``): (per_token [B, T], mask, context) -> scalar.
# Dividing by mini-batch totals makes gradient accumulation over micro-batches exact.
# --------------------------------------------------------------------------------------------------


@register("loss_aggregation", "token_mean")
def token_mean(per_token: Tensor, mask: Tensor, context: LossContext) -> Tensor:
    """Σ loss·mask / (valid tokens in the mini-batch): every token weighs the same (DAPO, Yu et al. 2025)."""
    return masked_sum(per_token, mask) / max(context.minibatch_tokens, 1.0)


@register("loss_aggregation", "sequence_mean")
def sequence_mean(per_token: Tensor, mask: Tensor, context: LossContext) -> Tensor:
    """Mean over sequences of each sequence's token mean (the original GRPO, Shao et al. 2024)."""
    return masked_mean(per_token, mask, dim=-1).sum() / max(context.minibatch_rows, 1)


@register("loss_aggregation", "sequence_sum_constant")
def sequence_sum_constant(per_token: Tensor, mask: Tensor, context: LossContext) -> Tensor:
    """Σ loss·mask / (sequences × max_new_tokens): a constant normaliser, no length bias (Dr. GRPO, Liu et al.
    2025), where ``token_mean`` divides by the mini-batch's varying token count."""
    if context.max_response_tokens < 1:
        raise ValueError("loss_aggregation=sequence_sum_constant needs LossContext.max_response_tokens >= 1")
    return masked_sum(per_token, mask) / (max(context.minibatch_rows, 1) * context.max_response_tokens)


def aggregate(per_token: Tensor, mask: Tensor, mode: str, context: LossContext) -> Tensor:
    """Reduce a per-token loss to a scalar with the registered ``loss_aggregation`` named ``mode``."""
    return get("loss_aggregation", mode)(per_token, mask, context)


def policy_weights(advantages: Tensor, scores: Tensor, mask: Tensor, weight_by: str, whiten: bool,
                   clamp_negative: bool) -> Tensor:
    """The per-token weight of ∇log π: advantages [B, T] (or [B]) or raw scores [B] -> [B, T].

    ``weight_by``: ``advantage``, or ``reward`` (TapeAgents ``rl_step``): the raw sequence score, without
    the KL penalty. ``whiten`` whitens the weights over the batch's valid tokens (every rank's);
    ``clamp_negative`` then sets negative weights to 0, so only better-than-baseline samples are reinforced
    (the clamp comes last, so whitening cannot bring negative weights back).
    """
    if weight_by not in WEIGHT_SOURCES:
        raise ValueError(f"algorithm.weight_by={weight_by!r}; valid: {', '.join(WEIGHT_SOURCES)}")
    weights = advantages if weight_by == "advantage" else scores
    token_weights = weights * mask if weights.dim() == 2 else weights[:, None] * mask
    if whiten:
        token_weights = masked_whiten(token_weights, mask, across_ranks=True)  # over every rank's tokens
    return token_weights.clamp(min=0.0) * mask if clamp_negative else token_weights


def entropy_bonus(logits: Tensor, mask: Tensor, context: LossContext) -> Tensor:
    """The micro-batch's share of the mini-batch's mean full-vocabulary entropy (scalar, with gradient)."""
    token_share = float(mask.sum()) / max(context.minibatch_tokens, 1.0)
    return masked_mean(entropy_from_logits(logits), mask) * token_share


class Algorithm:
    """A policy-gradient algorithm composed of an advantage estimator (``algorithm.advantage``) and a policy
    loss (``algorithm.policy_loss``), both looked up in the registry; critic-free as it stands (PPO adds
    a critic and GAE in ``ppo.py``)."""

    needs_hidden_states = False  # True when the loss needs the trunk's hidden states (a value head)
    reads_sampling_hidden = False  # True when prepare reads the decode loop's hidden states (Rollout.hidden)

    @property
    def reads_policy_logits(self) -> bool:
        """True when the loss reads the training pass's full logits (``PolicyOutput.logits``): the entropy
        bonus here; a subclass whose loss reads them otherwise says so, and gets them in float32."""
        return self.cfg.get("entropy_coef", 0.0) > 0

    scales_kl = False  # fill Rollout.kl_loss_scale (the trainer sets it under kl.loss_scale=advantage)

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        # How a sampling-time pass over a whole batch (a critic's values) is cut: the updater's micro-batches
        # (``by_micro_batches(rollout, fn) -> [B, T]``, set by :class:`~rlhf_lab.step.update.Updater`); None: whole.
        self.by_micro_batches: Any = None
        self.clip_low = cfg.clip_eps_low if cfg.clip_eps_low is not None else cfg.clip_eps
        self.clip_high = cfg.clip_eps_high if cfg.clip_eps_high is not None else cfg.clip_eps
        self.clip = ClipRange(self.clip_low, self.clip_high, cfg.get("clip_ratio_c"), float(cfg.get("dppo_tau", 0.0)))

    @classmethod
    def min_group_size(cls, cfg: Any) -> int:
        """The smallest ``algorithm.group_size`` the config can run with (group baselines need 2)."""
        if cfg.get("advantage") in GROUP_ADVANTAGES or cfg.get("baseline") == "loo":
            return 2
        return 1

    def advantages(self, token_rewards: Tensor, mask: Tensor, group_size: int,
                   baseline_scores: Tensor | None = None) -> Tensor:
        """The registered ``algorithm.advantage`` estimator: [B, T] token rewards -> [B, T] advantages
        (an estimator marked ``needs_greedy_baseline`` also takes the greedy responses' scores [B])."""
        estimator = get("advantage", self.cfg.advantage)
        if getattr(estimator, "needs_greedy_baseline", False):
            return estimator(token_rewards, mask, group_size, self.cfg, baseline_scores=baseline_scores)
        return estimator(token_rewards, mask, group_size, self.cfg)

    def modules(self) -> dict[str, nn.Module]:
        """Extra trainable modules (a critic), saved and restored with checkpoints."""
        return {}

    def setup(self, policy: nn.Module) -> None:
        """Build extra modules once the policy exists."""

    def wrap_modules(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """Let a multi-process strategy wrap the trainable modules (DDP, FSDP); none for critic-free ones."""

    def parameter_groups(self, lr: float) -> list[dict[str, Any]]:
        """Optimizer groups of the algorithm's own modules (``lr``: the policy's learning rate)."""
        parameters = [p for module in self.modules().values() for p in module.parameters() if p.requires_grad]
        return [{"params": parameters, "lr": lr}] if parameters else []

    def training_batch(self, scored: Rollout, forward: Any = None, in_loss: Tensor | None = None,
                       keep_ref_logits: bool = True) -> tuple[Rollout, dict[str, float]]:
        """The training batch of a scored one (the third stage, frozen, made here alone): :meth:`prepare`'s
        advantages, then the samples not in the loss (``in_loss`` False: a non-finite score, or dropped by the
        sampling rules; they took part in the advantage statistics) masked out of every token, and the sampling-time
        logits and hidden states (and the reference's logits unless the update reads them) let go. Returns it and
        the advantage statistics."""
        batch, stats = self.prepare(scored, forward)
        dropped: dict[str, Any] = {"policy_logits": None, "hidden": None}
        if not keep_ref_logits:
            dropped["ref_logits"] = None
        mask = batch.response_mask
        if in_loss is not None and not bool(in_loss.all()):
            mask = mask * in_loss[:, None]
        keep = self.rejection(batch)
        if keep is not None:  # the correction's rejected tokens leave the loss (and its denominator)
            stats["rollout/rejected_frac"] = 1.0 - masked_mean(keep, mask, across_ranks=True).item()
            mask = mask * keep
        if mask is not batch.response_mask:
            dropped.update(response_mask=mask, advantages=batch.advantages * mask)
        return replace(batch, **dropped), stats

    def rejection(self, rollout: Rollout) -> Tensor | None:
        """The tokens ``algorithm.tis_mode`` keeps in the loss ([B, T]; ``geo_mask``, ``m2po``), else None."""
        mode = self.cfg.get("tis_mode", "token_truncate")
        if self.cfg.get("tis_cap") is None or rollout.sampler_logprobs is None:
            return None
        return rejected(rollout.logprobs, rollout.sampler_logprobs, rollout.response_mask, mode,
                        self.cfg.tis_cap, self.cfg.get("tis_floor"), float(self.cfg.get("m2po_tau", 0.04)))

    def prepare(self, rollout: Rollout, forward: Any = None) -> tuple[Rollout, dict[str, float]]:
        """The rollout with its token rewards, advantages ([B, T]) and returns (and the sampler correction's
        weights); and their statistics."""
        mask = rollout.response_mask
        token_rewards = build_token_rewards(rollout, rollout.scores)
        returns = sequence_returns(token_rewards, mask)
        advantages = self.advantages(token_rewards, mask, rollout.group_size, rollout.baseline_scores)
        token_weights = policy_weights(advantages, rollout.scores, mask, self.cfg.weight_by,
                                       self.cfg.whiten_advantages, self.cfg.clamp_negative_weights)
        added: dict[str, Any] = {"token_rewards": token_rewards, "advantages": token_weights,
                                 "returns": returns[:, None] * mask}
        if self.scales_kl:  # the factor the advantages gave each sample's task reward (kl.loss_scale=advantage)
            added["kl_loss_scale"] = kl_loss_scale(self.cfg.advantage, returns, rollout.group_size, self.cfg)
        stats = {"advantages/mean": masked_mean(token_weights, mask, across_ranks=True).item(),
                 "returns/mean": distributed.mean(returns).item()}
        if rollout.baseline_scores is not None:
            stats["advantages/baseline_mean"] = distributed.mean(rollout.baseline_scores).item()
        tis_weights, tis_stats = self.importance_weights(rollout)
        return (replace(rollout, **added, tis_weights=tis_weights),
                {**stats, **tis_stats, **advantage_range(token_weights, mask)})

    def importance_weights(self, rollout: Rollout) -> tuple[Tensor | None, dict[str, float]]:
        """``algorithm.tis_cap``: each token's loss weight from the sampler-trainer correction
        (:func:`~rlhf_lab.algorithms.losses.sampler_correction`, ``algorithm.tis_mode``) between the trainer's
        π_old (``logprobs``: the experience step rescores them under ``tis_cap``) and the engine's log-probs; the
        weights ([B, T], None without a cap) and their statistics."""
        cap = self.cfg.get("tis_cap")
        if cap is None:
            return None, {}
        if rollout.sampler_logprobs is None:
            raise RuntimeError("algorithm.tis_cap needs the trainer's log-probs beside the sampler's (the scoring pass)")
        mask = rollout.response_mask
        mode, floor = self.cfg.get("tis_mode", "token_truncate"), self.cfg.get("tis_floor")
        weights = sampler_correction(rollout.logprobs, rollout.sampler_logprobs, mask, cap, mode, floor)
        log_ratio = (rollout.logprobs - rollout.sampler_logprobs) * mask
        if mode.startswith("sequence") or mode == "geo_mask":  # the sequence's ratio (geo_mask: its geometric mean)
            log_ratio = log_ratio.sum(-1, keepdim=True)
            if mode == "geo_mask":
                log_ratio = log_ratio / mask.sum(-1, keepdim=True).clamp(min=1.0)
        ratio = torch.exp(log_ratio).expand_as(mask)
        outside = ratio > cap
        if mode in ("icepop", "geo_mask"):
            outside = outside | (ratio < band_floor(cap, floor))
        return weights, {"rollout/is_weight_mean": masked_mean(weights, mask, across_ranks=True).item(),
                         "rollout/is_capped_frac": masked_mean(outside.float(), mask, across_ranks=True).item()}

    def loss(self, batch: Rollout, output: PolicyOutput, context: LossContext) -> LossResult:
        """The policy loss of a micro-batch minus the entropy bonus, and its statistics (shares of the
        mini-batch's: summed over micro-batches they give the mini-batch's values)."""
        mask = batch.response_mask
        policy_loss_fn = get("policy_loss", self.cfg.policy_loss)
        old_logprobs = batch.old_logprobs(output.logprobs)
        behaviour = behaviour_logprobs(output.logprobs, batch)
        ratio_base = behaviour if getattr(policy_loss_fn, "reads_behaviour", False) else old_logprobs
        result = policy_loss_fn(output.logprobs, ratio_base, batch.advantages, mask, self.clip)
        per_token = result.per_token if batch.tis_weights is None else result.per_token * batch.tis_weights
        threshold = self.cfg.get("off_policy_mask")
        masked_out = None
        if threshold is not None:  # DeepSeek-V3.2: negative-advantage samples far from μ leave the policy term
            keep = off_policy_sequence_mask(output.logprobs, behaviour, batch.advantages, mask, threshold)
            per_token, masked_out = per_token * keep, (1.0 - keep) * mask
        policy_loss = aggregate(per_token, mask, self.cfg.loss_aggregation, context)
        log_ratio = (output.logprobs - old_logprobs).detach()
        tokens = context.minibatch_tokens
        clipped = sum(result.events.get(k, 0) for k in ("clipped_low", "clipped_high")) + torch.zeros_like(mask)
        stats = {
            "loss/policy": policy_loss.detach(),
            "policy/clipfrac": masked_sum(clipped, mask) / tokens,
            # k3 estimate of KL(π_old‖π_new), the PPO "approx_kl".
            "policy/approxkl": masked_sum(torch.expm1(log_ratio) - log_ratio, mask) / tokens,
            "policy/ratio_mean": masked_sum(result.ratio, mask) / tokens,
        }
        for event, values in result.events.items():
            stats[f"policy/{event}_frac"] = masked_sum(values, mask) / tokens
        if masked_out is not None:
            stats["policy/off_policy_masked_frac"] = masked_sum(masked_out, mask) / tokens
        loss = policy_loss
        if self.cfg.entropy_coef > 0:
            bonus = self.cfg.entropy_coef * entropy_bonus(output.logits, mask, context)
            loss = loss - bonus
            stats["loss/entropy_bonus"] = -bonus.detach()
        valid = mask > 0  # ±inf where no token counts (left out after the reduction over ranks)
        extrema = {"policy/ratio_max": torch.where(valid, result.ratio, -math.inf).max(),
                   "policy/ratio_min": torch.where(valid, result.ratio, math.inf).min()}
        return LossResult(loss, stats, extrema=extrema)

    def should_stop_epochs(self, stats: dict[str, float]) -> bool:
        """Early stop of the update epochs (PPO's target_kl); never for critic-free algorithms."""
        return False

    def summarize(self, metrics: dict[str, float], n_updates: int) -> dict[str, float]:
        """Extra step metrics from the update metrics (averages over ``n_updates`` mini-batches)."""
        return {}


def advantage_range(advantages: Tensor, mask: Tensor) -> dict[str, float]:
    """Smallest and largest advantage over every rank's valid tokens."""
    valid = advantages[mask > 0]
    if not valid.numel():
        return {}
    return {"advantages/min": distributed.minimum(valid.min()), "advantages/max": distributed.maximum(valid.max())}


# The critic-free presets: each composes an advantage estimator and a policy loss (conf/algorithm/NAME.yaml).
for _name in ("grpo", "dr_grpo", "dapo", "reinforce", "rloo", "reinforce_pp", "remax", "gspo", "cispo"):
    register("algorithm", _name)(Algorithm)
