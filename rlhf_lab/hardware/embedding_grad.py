"""The input embedding's gradient added by rows in the training pass, not as a [V, H] tensor per lookup.

PyTorch's embedding backward makes a dense [V, H] gradient for every lookup (zeros, then each looked-up
token's row added), and autograd sums those with whatever else reaches the weight: in a step of full
fine-tuning (the shared prompt prefill and the continuation are two lookups; the weight is tied to the LM
head) that is two zero-filled [V, H] tensors and two [V, H] sums, each freshly mapped memory (the largest
transients of the backward pass on a small model). Here each lookup's backward keeps only its tokens' rows, computed
by the same kernel over the tokens it saw (``embedding_dense_backward`` with the indices renumbered: the same
additions in the same order), and when the backward pass is over they are added into the weight's gradient
in place, in the order autograd would have summed them. The gradient is the plain pass's bit for bit:

- an untied embedding gets only its lookups' gradients: autograd sums them in the order their backward runs,
  from zero; the same here;
- a weight tied to the LM head, under autocast: the head's products reach the weight through autocast's one
  cached cast, which runs before the prompt prefill's lookup (it is created after it, and the engine runs the
  latest-made ready node first), so autograd adds the lookups' gradients to the cast head gradient in the
  order their backward runs; the same here;
- a weight tied to the LM head without autocast: the head's products reach the weight one by one, between the
  lookups' gradients. Each head call then multiplies by the weight through a tap of its own (an identity made
  just before the product), whose backward hands the product's [V, H] gradient to the same ordered sum as the
  lookups' rows instead of to autograd. On one CPU thread the engine runs a tap right after the node that
  feeds it (nothing ready has a later creation number), so each gradient joins the sum at the moment it would
  have joined autograd's: the first [V, H] gradient is the sum, later ones are added in place, rows are
  added into it (a zero [V, H] sum first, where a lookup's gradient comes before any head gradient, as
  PyTorch's own lookup gradient starts from zeros).

Off where something else reads the gradient during the backward pass (DDP's and FSDP's reducers, a hook on
the weight) and for embeddings that are not a plain ``nn.Embedding`` lookup (``max_norm``, scaled or sparse
gradients, subclasses). The wrapping is an instance ``forward`` for the training pass, removed after it, as
:mod:`rlhf_lab.models.recompute` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from rlhf_lab.runtime.distributed import sharded


class _Sum:
    """The weight's gradient contributions of one pass, in the order their backward runs.

    ``ordered``: each is added on arrival (a [V, H] gradient is the sum or is added to it in place; rows are
    added into the sum, a zero one where none exists yet); otherwise the rows wait in ``rows`` and are added
    after the backward pass, onto the gradient autograd gave the weight."""

    def __init__(self, weight: Tensor, ordered: bool) -> None:
        self.weight, self.ordered = weight, ordered
        self.total: Tensor | None = None
        self.rows: list[tuple[Tensor, Tensor]] = []

    def add(self, grad: Tensor) -> None:
        if self.total is None:  # held as the weight's gradient will be (autograd's layout contract: the weight's)
            self.total = grad if grad.stride() == self.weight.stride() else grad.clone(memory_format=torch.contiguous_format)
        else:
            self.total.add_(grad)

    def add_rows(self, tokens: Tensor, values: Tensor) -> None:
        if not self.ordered:
            self.rows.append((tokens, values))
            return
        if self.total is None:
            self.total = torch.zeros_like(self.weight)
        self.total.index_add_(0, tokens, values)

    def finish(self, grad: Tensor | None) -> Tensor | None:
        """The weight's gradient of the pass, given what autograd accumulated into it (``grad``)."""
        if self.total is not None:
            grad = self.total if grad is None else grad.add_(self.total)  # a use nothing tapped (math still whole)
        if self.rows and grad is None:
            grad = torch.zeros_like(self.weight)
        for tokens, values in self.rows:  # in the order their backward ran: autograd's order of summing them
            grad.index_add_(0, tokens, values)
        return grad


class _Tap(torch.autograd.Function):
    """The identity on ``weight`` whose backward hands the gradient to ``total`` instead of autograd."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, total: _Sum) -> Tensor:
        ctx.total = total
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None]:
        ctx.total.add(grad)
        return None, None


class _RowLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward hands the weight's gradient rows to ``total``
    (token ids, [tokens, H] rows) instead of returning a [V, H] gradient."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, ids: Tensor, padding_idx: int | None, total: _Sum) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.total = padding_idx, total
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
        ctx.total.add_rows(tokens, values)
        return None, None, None, None


def _hooked(weight: Tensor) -> bool:
    """Whether something reads ``weight``'s gradient as autograd makes it (a hook on it)."""
    return bool(weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None))


class RowsPlan(NamedTuple):
    """What :func:`rows_gradient` rewires: the input embedding, and the LM head tied to it whose products are
    tapped (a tied weight without autocast), or None."""

    embedding: nn.Embedding
    head: nn.Linear | None


def embedding_by_rows(model: nn.Module, autocast: bool) -> RowsPlan | None:
    """The input embedding whose gradient :func:`rows_gradient` can add by rows bit for bit (with the LM head
    to tap where it is tied to it without autocast), or None.

    ``autocast``: whether the training pass runs under autocast. A tied head is tapped only where it is a
    plain ``nn.Linear``. The caller keeps it off under DDP and FSDP, whose reducers read the gradient during
    the backward pass.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if type(embedding) is not nn.Embedding or embedding.max_norm is not None or embedding.scale_grad_by_freq \
            or embedding.sparse:
        return None
    weight = embedding.weight
    if not weight.requires_grad or weight.device.type != "cpu" or sharded(weight) \
            or _hooked(weight):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and getattr(head, "weight", None) is weight
    if not tied or autocast:
        return RowsPlan(embedding, None)
    if type(head) is not nn.Linear or head._forward_hooks or head._forward_pre_hooks:
        return None
    return RowsPlan(embedding, head)


@contextmanager
def rows_gradient(plan: RowsPlan | None) -> Iterator[None]:
    """Within the block (the training forward pass and its backward), the embedding's lookups (and the tied
    head's products, where tapped) leave their gradients to an ordered sum; on leaving, it is added into the
    weight's gradient. A no-op for None, where gradients are off, or where a hook on the weight was registered
    since the plan was made (the hook then sees autograd's gradient, as in the plain pass)."""
    if plan is None or not torch.is_grad_enabled() or _hooked(plan.embedding.weight):
        yield
        return
    embedding, head = plan
    weight = embedding.weight
    total = _Sum(weight, ordered=head is not None)
    before, weight.grad = weight.grad, None  # what earlier micro-batches accumulated, added back last
    patched = [(embedding, lambda ids: _RowLookup.apply(weight, ids, embedding.padding_idx, total))]
    if head is not None:
        patched.append((head, lambda x: F.linear(x, _Tap.apply(weight, total), head.bias)))
    owns = [(module, module.__dict__.get("forward")) for module, _ in patched]
    for module, forward in patched:
        module.forward = forward
    try:
        yield
    finally:
        for module, own in owns:
            if own is None:
                del module.forward
            else:
                module.forward = own
        grad = total.finish(weight.grad)
        if before is not None:
            grad = before if grad is None else before.add_(grad)
        weight.grad = grad
