"""The off-policy rows of the KL truth table (``OFF_POLICY_KL_GRADIENT``, ``OFF_POLICY_SEQUENCE_KL_GRADIENT`` in
rlhf_lab/kl/truth.py), checked by exact enumeration: every sample y of a behaviour policy μ ≠ π, weighted by μ(y),
its surrogate built by the trainer's own pieces (the policy loss's ``sampler_correction``, :class:`KLPenalty` with
``kl.off_policy_correction``), the sum differentiated and compared with ∇KL(π‖π_ref) under π itself.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

import rlhf_lab.components  # noqa: F401  (registers estimators, placements, corrections)
from rlhf_lab.algorithms.losses import sampler_correction
from rlhf_lab.kl import (
    OFF_POLICY_CORRECTIONS,
    OFF_POLICY_KL_GRADIENT,
    OFF_POLICY_SEQUENCE_KL_GRADIENT,
    KLPenalty,
    estimate,
)
from rlhf_lab.registry import get, names
from tests.unit.test_kl_truth import (
    DOUBLE,
    REF,
    SAMPLER_THETA,
    STEP1_REF,
    STEP1_THETA,
    STEP2_REF,
    STEP2_THETA,
    THETA,
    cosine_and_error,
)

MU_STEP1 = torch.tensor([-0.3, 0.4, 0.2, 0.9], dtype=DOUBLE)  # μ's logits for sequences (π's: STEP1/2_THETA)
MU_STEP2 = torch.tensor([[0.2, 0.0, 0.7, -0.4], [0.5, -0.5, 0.1, 0.3], [-1.0, 0.0, 1.0, 0.2],
                         [0.0, 0.6, -0.3, 0.1]], dtype=DOUBLE)
CAP = 1e6  # above every ratio: the importance weights are not truncated (a binding cap: SAMPLER_CORRECTION)


def off_policy_loss(name: str, placement: str, correction: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                    logits: torch.Tensor, ref_logits: torch.Tensor, mu_logprobs: torch.Tensor) -> torch.Tensor:
    """One sample's surrogate (β = 1, no task reward; π_old = π_θ, the samples μ's). ``correction`` names the
    policy loss's ``algorithm.tis_mode`` (none | token_truncate | sequence_mask; the loss-placed KL follows it,
    ``kl.off_policy_correction=policy``) or the KL's own weight (token_ratio | prefix_ratio)."""
    mask = torch.ones_like(logprobs)
    own = correction in ("token_ratio", "prefix_ratio")
    tis_weights = sampler_correction(logprobs.detach(), mu_logprobs, mask, CAP, "none" if own else correction)
    if placement == "reward":  # REINFORCE with the return −Σ_t estimate_t, each token weighted by the correction
        values = estimate(get("kl", name), logprobs, ref_logprobs, logits, ref_logits, mask=mask).detach()
        return (tis_weights * values.sum() * logprobs).sum()
    options = {"off_policy_correction": correction if own else "policy"}
    penalty = KLPenalty(SimpleNamespace(name=name, placement=placement, get=lambda key, default=None:
                                        options.get(key, default)))
    batch = SimpleNamespace(response_mask=mask, ref_logprobs=ref_logprobs, ref_logits=ref_logits, logprobs=logprobs.detach(),
                            sampler_logprobs=mu_logprobs, tis_weights=tis_weights)
    return penalty.loss_term(logprobs, logits, batch, 1.0, reduce=lambda values, m: (values * m).sum())


def one_token(name: str, placement: str, correction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_{y~μ}[∇ surrogate], ∇KL(π‖π_ref)) for π = softmax(THETA), μ = softmax(SAMPLER_THETA)."""
    theta = THETA.clone().requires_grad_()
    log_pi, log_ref, log_mu = theta.log_softmax(-1), REF.log_softmax(-1), SAMPLER_THETA.log_softmax(-1)
    surrogate = sum(log_mu[y].exp() * off_policy_loss(name, placement, correction, log_pi[y].view(1, 1),
                                                      log_ref[y].view(1, 1), theta.view(1, 1, -1), REF.view(1, 1, -1),
                                                      log_mu[y].view(1, 1)) for y in range(len(THETA)))
    (estimated,) = torch.autograd.grad(surrogate, theta, retain_graph=True, allow_unused=True, materialize_grads=True)
    (target,) = torch.autograd.grad((log_pi.exp() * (log_pi - log_ref)).sum(), theta)
    return estimated, target


def two_tokens(name: str, placement: str, correction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_{x~μ}[∇ surrogate], ∇ sequence KL(π‖π_ref)) for x1, x2 as in test_kl_truth's two-step policy."""
    theta1, theta2 = STEP1_THETA.clone().requires_grad_(), STEP2_THETA.clone().requires_grad_()
    log_p1, log_p2 = theta1.log_softmax(-1), theta2.log_softmax(-1)
    log_ref1, log_ref2 = STEP1_REF.log_softmax(-1), STEP2_REF.log_softmax(-1)
    log_mu1, log_mu2 = MU_STEP1.log_softmax(-1), MU_STEP2.log_softmax(-1)
    surrogate, sequence_kl = torch.zeros((), dtype=DOUBLE), torch.zeros((), dtype=DOUBLE)
    for first, second in itertools.product(range(4), range(4)):
        logprobs = torch.stack([log_p1[first], log_p2[first, second]])[None]
        ref_logprobs = torch.stack([log_ref1[first], log_ref2[first, second]])[None]
        mu_logprobs = torch.stack([log_mu1[first], log_mu2[first, second]])[None]
        logits = torch.stack([theta1, theta2[first]])[None]
        ref_logits = torch.stack([STEP1_REF, STEP2_REF[first]])[None]
        loss = off_policy_loss(name, placement, correction, logprobs, ref_logprobs, logits, ref_logits, mu_logprobs)
        surrogate = surrogate + mu_logprobs.sum().exp() * loss
        sequence_kl = sequence_kl + logprobs.sum().exp() * (logprobs.sum() - ref_logprobs.sum())
    estimated = torch.autograd.grad(surrogate, (theta1, theta2), retain_graph=True, allow_unused=True,
                                    materialize_grads=True)
    target = torch.autograd.grad(sequence_kl, (theta1, theta2))
    return torch.cat([g.reshape(-1) for g in estimated]), torch.cat([g.reshape(-1) for g in target])


def test_the_off_policy_tables_cover_every_estimator_placement_and_correction() -> None:
    keys = {(name, placement, correction) for name in names("kl") for placement in names("kl_placement")
            for correction in OFF_POLICY_CORRECTIONS[placement]}
    assert set(OFF_POLICY_KL_GRADIENT) == keys == set(OFF_POLICY_SEQUENCE_KL_GRADIENT)
    assert set(OFF_POLICY_CORRECTIONS["loss"]) - set(OFF_POLICY_CORRECTIONS["reward"]) == \
        set(names("kl_correction")) - {"policy", "none"}


@pytest.mark.parametrize("key", sorted(OFF_POLICY_KL_GRADIENT))
def test_the_one_token_off_policy_cell(key: tuple[str, str, str]) -> None:
    if key[0] == "none":  # no penalty: nothing to differentiate, recorded as not exact
        assert not OFF_POLICY_KL_GRADIENT[key]
        return
    estimated, target = one_token(*key)
    cosine, error = cosine_and_error(estimated, target)
    if OFF_POLICY_KL_GRADIENT[key]:
        assert error < 1e-12, f"{key}: relative error {error:.3g}"
    else:
        assert error > 0.1, f"{key} is exact (cosine {cosine:.4f})"


