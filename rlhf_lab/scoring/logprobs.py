"""Log-probabilities and entropies from [B, T, V] logits, computed over row chunks.

A full-vocabulary log-softmax of a batch is the largest tensor of a step ([B, T, V] float32: 40 GB at 64 rows ×
1k tokens × 152k tokens). The functions here keep only one [rows, V] float32 chunk alive at a time, in the
forward and in the backward pass (:class:`_GatherLogprobs` writes its gradient in place). ``ROW_CHUNK`` is the
plain path's chunk; a hardware profile may run with its own (:func:`row_chunk`). Results per row do not depend on
the chunking.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

ROW_CHUNK = 1024  # rows of a [rows, V] float32 temporary (0.2 GB at V = 49,152)
_ROW_CHUNK: ContextVar[int] = ContextVar("row_chunk", default=ROW_CHUNK)


def row_chunk() -> int:
    """The rows per chunk of the run in progress (:data:`ROW_CHUNK` unless :func:`rows_per_chunk` set it)."""
    return _ROW_CHUNK.get()


@contextmanager
def rows_per_chunk(rows: int) -> Iterator[None]:
    """Within the block, the chunked functions here (and :func:`rlhf_lab.kl.exact.exact_kl`) take ``rows`` rows
    at a time unless told otherwise."""
    if rows < 1:
        raise ValueError(f"rows per chunk must be a positive number; got {rows}")
    token = _ROW_CHUNK.set(rows)
    try:
        yield
    finally:
        _ROW_CHUNK.reset(token)


def needs_float32_logits(temperature: float, *read_by: bool) -> bool:
    """Whether a pass must hand on its [B, T, V] logits in float32 (:func:`scale_logits`' ``float32``): where the
    temperature divides them, or where a reader of the whole logits is among ``read_by`` (an estimator or
    algorithm that reads them). Otherwise only the log-prob gather and the exact KL read them, and both upcast
    row chunks themselves: under autocast the LM head's bf16 logits give the same numbers without a float32 copy.
    """
    return temperature != 1.0 or any(read_by)

def upcast(tensor: Tensor) -> Tensor:
    """``tensor`` in float32 at least: half-precision logits are upcast, float64 ones stay float64 (a run in
    float64 keeps its precision through the log-softmax and the entropy)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def scale_logits(logits: Tensor, temperature: float, float32: bool = True) -> Tensor:
    """``logits`` in float32 (float64 stays float64) divided by ``temperature``: the policy's distribution is their softmax.

    At temperature 1 the division is skipped (x / 1 is x exactly): on [B, T, V] logits it would allocate
    another full tensor in the forward pass and again in the backward pass, for the same numbers. With
    ``float32=False`` they are also left in their own dtype there (bf16 under autocast: the same numbers,
    without a float32 copy, for readers that upcast row chunks themselves).
    """
    if not float32 and temperature == 1.0:
        return logits
    logits = upcast(logits)
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
            rows = upcast(flat_logits[start : start + chunk_size])
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
            rows = upcast(flat_logits[start:stop])
            block = grad[start:stop] if in_place else torch.empty_like(rows)
            torch.sub(rows, log_sums[start:stop, None], out=block)
            block.exp_().mul_(-upstream[start:stop])  # the logsumexp term: −g·exp(z − lse)
            block.scatter_add_(1, flat_tokens[start:stop], upstream[start:stop])  # the picked logit: +g
            if not in_place:
                grad[start:stop] = block
        return grad.reshape(logits.shape), None, None

def gather_logprobs(logits: Tensor, tokens: Tensor, chunk_size: int | None = None) -> Tensor:
    """log softmax(logits)[tokens] per position, computed in row chunks.

    ``logits`` [B, T, V], ``tokens`` [B, T] -> [B, T]. Chunking keeps only one [chunk, V] float32
    temporary alive at a time instead of the whole [B, T, V] log-softmax, in the forward and (written in
    place, :class:`_GatherLogprobs`) the backward pass; the result equals
    ``logits.log_softmax(-1).gather(-1, tokens[..., None])`` to float precision. ``logits`` may be a
    :class:`~rlhf_lab.scoring.head.HeadLogits` (computed from the hidden states in chunks, never whole).
    """
    if not isinstance(logits, Tensor):  # a HeadLogits
        return logits.logprobs(tokens)
    return _GatherLogprobs.apply(logits, tokens, row_chunk() if chunk_size is None else chunk_size)

def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Full-vocabulary entropy −Σ_v p(v) log p(v) per position: [B, T, V] (or a ``HeadLogits``) -> [B, T]."""
    if not isinstance(logits, Tensor):  # a HeadLogits
        return logits.entropy()
    chunk_size = row_chunk() if chunk_size is None else chunk_size
    flat_logits = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        log_p = upcast(flat_logits[start : start + chunk_size]).log_softmax(-1)
        pieces.append(-(log_p.exp() * log_p).sum(-1))
    return torch.cat(pieces).reshape(logits.shape[:-1])
