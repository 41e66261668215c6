"""The off-policy correction of a loss-placed KL term (``kl.off_policy_correction``, kind ``kl_correction``).

Samples y come from a behaviour policy μ (a stale policy k updates back, an engine whose numbers are not the
trainer's, π_old in a later epoch), the penalty wanted is KL(π_θ‖π_ref). Each correction returns the per-token
weight [B, T] the estimate is multiplied by in the loss (None: unweighted). μ's log-probs are the rollout's
``sampler_logprobs`` where it has them (the engine's, or the stale policy's), else π_old's (``logprobs``).

- ``policy``: the weight the policy loss gets (``algorithm.tis_cap`` / ``tis_mode``; none without a cap) —
  sg(π_old/μ), truncated or masked: the estimate's expectation moves to π_old, its gradient is k2's.
- ``none``: no weight: the expectation stays under μ.
- ``token_ratio``: π_θ(y_t)/μ(y_t) with gradient through π_θ (DeepSeek-V3.2's unbiased k3; arXiv 2510.01555):
  E_μ[(π_θ/μ)·f] = E_π[f], so an estimator whose VALUE is unbiased (k1, k3, full) gets the exact gradient
  of one token's KL — k3 included, on-policy too (there the weight is 1 with gradient ∇log π).
- ``prefix_ratio``: Π_{s≤t} π_θ(y_s)/μ(y_s), with gradient: the prefix's weight too, so the sum over positions
  has expectation Σ_t E_π[f_t] = KL of the whole sequence, and its gradient carries the KL to go.

Which estimator × placement × correction is exact is ``OFF_POLICY_KL_GRADIENT`` and
``OFF_POLICY_SEQUENCE_KL_GRADIENT`` in :mod:`rlhf_lab.kl.truth`, checked by enumeration.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_lab.registry import register


def behaviour_logprobs(logprobs: Tensor, batch: Any) -> Tensor:
    """μ's per-token log-probs of the sampled tokens [B, T]: the sampler's where the rollout has them, else
    π_old's (the rollout's own, or the training pass's detached ones for a one-update rollout)."""
    sampler = getattr(batch, "sampler_logprobs", None)
    if sampler is not None:
        return sampler
    old = getattr(batch, "old_logprobs", None)
    return old(logprobs) if callable(old) else batch.logprobs


@register("kl_correction", "policy")
def policy_weights(logprobs: Tensor, batch: Any, mask: Tensor) -> Tensor | None:
    """The policy loss's sampler–trainer weights (``Rollout.tis_weights``), None without ``algorithm.tis_cap``."""
    return getattr(batch, "tis_weights", None)


@register("kl_correction", "none")
def no_weights(logprobs: Tensor, batch: Any, mask: Tensor) -> Tensor | None:
    """None: the estimate unweighted, its expectation under the behaviour policy μ."""
    return None


@register("kl_correction", "token_ratio")
def token_ratio(logprobs: Tensor, batch: Any, mask: Tensor) -> Tensor:
    """π_θ(y_t)/μ(y_t) per token, with gradient through π_θ; 0 off the response."""
    log_ratio = (logprobs - behaviour_logprobs(logprobs, batch).detach()) * mask
    return torch.exp(log_ratio) * mask


@register("kl_correction", "prefix_ratio")
def prefix_ratio(logprobs: Tensor, batch: Any, mask: Tensor) -> Tensor:
    """Π_{s≤t} π_θ(y_s)/μ(y_s) over the response's positions up to t, with gradient; 0 off the response."""
    log_ratio = (logprobs - behaviour_logprobs(logprobs, batch).detach()) * mask
    return torch.exp(log_ratio.cumsum(-1)) * mask


for _correction in (token_ratio, prefix_ratio):
    _correction.own_ratio = True  # the estimator's own ratio π_θ/μ: a loss-placed KL only, not beside importance_weight
