"""PPO (Schulman et al. 2017) for language models, as in Ziegler et al. 2019 and TRL's classic PPOTrainer.

Each response token is an action; its reward is the per-token KL penalty (``kl.placement=reward``) plus,
on the last token, the sequence score. A critic (``critic.py``) estimates V_t per token; GAE turns rewards
and values into advantages and critic targets; the loss is the clipped surrogate plus ``vf_coef`` × the
clipped value loss. The trainer's generic loop supplies the rest: ``epochs`` over shuffled mini-batches,
micro-batch accumulation, the entropy bonus, gradient clipping. PPO's two guards plug into its hooks:
``target_kl`` stops the epochs early (``should_stop_epochs``), ``ratio_threshold`` vetoes a mini-batch
whose mean ratio exploded (the loss result's ``veto``). The critic trains at its own learning rate
(``critic_lr``) through PPO's own parameter group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.algorithms.base import (
    Algorithm,
    LossContext,
    LossResult,
    PolicyOutput,
    advantage_range,
    aggregate,
    build_token_rewards,
)
from rlhf_lab.algorithms.critic import SeparateCritic, ValueHead, hidden_size_of, policy_trunk
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlhf_lab.registry import register
from rlhf_lab.runtime import distributed

CRITICS = ("shared", "separate")


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens, [B, T] each.

    δ_t = r_t + γ·m_{t+1}·V_{t+1} − V_t,   A_t = δ_t + γλ·m_{t+1}·A_{t+1},   R_t = A_t + V_t,
    with t running over the tokens where the response mask m is 1 (t+1 is the next of them) and m = 0 after the
    last: a response ends after its last valid token and bootstraps with 0 there, however wide the batch. A
    multi-turn trajectory's environment tokens (mask 0 between model turns) are skipped, so the recursion runs
    over model tokens only and a turn's reward reaches the earlier turns through the next turn's values.
    Returns (advantages, returns), 0 on padding and environment tokens.
    """
    rewards, values = token_rewards * mask, values * mask
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    next_advantage = rewards.new_zeros(batch)
    next_mask = rewards.new_zeros(batch)
    advantages_reversed = []
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_mask * next_value - values[:, t]
        advantage = delta + gamma * lam * next_mask * next_advantage
        advantages_reversed.append(advantage)
        model_token = mask[:, t] > 0  # elsewhere the next model token's numbers carry over
        next_advantage = torch.where(model_token, advantage, next_advantage)
        next_value = torch.where(model_token, values[:, t], next_value)
        next_mask = torch.where(model_token, mask[:, t], next_mask)
    advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask
    return advantages, (advantages + values) * mask


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_value: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss (PPO2 / TRL) and where the clip binds.

    V_clip = V_old + clip(V − V_old, −ε_v, ε_v);  loss = ½·max((V − R)², (V_clip − R)²).
    ``clip_value=None`` gives ½(V − R)². Returns (loss [B, T], clipped [B, T] as 0/1 floats), masked.
    """
    unclipped = (values - returns) ** 2
    if clip_value is None:
        return 0.5 * unclipped * mask, torch.zeros_like(mask)
    clipped_values = old_values + (values - old_values).clamp(-clip_value, clip_value)
    clipped = (clipped_values - returns) ** 2
    binds = (clipped > unclipped).float()
    return 0.5 * torch.maximum(unclipped, clipped) * mask, binds * mask


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 − Var(R − V) / Var(R) over valid tokens: 1 is a perfect critic, 0 no better than a constant.

    Defined as 0 when Var(R) = 0 (the ratio is undefined; 0 keeps the logged value finite).
    """
    returns_variance = masked_var(returns, mask, across_ranks=True)
    if returns_variance <= 0:
        return returns_variance.new_zeros(())
    return 1.0 - masked_var(returns - values, mask, across_ranks=True) / returns_variance


def shape_scores(scores: Tensor, reward_clip: float | None, normalize: bool) -> Tensor:
    """Sequence scores before they enter GAE, [B] -> [B]: whiten across the batch, then clip to ±reward_clip.

    The order is TRL's (``use_score_norm`` then ``score_clip``), so the clip is in normalised units.
    """
    if normalize:
        scores = masked_whiten(scores, torch.ones_like(scores), across_ranks=True)  # over every rank's scores
    if reward_clip is not None:
        scores = scores.clamp(-reward_clip, reward_clip)
    return scores


def ratio_veto_margin(ratio: Tensor, mask: Tensor, threshold: float, minibatch_tokens: float) -> Tensor:
    """A micro-batch's share of (mean ratio of the mini-batch − threshold).

    (Σ ratio·m − threshold·Σ m) / N over a micro-batch, with N the mini-batch's valid tokens: summed over the
    mini-batch's micro-batches it is exactly mean(ratio) − threshold, positive iff the mini-batch's mean
    ratio exceeds the threshold, whatever the micro-batch split.
    """
    return (masked_sum(ratio, mask) - threshold * mask.sum()) / max(minibatch_tokens, 1.0)


