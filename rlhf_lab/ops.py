"""Small masked tensor operations shared by KL estimators, algorithms and the trainer.

Shapes: per-token tensors are ``[B, T]``; ``mask`` is 1.0 on response tokens that count and 0.0 on
prompt and padding positions. Every reduction here ignores masked positions entirely.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Rows per chunk of a [rows, V] float32 temporary: 64 × 49,152 × 4 B = 12.6 MB, under glibc's 32 MB mmap
# threshold, so chunk temporaries are reused from the heap instead of being mapped and page-faulted afresh
# (exact KL of [16, 32, 49152] logits: 152 ms in 1024-row chunks, 40 ms in 64-row ones; results per row
# do not depend on the chunking).
ROW_CHUNK = 64


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask over ``dim`` (all dims if None)."""
    product = values * mask
    return product.sum() if dim is None else product.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask / Σ mask over ``dim``; 0 where the mask is empty."""
    total = masked_sum(values, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1.0)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries (Bessel-corrected when ``unbiased`` and more than one entry)."""
    mean = masked_mean(values, mask)
    squared_deviation = masked_sum((values - mean) ** 2, mask)
    count = mask.sum()
    denominator = count - 1 if unbiased and count > 1 else count.clamp(min=1.0)
    return squared_deviation / denominator


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(values − mean) / std over masked entries only; masked positions come back as 0."""
    mean = masked_mean(values, mask)
    std = masked_var(values, mask).clamp(min=0.0).sqrt()
    whitened = (values - mean) / (std + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def needs_float32_logits(temperature: float, *read_by: bool) -> bool:
    """Whether a pass must hand on its [B, T, V] logits in float32 (:func:`scale_logits`' ``float32``): where the
    temperature divides them, or where a reader of the whole logits is among ``read_by`` (an estimator or
    algorithm that reads them). Otherwise only the log-prob gather and the exact KL read them, and both upcast
    row chunks themselves: under autocast the LM head's bf16 logits give the same numbers without a float32 copy.
    """
    return temperature != 1.0 or any(read_by)


def scale_logits(logits: Tensor, temperature: float, float32: bool = True) -> Tensor:
    """``logits`` in float32 divided by ``temperature``: the policy's distribution is their softmax.

    At temperature 1 the division is skipped (x / 1 is x exactly): on [B, T, V] logits it would allocate
    another full tensor in the forward pass and again in the backward pass, for the same numbers. With
    ``float32=False`` they are also left in their own dtype there (bf16 under autocast: the same numbers,
    without a float32 copy, for readers that upcast row chunks themselves).
    """
    if not float32 and temperature == 1.0:
        return logits
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


class _GatherLogprobs(torch.autograd.Function):
    """log softmax(z)[token] per row, in row chunks, with a hand-written backward that works in place.

    Autograd through ``token logit − logsumexp`` allocates five [rows, V] tensors in the backward pass
    (z − lse, its exp, its product with the upstream gradient, the scattered one-hot gradient, their sum);
    here ∂/∂z_v = g·1[v = token] − g·exp(z_v − lse) is written into one tensor with the same elementwise
    operations in the same order, so the gradient equals autograd's bit for bit (tests/unit/test_ops.py).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, chunk_size: int) -> Tensor:  # type: ignore[override]
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_tokens = tokens.reshape(-1)
        pieces, sums = [], []
        for start in range(0, flat_logits.shape[0], chunk_size):
            rows = flat_logits[start : start + chunk_size].float()
            picked = rows.gather(-1, flat_tokens[start : start + chunk_size, None]).squeeze(-1)
            sums.append(torch.logsumexp(rows, dim=-1))
            pieces.append(picked - sums[-1])
        ctx.save_for_backward(logits, tokens, torch.cat(sums))
        ctx.chunk_size = chunk_size
        return torch.cat(pieces).reshape(tokens.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, tokens, log_sums = ctx.saved_tensors
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_tokens = tokens.reshape(-1, 1)
        upstream = grad_out.reshape(-1, 1).to(log_sums.dtype)
        grad = torch.empty(flat_logits.shape, dtype=logits.dtype, device=logits.device)
        in_place = grad.dtype == log_sums.dtype  # else each chunk is made in float32, then written in grad's dtype
        for start in range(0, flat_logits.shape[0], ctx.chunk_size):
            stop = start + ctx.chunk_size
            rows = flat_logits[start:stop].float()
            block = grad[start:stop] if in_place else torch.empty_like(rows)
            torch.sub(rows, log_sums[start:stop, None], out=block)
            block.exp_().mul_(-upstream[start:stop])  # the logsumexp term: −g·exp(z − lse)
            block.scatter_add_(1, flat_tokens[start:stop], upstream[start:stop])  # the picked logit: +g
            if not in_place:
                grad[start:stop] = block
        return grad.reshape(logits.shape), None, None


def gather_logprobs(logits: Tensor, tokens: Tensor, chunk_size: int = ROW_CHUNK) -> Tensor:
    """log softmax(logits)[tokens] per position, computed in row chunks.

    ``logits`` [B, T, V], ``tokens`` [B, T] -> [B, T]. Chunking keeps only one [chunk, V] float32
    temporary alive at a time instead of the whole [B, T, V] log-softmax, in the forward and (written in
    place, :class:`_GatherLogprobs`) the backward pass; the result equals
    ``logits.log_softmax(-1).gather(-1, tokens[..., None])`` to float precision.
    """
    return _GatherLogprobs.apply(logits, tokens, chunk_size)


def entropy_from_logits(logits: Tensor, chunk_size: int = ROW_CHUNK) -> Tensor:
    """Full-vocabulary entropy −Σ_v p(v) log p(v) per position: [B, T, V] -> [B, T]."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        log_p = flat_logits[start : start + chunk_size].float().log_softmax(-1)
        pieces.append(-(log_p.exp() * log_p).sum(-1))
    return torch.cat(pieces).reshape(logits.shape[:-1])
