"""DAPO's sampling rules (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale").

- **Overlong reward shaping**: a response whose length enters the last ``window`` tokens before
  ``max_new_tokens`` loses a linearly growing share of ``factor``:
  penalty(L) = 0 for L ≤ L_max − W, ((L_max − W) − L) / W · factor for L_max − W < L ≤ L_max
  (−factor at L = L_max; a window longer than L_max is capped at it). ``mask_truncated`` also takes the responses that never ended (no EOS: cut at
  ``max_new_tokens``) out of the loss ("overlong filtering").
- **Dynamic sampling**: a prompt group whose final scores are all equal has zero group-relative advantage
  and only dilutes the token mean; such groups are dropped and the batch refilled from further prompts, up
  to ``max_refill_rounds`` extra generation rounds. At the limit the missing groups are filled with dropped
  ones kept out of the loss, so every rank trains on the same batch shape.

All functions here are pure; :class:`rlhf_lab.step.experience.ExperienceMaker` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_new_tokens: int, window: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment of each response length: [B] -> [B] in [−factor, 0]; 0 when ``window`` is 0."""
    if window <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    window = min(window, max_new_tokens)  # a window longer than the limit covers every length
    start = max_new_tokens - window  # the last length with no penalty
    over = (lengths.float() - start).clamp(min=0.0, max=float(window))
    return -factor * over / window


def truncated(response_ids: Tensor, response_mask: Tensor, eos_token_id: int | list[int] | None) -> Tensor:
    """Responses that never emitted EOS (cut at ``max_new_tokens``): [B] bool. Without an EOS id none are."""
    if eos_token_id is None:
        return torch.zeros(response_ids.shape[0], dtype=torch.bool, device=response_ids.device)
    lengths = response_mask.sum(-1).long()
    last = response_ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    eos_ids = torch.as_tensor(eos_token_id, device=response_ids.device).reshape(-1)
    return ~torch.isin(last, eos_ids) | (lengths == 0)


def informative_groups(scores: Tensor, valid: Tensor, group_size: int) -> Tensor:
    """Prompt groups whose valid scores are not all equal: [B], [B] bool -> [B / group_size] bool.

    A group with fewer than two valid samples carries no comparison and counts as tied.
    """
    groups = scores.reshape(-1, group_size)
    ok = valid.reshape(-1, group_size)
    high = torch.where(ok, groups, torch.full_like(groups, -torch.inf)).max(dim=1).values
    low = torch.where(ok, groups, torch.full_like(groups, torch.inf)).min(dim=1).values
    return (ok.sum(dim=1) >= 2) & (high > low)


def refill_indices(step: int, round_: int, count: int, n_prompts: int, seed: int) -> list[int]:
    """Prompts for refill round ``round_`` (1, 2, …) of ``step``: ``count`` indices of a permutation seeded by
    (seed, step, round) — a pure function of its arguments, so a resumed run refills alike."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + round_)
    order = torch.randperm(n_prompts, generator=generator)
    return [int(order[i % n_prompts]) for i in range(count)]


@dataclass(frozen=True)
class SamplingRules:
    """The algorithm's sampling rules (``algorithm.dynamic_sampling``, ``max_refill_rounds``,
    ``overlong_window``, ``overlong_penalty``, ``mask_truncated``)."""

    dynamic_sampling: bool = False
    max_refill_rounds: int = 0
    overlong_window: int = 0
    overlong_factor: float = 1.0
    mask_truncated: bool = False

    @classmethod
    def from_config(cls, algorithm: Any) -> SamplingRules:
        return cls(bool(algorithm.get("dynamic_sampling", False)), int(algorithm.get("max_refill_rounds", 0)),
                   int(algorithm.get("overlong_window", 0)), float(algorithm.get("overlong_penalty", 1.0)),
                   bool(algorithm.get("mask_truncated", False)))

    @property
    def shapes_rewards(self) -> bool:
        return self.overlong_window > 0