@pytest.mark.parametrize("key", sorted(OFF_POLICY_SEQUENCE_KL_GRADIENT))
def test_the_sequence_off_policy_cell(key: tuple[str, str, str]) -> None:
    if key[0] == "none":  # no penalty: nothing to differentiate, recorded as not exact
        assert not OFF_POLICY_SEQUENCE_KL_GRADIENT[key]
        return
    estimated, target = two_tokens(*key)
    cosine, error = cosine_and_error(estimated, target)
    if OFF_POLICY_SEQUENCE_KL_GRADIENT[key]:
        assert error < 1e-12, f"{key}: relative error {error:.3g}"
    else:
        assert error > 0.1, f"{key} is exact for sequences (cosine {cosine:.4f})"


def test_uncorrected_samples_of_mu_miss_and_k3_with_its_ratio_is_exact_on_policy_too() -> None:
    """Without a correction k1 in the reward follows μ; with μ = π the ratio's gradient alone fixes k3 in the loss
    (whose sg-weighted gradient is the forward KL's); k1_plus (k2's gradient) under the ratio counts the KL twice."""
    estimated, target = one_token("kl", "reward", "none")
    assert cosine_and_error(estimated, target)[1] > 0.2
    torch.testing.assert_close(one_token("k1_plus", "loss", "token_ratio")[0], 2 * target, rtol=0, atol=1e-12)
    theta = THETA.clone().requires_grad_()
    log_pi, log_ref = theta.log_softmax(-1), REF.log_softmax(-1)
    on_policy = sum(log_pi[y].exp().detach() * off_policy_loss(
        "k3", "loss", "token_ratio", log_pi[y].view(1, 1), log_ref[y].view(1, 1), theta.view(1, 1, -1),
        REF.view(1, 1, -1), log_pi[y].detach().view(1, 1)) for y in range(len(THETA)))
    (estimated,) = torch.autograd.grad(on_policy, theta, retain_graph=True)
    (target,) = torch.autograd.grad((log_pi.exp() * (log_pi - log_ref)).sum(), theta)
    torch.testing.assert_close(estimated, target, rtol=0, atol=1e-12)


def test_the_ratios_are_one_on_policy_and_carry_the_gradient() -> None:
    from rlhf_lab.kl.corrections import prefix_ratio, token_ratio

    logprobs = torch.tensor([[-0.5, -1.0, -2.0]], dtype=DOUBLE, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=DOUBLE)
    batch = SimpleNamespace(sampler_logprobs=torch.tensor([[-1.0, -0.5, -9.0]], dtype=DOUBLE))
    torch.testing.assert_close(token_ratio(logprobs, batch, mask),
                               torch.tensor([[0.5, -0.5, 0.0]], dtype=DOUBLE).exp() * mask)
    prefix = prefix_ratio(logprobs, batch, mask)
    torch.testing.assert_close(prefix, torch.tensor([[0.5, 0.0, 0.0]], dtype=DOUBLE).exp() * mask)
    (gradient,) = torch.autograd.grad(prefix.sum(), logprobs)  # ∂/∂log π_s of Σ_t Π_{u≤t} r_u = Σ_{t≥s} Π_{u≤t} r_u
    torch.testing.assert_close(gradient, torch.tensor([[0.5, 0.0, 0.0]], dtype=DOUBLE).exp() + torch.tensor(
        [[1.0, 0.0, -1.0]], dtype=DOUBLE), rtol=0, atol=1e-12)  # [e^0.5 + 1, 1, 0]
    on_policy = SimpleNamespace(sampler_logprobs=None, logprobs=logprobs.detach())  # μ = π_old = π_θ
    torch.testing.assert_close(token_ratio(logprobs, on_policy, mask), mask)


def test_tis_mode_none_weighs_every_response_token_by_one() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = sampler_correction(torch.tensor([[-0.1, -3.0, -1.0]]), torch.tensor([[-2.0, -0.1, -1.0]]), mask, 2.0,
                                 "none")
    assert torch.equal(weights, mask)
