"""Log-probs, entropy and the exact KL straight from the final hidden states, in chunks through the LM head.

A full-vocabulary logits tensor [B, T, V] is the largest of a step (float32 at 64 rows × 1,280 tokens × 152k
tokens: 50 GB, and as much again for its gradient). :class:`HeadLogits` stands for such a tensor without holding
it: the hidden states [B, T, H] the LM head reads, the head's weight, the temperature and the autocast the head
ran under. :func:`head_logprobs`, :func:`head_entropy` and :func:`head_exact_kl` run ``chunk`` positions at a time
through the head (``softmax(h Wᵀ / temperature)``) and, where a gradient is wanted, under non-reentrant activation
checkpointing: the forward keeps only each chunk's inputs, and the backward recomputes that chunk's logits. Peak
memory then grows with ``chunk × V``, not with ``B × T × V``; the values and gradients are the unchunked ones to
float precision (tests/unit/test_head_logits.py).

These are pure functions over tensors (a weight, hidden states, tokens), usable on fake tensors by a planner.
:func:`rlhf_lab.scoring.logprobs.gather_logprobs`, ``entropy_from_logits`` and
:func:`rlhf_lab.kl.exact.exact_kl` accept a :class:`HeadLogits` in place of a [B, T, V] tensor (they call its
methods), so their callers, the KL estimators among them, keep their shape contracts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

from rlhf_lab.kl.exact import exact_kl
from rlhf_lab.scoring.logprobs import gather_logprobs

DEFAULT_CHUNK = 1024  # positions per chunk through the LM head (trainer.lm_head_chunk)


@dataclass
class HeadLogits:
    """Temperature-scaled logits [B, T, V] = ``(hidden @ weightᵀ + bias) / temperature``, never held whole.

    ``autocast`` is the dtype the head ran under (None: no autocast), so each chunk rounds as the model's own
    LM head would. ``lora``: a LoRA adapter's (A [r, H], B [V, r], scale) where the head is LoRA-wrapped, adding
    ``scale · (hidden Aᵀ) Bᵀ`` as peft's layer does. Indexing rows (``select_rows``) and concatenation
    (:func:`cat_head_logits`) act on ``hidden``.
    """

    hidden: Tensor  # [B, T, H] the final hidden states the LM head reads (after the final norm)
    weight: Tensor  # [V, H]
    bias: Tensor | None = None  # [V]
    temperature: float = 1.0
    chunk: int = DEFAULT_CHUNK
    autocast: torch.dtype | None = None
    lora: tuple[Tensor, Tensor, float] | None = None

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"HeadLogits chunk must be a positive number of positions; got {self.chunk}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def dim(self) -> int:
        return len(self.shape)

    def select_rows(self, rows: Tensor) -> HeadLogits:
        """The same logits for batch rows ``rows`` only (Rollout.select)."""
        return replace(self, hidden=self.hidden[rows])

    def detach(self) -> HeadLogits:
        lora = None if self.lora is None else (self.lora[0].detach(), self.lora[1].detach(), self.lora[2])
        return replace(self, hidden=self.hidden.detach(), weight=self.weight.detach(),
                       bias=None if self.bias is None else self.bias.detach(), lora=lora)

    def tensors(self) -> tuple[Tensor | None, ...]:
        """Every tensor the logits are computed from (whether a gradient is wanted asks each)."""
        return (self.hidden, self.weight, self.bias, *(self.lora[:2] if self.lora is not None else ()))

    def rows(self, hidden_rows: Tensor) -> Tensor:
        """Logits of ``hidden_rows`` [rows, H]: [rows, V], temperature-scaled, in float32 at least."""
        with torch.autocast(hidden_rows.device.type, dtype=self.autocast or torch.float32,
                            enabled=self.autocast is not None):
            logits = functional.linear(hidden_rows, self.weight, self.bias)
            if self.lora is not None:
                a, b, scale = self.lora
                logits = logits + functional.linear(functional.linear(hidden_rows, a), b) * scale
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return logits if self.temperature == 1.0 else logits / self.temperature

    @staticmethod
    def cat(parts: list[HeadLogits]) -> HeadLogits:
        """:func:`cat_head_logits`."""
        return cat_head_logits(parts)

    def logprobs(self, tokens: Tensor) -> Tensor:
        """:func:`head_logprobs` (``gather_logprobs`` of these logits)."""
        return head_logprobs(self, tokens)

    def entropy(self) -> Tensor:
        """:func:`head_entropy` (``entropy_from_logits`` of these logits)."""
        return head_entropy(self)

    @staticmethod
    def exact_kl(logits: HeadLogits | Tensor, ref_logits: HeadLogits | Tensor) -> Tensor:
        """:func:`head_exact_kl` (``exact_kl`` where either side is a ``HeadLogits``)."""
        return head_exact_kl(logits, ref_logits)

    def materialize(self) -> Tensor:
        """The whole [B, T, V] tensor (for a reader that needs it; defeats the purpose elsewhere)."""
        flat = self.hidden.reshape(-1, self.hidden.shape[-1])
        return self.rows(flat).reshape(self.shape)


def cat_head_logits(parts: list[HeadLogits]) -> HeadLogits:
    """Batch rows of several :class:`HeadLogits` of one head, stacked (the scoring pass's chunks)."""
    return replace(parts[0], hidden=torch.cat([part.hidden for part in parts]))


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _over_chunks(fn: Callable[..., Tensor], chunk: int, row_inputs: list[Tensor], grad: bool) -> Tensor:
    """``fn`` over ``chunk`` rows of every [N, ...] tensor in ``row_inputs`` at a time, concatenated: [N].

    With ``grad`` each chunk runs under non-reentrant checkpointing, so its [chunk, V] logits are freed after
    its forward and recomputed in its backward."""
    rows = row_inputs[0].shape[0]
    pieces = []
    for start in range(0, rows, chunk):
        args = [t[start : start + chunk] for t in row_inputs]
        pieces.append(checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args))
    if not pieces:
        return row_inputs[0].new_zeros(0, dtype=torch.float32)
    return torch.cat(pieces)


