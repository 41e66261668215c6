"""Masked reductions over per-token tensors: the vocabulary every loss, advantage and KL term is written in.

Shapes: per-token tensors are ``[B, T]``; ``mask`` is 1.0 on response tokens that count and 0.0 on prompt and
padding positions, and every reduction ignores masked positions entirely. With ``across_ranks=True`` a
reduction runs over every rank's rows (a batch statistic: N processes compute what one process computes on the
whole batch); in one process that is the local expression, computed the same way, so its numbers do not move.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_lab.runtime import distributed


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask over ``dim`` (all dims if None)."""
    product = values * mask
    return product.sum() if dim is None else product.sum(dim)


def _sum_and_count(values: Tensor, mask: Tensor, across_ranks: bool) -> tuple[Tensor, Tensor]:
    """(Σ values·mask, Σ mask) over every position, over every rank's rows with ``across_ranks`` (in float64)."""
    total, count = masked_sum(values, mask), mask.sum()
    if across_ranks and distributed.is_distributed():
        total, count = distributed.all_reduce_sum(torch.stack([total.double(), count.double()])).unbind()
    return total, count


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None, across_ranks: bool = False) -> Tensor:
    """Σ values·mask / Σ mask over ``dim`` (all positions if None); 0 where the mask is empty."""
    if dim is not None:
        if across_ranks:
            raise ValueError("masked_mean over a dimension is a per-row statistic: across_ranks needs dim=None")
        return masked_sum(values, mask, dim) / mask.sum(dim).clamp(min=1.0)
    total, count = _sum_and_count(values, mask, across_ranks)
    return (total / count.clamp(min=1.0)).to(values.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True, across_ranks: bool = False) -> Tensor:
    """Variance of the masked entries (Bessel-corrected when ``unbiased`` and more than one entry)."""
    mean = masked_mean(values, mask, across_ranks=across_ranks)
    squared_deviation, count = _sum_and_count((values - mean) ** 2, mask, across_ranks)
    denominator = count - 1 if unbiased and count > 1 else count.clamp(min=1.0)
    return (squared_deviation / denominator).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  across_ranks: bool = False) -> Tensor:
    """(values − mean) / std over masked entries only; masked positions come back as 0."""
    mean = masked_mean(values, mask, across_ranks=across_ranks)
    std = masked_var(values, mask, across_ranks=across_ranks).clamp(min=0.0).sqrt()
    whitened = (values - mean) / (std + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask
