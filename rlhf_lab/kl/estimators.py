"""KL estimators (kind ``kl``): per-token estimates of KL(π‖π_ref) along sampled responses.

Contract: ``estimator(logprobs, ref_logprobs, logits=None, ref_logits=None, **options) -> [B, T]``, where
``logprobs``/``ref_logprobs`` [B, T] are the sampled tokens' log-probabilities under the policy and the
reference and ``logits``/``ref_logits`` [B, T, V] their full-vocabulary logits (only estimators with
``needs_logits`` read them). Options (keywords, all optional): ``clamp_log_ratio`` bounds log r to [−c, c]
before the formula; ``mask`` [B, T] (read by estimators with ``needs_mask``, the sequence-level ones) says
which positions belong to the response. With l = log r = logprobs − ref_logprobs and sg() = stop-gradient:

    kl  (k1)       l                                  Schulman 2020; unbiased value, high variance
    abs            |l|                                biased value (arXiv 2512.21852)
    mse (k2)       ½ l²                               Schulman 2020; biased value, low variance
    k3             e^{−l} − 1 + l                     Schulman 2020; unbiased value, low variance, ≥ 0
    full           Σ_v π(v)(log π(v) − log π_ref(v))   exact per position (full logits)
    none           0
    k1_plus        value of k1, gradient of k2        verl's "k1+" (straight-through)
    k3_plus        value of k3, gradient of k2        verl's "k3+" (straight-through)
    sequence_k1    value of k1, gradient Σ_t sg(Σ_{t'≥t} l_t') ∇log π(x_t)        arXiv 2506.09477
    sequence_full  value of full, gradient ∇KL_t + sg(Σ_{t'>t} KL_t') ∇log π(x_t)  (the same, with the
                   exact local KL in place of the sampled log-ratios: lower variance)

What each gives as a *gradient* in each placement is tabulated in :mod:`rlhf_lab.kl.truth`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_lab.kl.exact import exact_kl
from rlhf_lab.registry import register


def log_ratio(logprobs: Tensor, ref_logprobs: Tensor, clamp_log_ratio: float | None = None) -> Tensor:
    """l = log π(x) − log π_ref(x), bounded to [−c, c] when ``clamp_log_ratio`` = c is given (verl uses 20)."""
    difference = logprobs - ref_logprobs
    return difference if clamp_log_ratio is None else difference.clamp(-clamp_log_ratio, clamp_log_ratio)


def straight_through(value: Tensor, gradient_source: Tensor) -> Tensor:
    """Equal to ``value`` (bit for bit), with the gradient of ``gradient_source``: (g − sg(g)) + sg(v)."""
    return (gradient_source - gradient_source.detach()) + value.detach()


def score_function(logprobs: Tensor, weight: Tensor) -> Tensor:
    """Zero in value, with gradient sg(weight)·∇log π(x): sg(w)·(log π − sg(log π))."""
    return weight.detach() * (logprobs - logprobs.detach())


def to_go(values: Tensor, mask: Tensor | None, inclusive: bool = True) -> Tensor:
    """Σ_{t' ≥ t} values_t' (``inclusive``) or Σ_{t' > t} over the response positions: [B, T] -> [B, T]."""
    masked = values if mask is None else values * mask
    suffix = masked.flip(-1).cumsum(-1).flip(-1)
    return suffix if inclusive else suffix - masked


@register("kl", "kl")
def k1(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None,
       *, clamp_log_ratio: float | None = None, **options: Any) -> Tensor:
    """k1 = log r = log π(x) − log π_ref(x) (Schulman 2020). Unbiased for KL(π‖π_ref) when x ~ π."""
    return log_ratio(logprobs, ref_logprobs, clamp_log_ratio)


@register("kl", "abs")
def absolute(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None,
             ref_logits: Tensor | None = None, *, clamp_log_ratio: float | None = None, **options: Any) -> Tensor:
    """|log r| = |log π(x) − log π_ref(x)| (arXiv 2512.21852). Biased: overestimates the KL."""
    return log_ratio(logprobs, ref_logprobs, clamp_log_ratio).abs()


@register("kl", "mse")
def k2(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None,
       *, clamp_log_ratio: float | None = None, **options: Any) -> Tensor:
    """k2 = ½ (log r)² (Schulman 2020). Biased (second-order accurate as π → π_ref), low variance."""
    return 0.5 * log_ratio(logprobs, ref_logprobs, clamp_log_ratio).square()


@register("kl", "k3")
def k3(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None,
       *, clamp_log_ratio: float | None = None, **options: Any) -> Tensor:
    """k3 = e^{−l} − 1 + l = (π_ref/π − 1) − log(π_ref/π) (Schulman 2020). Unbiased, ≥ 0.

    Computed as expm1(−l) + l in float64 and returned in the input dtype: in float32, e^{−l} − 1 + l
    cancels to exactly 0 for |l| below ~1e-4 (where k3 ≈ l²/2), so a policy near the reference showed no KL.
    """
    difference = log_ratio(logprobs, ref_logprobs, clamp_log_ratio)
    wide = difference.to(torch.promote_types(difference.dtype, torch.float64))
    return (torch.expm1(-wide) + wide).to(difference.dtype)


@register("kl", "full")
def full(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None,
         **options: Any) -> Tensor:
    """Exact Σ_v π(v)(log π(v) − log π_ref(v)) per position from ``logits``/``ref_logits`` [B, T, V].

    Ignores the sampled tokens' log-probs except to check the shape; differentiable w.r.t. ``logits``.
    """
    if logits is None or ref_logits is None:
        raise ValueError(
            "KL estimator 'full' needs the full-vocabulary logits of both models: got "
            f"logits={'None' if logits is None else tuple(logits.shape)}, "
            f"ref_logits={'None' if ref_logits is None else tuple(ref_logits.shape)}"
        )
    if logits.shape[:-1] != logprobs.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match logprobs {tuple(logprobs.shape)} [B, T]")
    return exact_kl(logits, ref_logits)


@register("kl", "none")
def no_kl(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None, ref_logits: Tensor | None = None,
          **options: Any) -> Tensor:
    """No KL penalty: zeros shaped like ``logprobs``."""
    return torch.zeros_like(logprobs)


@register("kl", "k1_plus")
def k1_plus(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None,
            ref_logits: Tensor | None = None, **options: Any) -> Tensor:
    """verl's ``k1+`` (``kl_penalty``/``kl_loss_type`` ending in "+"): the value of k1 with the gradient of
    k2, l·∇log π(x), whose expectation is the per-position ∇KL(π‖π_ref) (k1's own gradient has mean 0)."""
    return straight_through(k1(logprobs, ref_logprobs, **options), k2(logprobs, ref_logprobs, **options))


@register("kl", "k3_plus")
def k3_plus(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None,
            ref_logits: Tensor | None = None, **options: Any) -> Tensor:
    """verl's ``k3+``: the value of k3 (unbiased, ≥ 0) with the gradient of k2 (unbiased per position),
    where k3's own gradient in a loss is that of the forward KL(π_ref‖π)."""
    return straight_through(k3(logprobs, ref_logprobs, **options), k2(logprobs, ref_logprobs, **options))


@register("kl", "sequence_k1")
def sequence_k1(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None,
                ref_logits: Tensor | None = None, *, mask: Tensor | None = None, **options: Any) -> Tensor:
    """Sequence-level KL gradient in the loss ("On a few pitfalls in KL divergence gradient estimation for
    RL", arXiv 2506.09477): value l_t (k1), gradient Σ_t sg(Σ_{t'≥t} l_t')·∇log π(x_t), the score function
    with the KL to go, whose expectation is ∇KL(π‖π_ref) of whole sequences — what k1 in the reward with
    summed penalties gives, as a loss term. ``mask`` [B, T] limits the sums to the response (all positions
    when None; the value does not depend on it)."""
    per_token = k1(logprobs, ref_logprobs, **options)
    return per_token.detach() + score_function(logprobs, to_go(per_token, mask))


@register("kl", "sequence_full")
def sequence_full(logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None,
                  ref_logits: Tensor | None = None, *, mask: Tensor | None = None, **options: Any) -> Tensor:
    """The low-variance form of ``sequence_k1`` (arXiv 2506.09477, with Rao-Blackwellised later terms):
    value KL_t (exact per position, as ``full``), gradient ∇KL_t (through the logits at t, prefix fixed) +
    sg(Σ_{t'>t} KL_t')·∇log π(x_t) (how x_t changes the KL of later positions). Unbiased for the
    sequence-level ∇KL(π‖π_ref); needs full logits."""
    local = full(logprobs, ref_logprobs, logits, ref_logits)
    return local + score_function(logprobs, to_go(local, mask, inclusive=False))


for _estimator in (full, sequence_full):
    _estimator.needs_logits = True  # the trainer keeps the reference logits for the update only for these
for _estimator in (sequence_k1, sequence_full):
    _estimator.needs_mask = True  # their gradient sums over later response positions


def estimate(estimator: Any, logprobs: Tensor, ref_logprobs: Tensor, logits: Tensor | None = None,
             ref_logits: Tensor | None = None, *, mask: Tensor | None = None, clamp_log_ratio: float | None = None,
             clamp_value: float | None = None) -> Tensor:
    """Call ``estimator`` with the options it takes: ``mask`` if it ``needs_mask``, the log-ratio bound if
    set; then bound the estimate to [−clamp_value, clamp_value] (verl clamps k3 to ±10). Where a bound
    binds, that token's estimate has no gradient. Estimators written to the bare contract work unchanged."""
    options: dict[str, Any] = {}
    if mask is not None and getattr(estimator, "needs_mask", False):
        options["mask"] = mask
    if clamp_log_ratio is not None:
        options["clamp_log_ratio"] = clamp_log_ratio
    values = estimator(logprobs, ref_logprobs, logits=logits, ref_logits=ref_logits, **options)
    return values if clamp_value is None else values.clamp(-clamp_value, clamp_value)


def importance_weights(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """sg(π_θ(x)/π_old(x)) per token, 0 off the response: reweights a loss-placed KL estimate computed on
    samples of π_old (later epochs or mini-batches of a rollout) so that its expectation is under π_θ.
    Exactly 1 where π_θ = π_old."""
    ratio = torch.exp((logprobs - old_logprobs).detach())
    return torch.where(mask > 0, ratio, torch.zeros_like(ratio))