def _flat(hidden: Tensor) -> Tensor:
    return hidden.reshape(-1, hidden.shape[-1])


def head_logprobs(logits: HeadLogits, tokens: Tensor) -> Tensor:
    """log softmax(logits)[tokens] per position: ``tokens`` [B, T] -> [B, T], ``chunk`` positions at a time."""
    def chunk_logprobs(hidden_rows: Tensor, token_rows: Tensor) -> Tensor:
        return gather_logprobs(logits.rows(hidden_rows), token_rows, chunk_size=hidden_rows.shape[0] or 1)

    grad = _needs_grad(*logits.tensors())
    flat = _over_chunks(chunk_logprobs, logits.chunk, [_flat(logits.hidden), tokens.reshape(-1)], grad)
    return flat.reshape(tokens.shape)


def head_entropy(logits: HeadLogits) -> Tensor:
    """Full-vocabulary entropy −Σ_v p(v) log p(v) per position: [B, T], ``chunk`` positions at a time."""

    def chunk_entropy(hidden_rows: Tensor) -> Tensor:
        log_p = logits.rows(hidden_rows).log_softmax(-1)
        return -(log_p.exp() * log_p).sum(-1)

    grad = _needs_grad(*logits.tensors())
    return _over_chunks(chunk_entropy, logits.chunk, [_flat(logits.hidden)], grad).reshape(logits.shape[:-1])


def head_exact_kl(logits: HeadLogits | Tensor, ref_logits: HeadLogits | Tensor) -> Tensor:
    """Exact KL(softmax(logits)‖softmax(ref_logits)) per position: [B, T], either side a :class:`HeadLogits` or a
    [B, T, V] tensor, ``chunk`` positions at a time (the smaller chunk where both sides are heads)."""
    sides = [logits, ref_logits]
    chunk = min(side.chunk for side in sides if isinstance(side, HeadLogits))
    inputs = [_flat(side.hidden) if isinstance(side, HeadLogits) else side.reshape(-1, side.shape[-1])
              for side in sides]

    def side_rows(side: HeadLogits | Tensor, rows: Tensor) -> Tensor:
        return side.rows(rows) if isinstance(side, HeadLogits) else rows

    def chunk_kl(policy_rows: Tensor, ref_rows: Tensor) -> Tensor:
        policy, ref = side_rows(logits, policy_rows), side_rows(ref_logits, ref_rows)
        return exact_kl(policy[None], ref[None], chunk_size=max(policy.shape[0], 1))[0]

    tensors = [t for side in sides for t in (side.tensors() if isinstance(side, HeadLogits) else (side,))]
    grad = _needs_grad(*tensors)
    return _over_chunks(chunk_kl, chunk, inputs, grad).reshape(logits.shape[:-1])