@register("algorithm", "ppo")
class PPO(Algorithm):
    """Actor-critic PPO; ``cfg.critic`` is ``shared`` (value head on the policy trunk) or ``separate``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.shared_critic = cfg.critic == "shared"
        self.needs_hidden_states = self.shared_critic  # the shared head reads the policy pass's hidden states
        # Its sampling-time values come from the hidden states the decode loop kept: no extra forward pass.
        self.reads_sampling_hidden = self.shared_critic
        self.critic: nn.Module | None = None

    def setup(self, policy: nn.Module) -> None:
        hidden_size = hidden_size_of(policy)
        if self.shared_critic:
            self.critic = ValueHead(hidden_size)
        else:
            self.critic = SeparateCritic(policy_trunk(policy), hidden_size)

    def modules(self) -> dict[str, nn.Module]:
        if self.critic is None:
            return {}
        return {"value_head" if self.shared_critic else "critic": distributed.unwrap(self.critic)}

    def wrap_modules(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        """The critic trains under the run's strategy too (its gradients averaged or sharded across ranks)."""
        if self.critic is not None:
            self.critic = wrap(self.critic)

    def values(self, batch: Rollout, output: PolicyOutput | None) -> Tensor:
        """Critic values of the response tokens, [B, T] float32, 0 on padding."""
        if self.critic is None:
            raise RuntimeError("PPO.setup(policy) must run before the critic is used")
        if self.shared_critic:
            if output is None or output.hidden is None:
                raise RuntimeError("critic=shared needs the policy forward's hidden states (needs_hidden_states)")
            values = self.critic(output.hidden)
        else:
            values = self.critic(batch.input_ids, batch.attention_mask, batch.prompt_width)
        return values * batch.response_mask

    def sampling_values(self, rollout: Rollout, forward: Any = None) -> Tensor:
        """The critic's values at sampling time, [B, T]. The shared head reads the hidden states the decode
        loop kept (``Rollout.hidden``: the same weights' states, so the values a no-grad forward pass over the
        rollout would give, to float precision); without them, that forward pass runs."""
        if self.shared_critic and rollout.hidden is not None:
            return self.critic(rollout.hidden) * rollout.response_mask
        if self.shared_critic and forward is None:
            raise RuntimeError("critic=shared: prepare needs Rollout.hidden or the trainer's forward")

        def values(part: Rollout) -> Tensor:  # a forward pass over ``part``: the critic's, or the policy's trunk
            return self.values(part, forward(part) if self.shared_critic else None)

        # In the training pass's micro-batches (its rows or token budget, packed where it packs) where the updater
        # lends them: a whole batch's pass would hold every row's activations at once.
        return self.by_micro_batches(rollout, values) if self.by_micro_batches is not None else values(rollout)

    def parameter_groups(self, lr: float) -> list[dict[str, Any]]:
        """The critic's trainable tensors at ``critic_lr`` (default: the policy's ``lr``)."""
        return [{**group, "lr": self.cfg.critic_lr or lr} for group in super().parameter_groups(lr)]

    @torch.no_grad()
    def prepare(self, rollout: Rollout, forward: Any = None) -> tuple[Rollout, dict[str, float]]:
        """The rollout with its token rewards (shaped score on the last token − KL penalty), sampling-time values,
        GAE advantages (whitened if asked) and returns; and their statistics."""
        cfg, mask = self.cfg, rollout.response_mask
        scores = shape_scores(rollout.scores, cfg.reward_clip, cfg.normalize_scores)
        token_rewards = build_token_rewards(rollout, scores)
        values = self.sampling_values(rollout, forward).float()
        advantages, returns = gae_advantages(token_rewards, values, mask, cfg.gamma, cfg.lam)
        trained = masked_whiten(advantages, mask, across_ranks=True) if cfg.whiten_advantages else advantages
        tis_weights, tis_stats = self.importance_weights(rollout)
        prepared = replace(rollout, token_rewards=token_rewards, values=values, returns=returns, advantages=trained,
                           tis_weights=tis_weights)
        return prepared, {
            **tis_stats,
            **advantage_range(trained, mask),
            "value/mean": masked_mean(values, mask, across_ranks=True).item(),
            "returns/mean": masked_mean(returns, mask, across_ranks=True).item(),
            "advantages/mean": masked_mean(advantages, mask, across_ranks=True).item(),
            "value/explained_variance": explained_variance(values, returns, mask).item(),
        }

    def loss(self, batch: Rollout, output: PolicyOutput, context: LossContext) -> LossResult:
        """Clipped surrogate + vf_coef × clipped value loss; statistics summed over micro-batches are exact."""
        result = super().loss(batch, output, context)
        mask = batch.response_mask
        tokens = max(context.minibatch_tokens, 1.0)
        per_token, value_clipped = clipped_value_loss(
            self.values(batch, output), batch.values, batch.returns, mask, self.cfg.clip_value
        )
        value_loss = aggregate(per_token, mask, self.cfg.loss_aggregation, context)
        old_logprobs = batch.old_logprobs(output.logprobs)
        ratio = torch.exp(output.logprobs - old_logprobs).detach()
        stats = result.stats
        stats["loss/value"] = value_loss.detach()  # ½ squared error, before vf_coef
        stats["value/clipfrac"] = masked_sum(value_clipped, mask) / tokens
        veto = None
        if self.cfg.ratio_threshold is not None:  # TRL's ratio_threshold: skip a mini-batch whose mean ratio exploded
            veto = ratio_veto_margin(ratio, mask, self.cfg.ratio_threshold, tokens)
        return LossResult(result.loss + self.cfg.vf_coef * value_loss, stats, veto, result.extrema)

    def should_stop_epochs(self, stats: dict[str, float]) -> bool:
        """Stop the epochs once the epoch's mean approximate KL(π_old‖π_new) exceeds ``target_kl``."""
        return self.cfg.target_kl is not None and stats.get("policy/approxkl", 0.0) > self.cfg.target_kl

    def summarize(self, metrics: dict[str, float], n_updates: int) -> dict[str, float]:
        """``optim/vetoed`` arrives as the fraction of vetoed mini-batches; report their count."""
        return {"ppo/skipped_minibatches": round(metrics.get("optim/vetoed", 0.0) * n_updates)}
