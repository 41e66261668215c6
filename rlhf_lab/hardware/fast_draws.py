"""Multinomial's draws for CPU decode steps, computed only where a token can win (``hardware.fast_draws``).

``torch.multinomial(probs, 1)`` on a CPU draws one float64 uniform per vocabulary entry, turns each into an
exponential one with the C library's ``log1p`` under the generator's lock, and takes the first argmax of
p / q. :func:`sample_tokens` consumes the generator identically and returns the same token for every row, but
computes q only for the few entries that can win. The decode loop takes it as its ``sample`` function where the
run's hardware profile asks for it; elsewhere it samples with ``torch.multinomial`` itself.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# A float64 draw this close (relatively) to a float32 rounding boundary is recomputed by the C library's log1p.
_UNSURE = 2.0**-48

def draws_from_uniform(uniform: Tensor) -> Tensor:
    """Exp(1) draws in float32 from float64 uniforms ``u``: the numbers ``exponential_`` makes, vectorised.

    PyTorch's CPU ``exponential_`` takes a 53-bit uniform u per element (``uniform_`` in float64 consumes the
    generator the same way), computes −log1p(−u) in float64 with the C library's ``log1p``, one element at a
    time under the generator's lock, and rounds to float32. PyTorch's ``log1p`` is within an ulp of the C
    library's, so the two round to the same float32 unless the value lies within a few ulps of a rounding
    boundary (about one draw in 10⁸); those are recomputed with ``math.log1p``, the C library's. A zero draw
    (u = 0) is +0 either way: the vectorised ``log1p`` keeps the sign of −0 (tested).
    """
    exact = torch.log1p(uniform.neg()).neg_()
    draws = exact.float()
    unsure = (exact * (1 - _UNSURE)).float() != (exact * (1 + _UNSURE)).float()
    if bool(unsure.any()):
        index = unsure.nonzero(as_tuple=True)
        draws[index] = torch.tensor([-math.log1p(-u) for u in uniform[index].tolist()], dtype=draws.dtype)
    return draws

# A token's ratio float32(p / float32(−log1p(−u))) never exceeds its bound float32(p / float32(u)): −log1p(−u)
# ≥ u, the C library's log1p (faithfully rounded) keeps that in float64, and rounding to float32 is monotone.
# Tokens whose bound falls below the best exact ratio found therefore cannot win; the margin is kept against a
# log1p an ulp off.
_BOUND_MARGIN = 2.0**-20

def sample_tokens(probs: Tensor) -> Tensor:
    """``torch.multinomial(probs, 1).squeeze(1)`` for [B, V] ``probs``: the same token per row from the same
    random numbers. For one sample multinomial takes the first argmax of p / q in float32, with q ~ Exp(1)
    drawn by ``exponential_`` (float32(−log1p(−u)) for a float64 uniform u per entry, see
    :func:`draws_from_uniform`). On CPU in float32 the uniforms are drawn alike, but q is computed only where
    the token can win: since q ≥ u, p / u bounds the ratio from above, so the exact ratio of each row's best
    p / u sets a threshold, and only the entries whose bound reaches it (about one a row) get their exact q.
    A NaN bound (p = 0 at a zero draw, which multinomial's argmax would pick) sends the whole batch down the
    full path. Invalid rows (inf, nan, a negative entry, a zero sum) go to multinomial itself, which refuses
    them before drawing.
    """
    fast = probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2
    if not fast or not bool((probs.max() < math.inf) & (probs.min() >= 0) & (probs.sum(-1) > 0).all()):
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    uniform = torch.empty(probs.shape, dtype=torch.float64).uniform_()
    bound = uniform.float()
    bound = torch.div(probs, bound, out=bound)  # u ≥ 2⁻⁵³ (or 0) is a normal float32, the quotient is ≤ 2⁵³
    best_bound, best = bound.max(-1, keepdim=True)  # argmax's index (the first NaN, else the first maximum)
    if bool(best_bound.isnan().any()):
        return (probs / draws_from_uniform(uniform)).argmax(-1)
    best_ratio = probs.gather(-1, best) / draws_from_uniform(uniform.gather(-1, best))  # exact, float32
    rows, cols = (bound >= best_ratio * (1 - _BOUND_MARGIN)).nonzero(as_tuple=True)
    ratio = probs[rows, cols] / draws_from_uniform(uniform[rows, cols])
    return first_argmax(ratio, rows, cols, probs.shape)

def first_argmax(values: Tensor, rows: Tensor, cols: Tensor, shape: torch.Size) -> Tensor:
    """The argmax of each row of a [B, V] tensor of ``shape`` that holds ``values`` at (``rows``, ``cols``)
    and −inf elsewhere (no NaN among them, every row holding one at least): the lowest column holding the
    row's largest value, as ``argmax`` picks among ties, from the few entries alone."""
    batch, width = shape
    top = values.new_full((batch,), -math.inf).scatter_reduce_(0, rows, values, "amax")
    winners = torch.where(values == top[rows], cols, width)
    return cols.new_full((batch,), width).scatter_reduce_(0, rows, winners, "amin")
