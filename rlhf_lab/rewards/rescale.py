"""Reward rescalings applied to a training batch's scores once the reference has scored it (``reward.rescale``,
kind ``reward_rescale``): ``fn(scores [B], ref_sequence_logprobs [B], group_size, beta, threshold) -> scores [B]``.

- ``none``: the scores as the reward gave them.
- ``mode_anchor``: Mode Anchored Reward Augmentation (GX-Chen et al., "KL-Regularized Reinforcement Learning is
  Designed to Mode Collapse", arXiv 2510.20817). With reverse-KL regularisation the optimum is
  π* ∝ π_ref·exp(R/β), so equally rewarded responses keep the reference's proportions and a small reward gap
  grows exponentially as β falls: by design, one mode. In each prompt group, the samples scoring at least
  ``reward.rescale_threshold`` (τ) are rescored against an anchor z, the one of them the reference finds most
  likely: R̄(y) = R(z) + β·(log π_ref(z) − log π_ref(y)). Then π_ref(y)·exp(R̄(y)/β) = π_ref(z)·exp(R(z)/β)
  for every such y: the regularised optimum puts equal mass on every high-reward response in the group. The
  others keep their score.

Where the anchor is taken (``reward.rescale_anchor``, :data:`ANCHORS`): ``batch``, one z over the whole training
batch, as the paper's algorithm takes it (every high-reward sample of the step shares one target weight); ``group``,
one z per prompt's group of samples. ``group`` deviates from the paper: on a task whose prompts share their modes
(the exact task has one prompt) it draws B anchors a step instead of one, and each group's anchor is the most likely
mode that group happened to sample, so the targets differ from group to group and the split over the modes falls
short of uniform (docs/literature/mode-collapse.md measures both).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_lab.registry import register

ANCHORS = ("batch", "group")  # reward.rescale_anchor: one anchor over the batch (the paper's) or one per group


@register("reward_rescale", "none")
def no_rescale(scores: Tensor, ref_sequence_logprobs: Tensor, group_size: int, beta: float,
               threshold: float | None) -> Tensor:
    """The scores unchanged."""
    return scores


@register("reward_rescale", "mode_anchor")
def mode_anchor(scores: Tensor, ref_sequence_logprobs: Tensor, group_size: int, beta: float,
                threshold: float | None) -> Tensor:
    """R̄(y) = R(z) + β·(log π_ref(z) − log π_ref(y)) for the samples of a group with R(y) ≥ τ, z the most likely
    of them under the reference; [B] in, [B] out, anchored over blocks of ``group_size`` consecutive samples (a
    prompt's group, or the whole batch: ``reward.rescale_anchor``)."""
    grouped = scores.view(-1, group_size)
    ref = ref_sequence_logprobs.to(scores.dtype).view(-1, group_size)
    good = grouped >= threshold
    anchor_ref, anchor = torch.where(good, ref, torch.full_like(ref, -torch.inf)).max(-1, keepdim=True)
    augmented = grouped.gather(-1, anchor) + beta * (anchor_ref - ref)
    return torch.where(good, augmented, grouped).reshape(scores.shape)
