"""Exact KL(π‖π_ref) per position from full-vocabulary logits, chunked, with a hand-written backward.

Used by the ``full`` estimators and logged every step as ``kl/exact`` beside the configured estimate.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from rlhf_lab.scoring.logprobs import row_chunk


def _row_blocks(*tensors: Tensor) -> list[tuple[Tensor, ...]]:
    """Matching 2-D [rows, V] views of [B, T, V] tensors, without copying.

    One block [B·T, V] when every tensor can be viewed that way; otherwise (e.g. a slice along T of a
    longer [B, T_full, V] tensor) one [T, V] block per batch element. Row order is (b, t) either way.
    """
    if all(_rows_merge(tensor) for tensor in tensors):
        return [tuple(tensor.view(-1, tensor.shape[-1]) for tensor in tensors)]
    return list(zip(*(tensor.unbind(0) for tensor in tensors)))


def _rows_merge(tensor: Tensor) -> bool:
    """Whether ``tensor``'s first two dimensions merge into one without a copy (``view``): each b's rows follow the
    previous b's at the same stride (a slice along T of a longer tensor does not)."""
    batch, rows = tensor.shape[0], tensor.shape[1]
    return batch <= 1 or rows <= 1 or tensor.stride(0) == tensor.stride(1) * rows


def _probs_and_log_ratio(logits_rows: Tensor, ref_rows: Tensor) -> tuple[Tensor, Tensor]:
    """p = softmax(z) and log p − log q for [rows, V] chunks, in at least float32, with few temporaries."""
    compute_dtype = torch.promote_types(logits_rows.dtype, torch.float32)
    log_ratio = logits_rows.to(compute_dtype).log_softmax(-1)  # log p for now
    p = log_ratio.exp()
    log_ratio -= ref_rows.to(compute_dtype).log_softmax(-1)
    return p, log_ratio


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_v a[r, v]·b[r, v] per row, without a [rows, V] temporary: [rows, V] × 2 -> [rows].

    In the inputs' precision even inside autocast (the reference pass runs under it), which would
    otherwise take this product in bfloat16."""
    with torch.autocast(a.device.type, enabled=False):
        return (a.unsqueeze(-2) @ b.unsqueeze(-1)).reshape(a.shape[0])


class _ExactKL(torch.autograd.Function):
    """KL(softmax(z)‖softmax(w)) per row with a hand-written, equally chunked backward.

    Autograd through a plain chunk loop would save every chunk's float32 log-softmax for backward, i.e.
    the whole [B, T, V] tensor; here only the inputs are kept and the backward recomputes per chunk:
        ∂KL/∂z_j = p_j (log p_j − log q_j − KL),   ∂KL/∂w_j = q_j − p_j,   p = softmax(z), q = softmax(w).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ref_logits: Tensor, chunk_size: int) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(logits, ref_logits)
        ctx.chunk_size = chunk_size
        pieces = []
        for logits_block, ref_block in _row_blocks(logits, ref_logits):
            for start in range(0, logits_block.shape[0], chunk_size):
                stop = start + chunk_size
                p, log_ratio = _probs_and_log_ratio(logits_block[start:stop], ref_block[start:stop])
                pieces.append(_row_dot(p, log_ratio))
        return torch.cat(pieces).reshape(logits.shape[:-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        logits, ref_logits = ctx.saved_tensors
        need_logits_grad, need_ref_grad = ctx.needs_input_grad[:2]
        # Fresh contiguous tensors (every row gets written): they split into blocks like the inputs.
        grad_logits = (
            torch.empty_like(logits, memory_format=torch.contiguous_format) if need_logits_grad else None
        )
        grad_ref = (
            torch.empty_like(ref_logits, memory_format=torch.contiguous_format) if need_ref_grad else None
        )
        grad_rows = grad_kl.reshape(-1)
        blocks = _row_blocks(*(t for t in (logits, ref_logits, grad_logits, grad_ref) if t is not None))
        offset = 0
        for logits_block, ref_block, *grad_blocks in blocks:
            grad_logits_block = grad_blocks.pop(0) if need_logits_grad else None
            grad_ref_block = grad_blocks.pop(0) if need_ref_grad else None
            for start in range(0, logits_block.shape[0], ctx.chunk_size):
                stop = start + ctx.chunk_size
                p, log_ratio = _probs_and_log_ratio(logits_block[start:stop], ref_block[start:stop])
                upstream = grad_rows[offset : offset + p.shape[0], None].to(p.dtype)  # [rows, 1]
                offset += p.shape[0]
                if grad_ref_block is not None:  # (q − p)·upstream
                    q = ref_block[start:stop].to(p.dtype).softmax(-1)
                    grad_ref_block[start:stop] = q.sub_(p).mul_(upstream)
                if grad_logits_block is not None:  # p·(log p − log q − KL)·upstream, in place
                    kl = _row_dot(p, log_ratio)[:, None]
                    grad_logits_block[start:stop] = log_ratio.sub_(kl).mul_(p).mul_(upstream)
        return grad_logits, grad_ref, None


def exact_kl(logits: Tensor, ref_logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Exact per-position KL(π‖π_ref) = Σ_v π(v)(log π(v) − log π_ref(v)): [B, T, V] × 2 -> [B, T].

    π = softmax(logits), π_ref = softmax(ref_logits), computed in float32 (or float64 if given) over at
    most ``chunk_size`` rows at a time, so the [B, T, V] float32 log-softmaxes are never materialised
    whole, in forward or backward. Differentiable w.r.t. ``logits`` (and ``ref_logits``). Either may be a
    :class:`~rlhf_lab.scoring.head.HeadLogits`: then the logits are made from the hidden states chunk by chunk.
    """
    if not isinstance(logits, Tensor) or not isinstance(ref_logits, Tensor):  # a HeadLogits on either side
        head = ref_logits if isinstance(logits, Tensor) else logits
        return head.exact_kl(logits, ref_logits)
    if logits.dim() != 3 or logits.shape != ref_logits.shape:
        raise ValueError(
            f"exact_kl needs logits and ref_logits of the same shape [B, T, V]; got {tuple(logits.shape)} "
            f"and {tuple(ref_logits.shape)}"
        )
    chunk_size = row_chunk() if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows; got {chunk_size}")
    return _ExactKL.apply(logits, ref_logits, chunk_size)
