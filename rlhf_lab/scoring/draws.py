"""The decode's default draw: one token per row of the processed probabilities, as ``generate`` makes it. Here, below
both ``generation/`` (the decode) and ``hardware/`` (profiles that bring a faster draw with the same numbers), so
neither imports the other for it."""

from __future__ import annotations

import torch
from torch import Tensor


def multinomial(probs: Tensor) -> Tensor:
    """One token per row of [B, V] ``probs``: ``torch.multinomial``'s draw, as ``generate`` makes it."""
    return torch.multinomial(probs, num_samples=1).squeeze(1)
