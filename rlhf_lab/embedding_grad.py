"""The input embedding's gradient added by rows in the training pass, not as a [V, H] tensor per lookup.

PyTorch's embedding backward makes a dense [V, H] gradient for every lookup (zeros, then each looked-up
token's row added), and autograd sums those with whatever else reaches the weight: per step of the bench's
full fine-tuning (the shared prompt prefill and the continuation are two lookups; the weight is tied to the
LM head) that is two 108 MiB zero-filled tensors and two 108 MiB sums, each freshly mapped memory (the
largest transients of the backward pass). Here each lookup's backward keeps only its tokens' rows, computed
by the same kernel over the tokens it saw (``embedding_dense_backward`` with the indices renumbered: the same
additions in the same order), and when the backward pass is over they are added into the weight's gradient
in place, in the order autograd would have summed them. The gradient is the plain pass's bit for bit:

- an untied embedding gets only its lookups' gradients: autograd sums them in the order their backward runs,
  from zero; the same here;
- a weight tied to the LM head, under autocast: the head's products reach the weight through autocast's one
  cached cast, which runs before the prompt prefill's lookup (it is created after it, and the engine runs the
  latest-made ready node first), so autograd adds the lookups' gradients to the cast head gradient in the
  order their backward runs; the same here. Without autocast the head's products arrive one by one between
  the lookups' gradients, an order this does not reproduce: a tied weight in float32 keeps the plain pass.

Off where something else reads the gradient during the backward pass (DDP's and FSDP's reducers, a hook on
the weight) and for embeddings that are not a plain ``nn.Embedding`` lookup (``max_norm``, scaled or sparse
gradients, subclasses). The wrapping is an instance ``forward`` for the training pass, removed after it, as
:mod:`rlhf_lab.recompute` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class _RowLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward hands the weight's gradient rows to ``rows``
    (a list of (token ids, [tokens, H] rows)) instead of returning a [V, H] gradient."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, ids: Tensor, padding_idx: int | None, rows: list) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.rows = padding_idx, rows
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None]:
        (ids,) = ctx.saved_tensors
        tokens, renumbered = torch.unique(ids, return_inverse=True)
        padding = -1
        if ctx.padding_idx is not None:
            match = (tokens == ctx.padding_idx).nonzero()
            padding = int(match[0, 0]) if len(match) else -1
        # PyTorch's own dense embedding backward, over only the tokens seen: the same additions in the same order.
        values = torch.ops.aten.embedding_dense_backward(grad, renumbered, tokens.numel(), padding, False)
        ctx.rows.append((tokens, values))
        return None, None, None, None


def embedding_by_rows(model: nn.Module, autocast: bool) -> nn.Embedding | None:
    """The input embedding whose gradient :func:`rows_gradient` can add by rows bit for bit, or None.

    ``autocast``: whether the training pass runs under autocast (a weight tied to the LM head needs it).
    The caller keeps it off under DDP and FSDP, whose reducers read the gradient during the backward pass.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None or embedding.scale_grad_by_freq \
            or embedding.sparse:
        return None
    weight = embedding.weight
    if not weight.requires_grad or weight.device.type != "cpu" or type(weight.data) is not torch.Tensor \
            or weight._backward_hooks \
            or getattr(weight, "_post_accumulate_grad_hooks", None):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and getattr(head, "weight", None) is weight
    return embedding if autocast or not tied else None


@contextmanager
def rows_gradient(embedding: nn.Embedding | None) -> Iterator[None]:
    """Within the block (the training forward pass and its backward), ``embedding``'s lookups leave their
    gradient rows aside; on leaving, they are added into its weight's gradient. A no-op for None or where
    gradients are off."""
    if embedding is None or not torch.is_grad_enabled():
        yield
        return
    weight, rows = embedding.weight, []
    before, weight.grad = weight.grad, None  # what earlier micro-batches accumulated, added back last
    own = embedding.__dict__.get("forward")
    embedding.forward = lambda ids: _RowLookup.apply(weight, ids, embedding.padding_idx, rows)
    try:
        yield
    finally:
        if own is None:
            del embedding.forward
        else:
            embedding.forward = own
        grad = weight.grad
        if rows and grad is None:
            grad = torch.zeros_like(weight)
        for tokens, values in rows:  # in the order their backward ran: autograd's order of summing them
            grad.index_add_(0, tokens, values)
        if before is not None:
            grad = before if grad is None else before.add_(grad)
        weight.grad = grad
