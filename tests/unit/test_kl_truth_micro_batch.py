"""The micro-batch rows of the truth table (``MICRO_BATCH_INVARIANCE`` in rlhf_lab/kl/truth.py), by exact enumeration.

A tabular policy writes responses of length 1 or 2 (symbol 0 ends a response): 7 responses. A mini-batch is three of
them; its loss is the trainer's: the policy loss −A·log π (A: the reward minus the batch mean) plus k2 in the loss
(β = 0.2), both reduced by the registered ``loss_aggregation``. The expected gradient sums every one of the 7³
mini-batches, weighted by its probability, accumulating the gradients of the micro-batches of one cut of the rows;
every cut (1+1+1, 1+2, 2+1, 3) must give the same expected gradient when the aggregation divides by the mini-batch's
totals (``LossContext``, as ``step/update.py`` builds it) and does not when it divides by each micro-batch's own.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import rlhf_lab.components  # noqa: F401  (registers the aggregations and placements)
from rlhf_lab.algorithms.base import LossContext, aggregate
from rlhf_lab.kl import MICRO_BATCH_INVARIANCE, estimate
from rlhf_lab.registry import get, names

DOUBLE = torch.float64
FIRST = torch.tensor([0.3, -0.2, 0.5], dtype=DOUBLE)  # logits of the first symbol (0 ends the response)
SECOND = torch.tensor([[0.0, 0.0, 0.0], [0.4, -0.6, 0.1], [-0.3, 0.2, 0.9]], dtype=DOUBLE)  # after symbol 1, 2
REF_FIRST = torch.tensor([0.0, 0.4, -0.2], dtype=DOUBLE)
REF_SECOND = torch.tensor([[0.0, 0.0, 0.0], [0.1, 0.0, -0.5], [0.6, -0.1, 0.0]], dtype=DOUBLE)
RESPONSES = [(0,), *((first, second) for first in (1, 2) for second in range(3))]  # 7 responses, lengths 1 and 2
REWARDS = torch.tensor([0.2, 1.0, 0.1, 0.5, 0.0, 0.8, 0.3], dtype=DOUBLE)
CUTS = ((1, 1, 1), (1, 2), (2, 1), (3,))  # every cut of three rows into consecutive micro-batches
BETA = 0.2


def rows(theta_first: torch.Tensor, theta_second: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(log π [7, 2], log π_ref [7, 2], mask [7, 2], log π(response) [7]) of every response, padded to 2 tokens."""
    log_first, log_second = theta_first.log_softmax(-1), theta_second.log_softmax(-1)
    ref_first, ref_second = REF_FIRST.log_softmax(-1), REF_SECOND.log_softmax(-1)
    logprobs, ref_logprobs, mask = [], [], []
    for response in RESPONSES:
        if len(response) == 1:
            logprobs.append(torch.stack([log_first[0], log_first.new_zeros(())]))
            ref_logprobs.append(torch.stack([ref_first[0], ref_first.new_zeros(())]))
            mask.append([1.0, 0.0])
        else:
            first, second = response
            logprobs.append(torch.stack([log_first[first], log_second[first, second]]))
            ref_logprobs.append(torch.stack([ref_first[first], ref_second[first, second]]))
            mask.append([1.0, 1.0])
    logprobs, mask = torch.stack(logprobs), torch.tensor(mask, dtype=DOUBLE)
    return logprobs, torch.stack(ref_logprobs), mask, (logprobs * mask).sum(-1)


def expected_gradient(aggregation: str, normaliser: str, cut: tuple[int, ...]) -> torch.Tensor:
    """E over every mini-batch of three responses of the gradient accumulated over ``cut``'s micro-batches."""
    theta = (FIRST.clone().requires_grad_(), SECOND.clone().requires_grad_())
    logprobs, ref_logprobs, mask, sequence_logprobs = rows(*theta)
    kl = estimate(get("kl", "mse"), logprobs, ref_logprobs, mask=mask)
    surrogate = torch.zeros((), dtype=DOUBLE)
    for batch in itertools.product(range(len(RESPONSES)), repeat=3):
        index = torch.tensor(batch)
        advantages = (REWARDS[index] - REWARDS[index].mean())[:, None].expand(-1, 2)
        whole = LossContext(float(mask[index].sum()), 3, max_response_tokens=2)
        loss, start = torch.zeros((), dtype=DOUBLE), 0
        for size in cut:
            positions = slice(start, start + size)
            micro = index[positions]
            start += size
            context = whole if normaliser == "mini-batch" else LossContext(float(mask[micro].sum()), size, 2)
            m = mask[micro]
            policy = aggregate(-advantages[positions] * logprobs[micro], m, aggregation, context)
            reduce = lambda values, m, context=context: aggregate(values, m, aggregation, context)  # noqa: E731
            loss = loss + policy + get("kl_placement", "loss").loss_term(kl[micro], m, BETA, reduce=reduce)
        surrogate = surrogate + sequence_logprobs[index].sum().exp().detach() * loss
    gradients = torch.autograd.grad(surrogate, theta)
    return torch.cat([g.reshape(-1) for g in gradients])


def test_the_table_covers_every_aggregation() -> None:
    assert set(MICRO_BATCH_INVARIANCE) == {(name, normaliser) for name in names("loss_aggregation")
                                           for normaliser in ("mini-batch", "micro-batch")}


@pytest.mark.parametrize(("aggregation", "normaliser"), sorted(MICRO_BATCH_INVARIANCE))
def test_the_micro_batch_cell(aggregation: str, normaliser: str) -> None:
    whole = expected_gradient(aggregation, normaliser, (3,))
    assert float(whole.norm()) > 0.01
    differences = [float((expected_gradient(aggregation, normaliser, cut) - whole).norm() / whole.norm())
                   for cut in CUTS[:-1]]
    if MICRO_BATCH_INVARIANCE[(aggregation, normaliser)]:
        assert max(differences) < 1e-12, differences
    else:
        assert max(differences) > 0.01, differences
