"""A training step's metrics over every rank's samples (``reward/*``, ``kl/*``, ``policy/entropy``, ...).

Each rank holds whole prompt groups, in rank order; the statistics here gather or reduce them, so N processes log
what one process logs on the whole batch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from rlhf_lab.generation.inflight import oldest_versions
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.masked import masked_mean
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import say
from rlhf_lab.step.sampling import truncated


def rollout_metrics(rollout: Rollout, valid: Tensor, coef: float, kl_per_sequence: Tensor) -> dict[str, Any]:
    """Rewards of the valid samples, the KL estimate and the exact KL beside it (where ``kl.exact=step`` computed
    it), entropy, lengths, and each reward component (``rollout.extras``); ``kl_per_sequence`` [every rank's B] is
    the exact KL (else the estimate) summed over each response."""
    mask = rollout.response_mask
    scores, all_valid = distributed.gather_rows(rollout.scores), distributed.gather_rows(valid)
    metrics: dict[str, Any] = {
        "reward/mean": scores[all_valid].mean().item(),
        "reward/std": scores[all_valid].std().item() if int(all_valid.sum()) > 1 else 0.0,
        "reward/dropped": int((~all_valid).sum()),
        "kl/estimate": masked_mean(rollout.kl_estimate, mask, across_ranks=True).item(),
        "kl/coef": coef,
        "policy/entropy": masked_mean(rollout.entropy, mask, across_ranks=True).item(),
        "response/length_mean": distributed.gather_rows(mask.sum(-1)).mean().item(),
    }
    if rollout.kl_exact is not None:
        metrics["kl/exact"] = masked_mean(rollout.kl_exact, mask, across_ranks=True).item()
        metrics["kl/exact_sequence"] = kl_per_sequence.mean().item()
    for key, value in rollout.extras.items():  # NaN: a sample this component did not score (reward=route)
        scored = distributed.gather_rows(value)[all_valid]
        scored = scored[~scored.isnan()]
        if len(scored):
            metrics[key] = scored.mean().item()
    return metrics


def group_metrics(scores: Tensor, valid: Tensor, group_size: int) -> dict[str, float]:
    """``rollout/frac_reward_zero_std``: the share of prompt groups whose valid rewards are all equal (TRL's
    ``frac_reward_zero_std``): group-relative advantages are 0 there, no learning signal. Every rank's groups;
    nothing without groups (``algorithm.group_size=1``)."""
    if group_size < 2:
        return {}
    scores, valid = distributed.gather_rows(scores), distributed.gather_rows(valid)
    groups, kept = scores.reshape(-1, group_size), valid.reshape(-1, group_size)
    low = torch.where(kept, groups, torch.full_like(groups, torch.inf)).amin(-1)
    high = torch.where(kept, groups, torch.full_like(groups, -torch.inf)).amax(-1)
    flat = (kept.sum(-1) < 2) | (high - low <= 0)  # fewer than two valid samples: no comparison either
    return {"rollout/frac_reward_zero_std": flat.float().mean().item()}


def clipped_responses(rollout: Rollout, response_mask: Tensor, max_new_tokens: int,
                      eos_token_id: int | list[int] | None) -> Tensor:
    """[B] bool: responses cut at the length limit: ``max_new_tokens`` reached without EOS (a stop string ends a
    response short of it), or, for episodes, cut by the environment's limits (``rollout.truncated``)."""
    if rollout.truncated is not None:
        return rollout.truncated.bool()
    return truncated(rollout.response_ids, response_mask, eos_token_id) & (response_mask.sum(-1) >= max_new_tokens)


def length_metrics(response_mask: Tensor, clipped: Tensor) -> dict[str, float]:
    """``response/length_min|max`` (tokens per response, every rank's samples) and ``response/clipped_frac``: the
    share of responses cut at the length limit (``clipped`` [B] bool; TRL's ``clipped_ratio``)."""
    lengths = distributed.gather_rows(response_mask.sum(-1))
    clipped = distributed.gather_rows(clipped.float())
    return {"response/length_min": lengths.min().item(), "response/length_max": lengths.max().item(),
            "response/clipped_frac": clipped.mean().item()}


def sampling_metrics(stats: dict[str, float], samples: int, device: torch.device) -> dict[str, float]:
    """The sampling rules' counts over every rank: refill rounds and groups, truncated and masked shares
    (``samples``: every rank's samples of the step)."""
    keys = sorted(stats)
    counts = distributed.all_reduce_sum(torch.tensor([stats[k] for k in keys], device=device))
    totals = dict(zip(keys, counts.tolist()))
    metrics = {"response/truncated_frac": totals.get("truncated", 0.0) / max(samples, 1)}
    if "masked_truncated" in totals:
        metrics["overlong/masked_frac"] = totals["masked_truncated"] / max(samples, 1)
    if "rounds" in totals:
        metrics["sampling/rounds"] = totals["rounds"] / distributed.world_size()
        for key in ("groups_dropped", "groups_filled", "refill_prompts"):
            metrics[f"sampling/{key}"] = totals[key]
    return metrics


def zero_spread_warning(metrics: dict[str, Any], step: int, warned: bool) -> str | None:
    """The one warning of a run whose every prompt group got equal rewards at some step (no learning signal for
    group-relative advantages), or None (already warned, or some group has spread)."""
    if warned or metrics.get("rollout/frac_reward_zero_std") != 1.0:
        return None
    return (f"step {step}: every prompt group's rewards are equal (rollout/frac_reward_zero_std=1): the advantages "
            "are 0 and this step learns nothing from the reward; a reward that tells the samples apart, more "
            "samples per prompt (algorithm.group_size) or dynamic sampling (algorithm.dynamic_sampling) helps "
            "(warned once per run)")


class StepSignals:
    """What a step says beyond its losses: response lengths and clipping, groups with no reward spread (warned once
    per run when no group has any), and at step 0 of a fresh run ``kl/exact_floor``: the exact KL where the policy
    is the reference, the numerical floor of the run's precision (printed)."""

    def __init__(self, cfg: Any, eos_token_id: int | list[int] | None, precision: str) -> None:
        self.max_new_tokens, self.group_size = int(cfg.trainer.max_new_tokens), int(cfg.algorithm.group_size)
        self.eos_token_id, self.precision = eos_token_id, precision
        self.warned = False

    def measure(self, rollout: Rollout, response_mask: Tensor, valid: Tensor, step: int, fresh: bool,
                logged: dict[str, Any]) -> dict[str, Any]:
        """This step's signals; ``logged``: the step's metrics so far (``kl/exact``); ``fresh``: a run from step 0."""
        clipped = clipped_responses(rollout, response_mask, self.max_new_tokens, self.eos_token_id)
        metrics = {**length_metrics(response_mask, clipped), **group_metrics(rollout.scores, valid, self.group_size)}
        main = distributed.is_main_process()
        if fresh and step == 0 and "kl/exact" in logged:
            metrics["kl/exact_floor"] = logged["kl/exact"]
            if main:
                say(f"kl/exact_floor: {logged['kl/exact']:.3g} per token at step 0, where the policy is the reference "
                    f"(trainer.precision={self.precision}: the same weights, each pass rounded in {self.precision}); "
                    "kl/exact values near it are numerical noise", __name__)
        warning = zero_spread_warning(metrics, step, self.warned)
        if warning:
            self.warned = True
            if main:
                say(warning, __name__, logging.WARNING)
        return metrics


def staleness_metrics(rollout: Rollout, trained_at: int) -> dict[str, float]:
    """How stale a training batch is, over every rank's samples: a token's staleness is the updates between the
    weights that sampled it (``rollout.versions``) and the policy it trains (``trained_at`` updates); a sample's is
    its oldest token's, its stalest (so the sample max is the token max). Token mean, sample mean and max, the share of samples whose tokens span more than one
    version (weights updated while they were sampled), and the samples at each staleness
    (``staleness/samples_at_<k>``). Nothing where the engine recorded no versions."""
    if rollout.versions is None:
        return {}
    mask = rollout.response_mask > 0
    staleness = (trained_at - rollout.versions).to(rollout.response_mask.dtype)
    oldest = oldest_versions(rollout.versions, mask, trained_at)  # (a sample with no token is left out below)
    newest = torch.where(mask, rollout.versions, -1).max(-1).values
    has_tokens = distributed.gather_rows(mask.any(-1))
    sample = distributed.gather_rows(trained_at - oldest)[has_tokens]
    spans = distributed.gather_rows(newest > oldest)[has_tokens]
    if not len(sample):
        return {}
    metrics = {"staleness/token_mean": masked_mean(staleness, rollout.response_mask, across_ranks=True).item(),
               "staleness/sample_mean": sample.float().mean().item(), "staleness/sample_max": float(sample.max()),
               "staleness/multi_version_frac": spans.float().mean().item()}
    for k, count in enumerate(torch.bincount(sample.clamp(min=0)).tolist()):
        metrics[f"staleness/samples_at_{k}"] = float(count)
    return metrics


def staleness_bias(rollout: Rollout, sampled_mask: Tensor, trained_at: int, dropped: Tensor | None) -> dict[str, float]:
    """Whether staleness follows length or reward, over every sample drawn (dropped ones too; ``sampled_mask``): the
    correlation of a sample's mean token staleness with its response length (``staleness/length_corr``) and with
    its score (``staleness/reward_corr``), where both vary; and where a cap dropped samples (``dropped`` [B]), their
    mean length over the batch's (``rollout/stale_dropped_length_ratio``: above 1, the long responses are the ones
    starved) and their mean score less the batch's (``rollout/stale_dropped_reward_gap``)."""
    if rollout.versions is None:
        return {}
    mask = sampled_mask > 0
    lengths = mask.sum(-1).float()
    staleness = ((trained_at - rollout.versions) * mask).sum(-1) / lengths.clamp(min=1)
    has = distributed.gather_rows(lengths > 0)
    lengths, staleness, scores = (distributed.gather_rows(x)[has] for x in (lengths, staleness, rollout.scores.float()))
    metrics: dict[str, float] = {}
    for name, other in (("length", lengths), ("reward", scores)):
        if len(other) > 1 and bool(staleness.std() > 0) and bool(other.std() > 0):
            metrics[f"staleness/{name}_corr"] = torch.corrcoef(torch.stack([staleness, other]))[0, 1].item()
    if dropped is not None:
        out = distributed.gather_rows(dropped.to(has.device))[has]
        if bool(out.any()):
            metrics["rollout/stale_dropped_length_ratio"] = (lengths[out].mean() / lengths.mean()).item()
            metrics["rollout/stale_dropped_reward_gap"] = (scores[out].mean() - scores.mean()).item()
    return metrics
