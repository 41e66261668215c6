"""The KL variants against hand computation: k3 without cancellation, straight-through k1+/k3+, sequence-level
gradients, clamps, importance weighting, and the loss term reduced like the policy loss (rlhf_lab/kl/)."""

from __future__ import annotations

import pytest
import torch

import rlhf_lab.components  # noqa: F401
from rlhf_lab.algorithms.base import LossContext, aggregate
from rlhf_lab.kl import estimate, exact_kl, importance_weights
from rlhf_lab.registry import get

DOUBLE = torch.float64
# log r = [[0.5, −1.0, 0.25], [2.0, −0.25, 0.1]]
LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, -1.5, -0.2]], dtype=DOUBLE)
REF_LOGPROBS = torch.tensor([[-1.5, -1.0, -0.75], [-2.5, -1.25, -0.3]], dtype=DOUBLE)
LOG_RATIO = LOGPROBS - REF_LOGPROBS


def value_and_gradient(name: str, **options) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = LOGPROBS.clone().requires_grad_()
    values = estimate(get("kl", name), logprobs, REF_LOGPROBS, **options)
    (gradient,) = torch.autograd.grad(values.sum(), logprobs, allow_unused=True, materialize_grads=True)
    return values.detach(), gradient


def test_k3_has_no_float32_cancellation_near_zero() -> None:
    log_ratio = torch.tensor([[1e-7, -3e-6, 2e-4, 0.3]])
    old_formula = torch.exp(-log_ratio) - 1.0 + log_ratio  # what float32 gave before
    value = get("kl", "k3")(log_ratio, torch.zeros_like(log_ratio))
    wide = log_ratio.double()
    expected = torch.expm1(-wide) + wide  # ≈ l²/2 − l³/6
    assert value.dtype == torch.float32
    assert abs(float(old_formula[0, 0]) - float(expected[0, 0])) > 1000 * float(expected[0, 0])  # noise, not k3
    assert bool((value > 0).all())
    torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("name", "value_of"), [("k1_plus", "kl"), ("k3_plus", "k3")])
def test_straight_through_value_and_k2_gradient(name: str, value_of: str) -> None:
    values, gradient = value_and_gradient(name)
    assert torch.equal(values, get("kl", value_of)(LOGPROBS, REF_LOGPROBS))  # bit for bit
    torch.testing.assert_close(gradient, LOG_RATIO, rtol=0, atol=1e-15)  # ∂(½ l²)/∂log π = l


def test_sequence_k1_value_and_gradient_by_hand() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=DOUBLE)
    values, gradient = value_and_gradient("sequence_k1", mask=mask)
    assert torch.equal(values, LOG_RATIO)
    # Σ_{t' ≥ t} l_t' over the response: row 0: [−0.25, −0.75, 0.25]; row 1 (last position masked): [1.75, −0.25, 0]
    expected = torch.tensor([[-0.25, -0.75, 0.25], [1.75, -0.25, 0.0]], dtype=DOUBLE)
    torch.testing.assert_close(gradient * torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=DOUBLE), expected,
                               rtol=0, atol=1e-15)


def test_sequence_full_value_and_gradient() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=generator, dtype=DOUBLE, requires_grad=True)
    ref_logits = torch.randn(2, 3, 5, generator=generator, dtype=DOUBLE)
    tokens = torch.tensor([[0, 3, 1], [4, 4, 2]])
    logprobs = logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    ref_logprobs = ref_logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=DOUBLE)
    values = estimate(get("kl", "sequence_full"), logprobs, ref_logprobs, logits, ref_logits, mask=mask)
    local = exact_kl(logits, ref_logits)
    torch.testing.assert_close(values, local.detach(), rtol=0, atol=1e-15)
    # Gradient: ∇ Σ_t KL_t·mask + Σ_t sg(Σ_{t' > t} KL_t'·mask)·∇log π(x_t)
    later = torch.stack([(local * mask)[:, t + 1 :].sum(-1) for t in range(3)], dim=1).detach()
    expected_surrogate = (local * mask).sum() + (later * logprobs * mask).sum()
    (expected,) = torch.autograd.grad(expected_surrogate, logits, retain_graph=True)
    (gradient,) = torch.autograd.grad((values * mask).sum(), logits)
    torch.testing.assert_close(gradient, expected, rtol=0, atol=1e-14)


def test_clamps_bound_the_value_and_stop_its_gradient() -> None:
    values, gradient = value_and_gradient("kl", clamp_log_ratio=0.5)
    torch.testing.assert_close(values, LOG_RATIO.clamp(-0.5, 0.5))
    assert gradient[1, 0] == 0.0 and gradient[0, 1] == 0.0 and gradient[0, 2] == 1.0  # l = 2, −1 clamped
    values, gradient = value_and_gradient("mse", clamp_value=0.4)
    torch.testing.assert_close(values, (0.5 * LOG_RATIO**2).clamp(max=0.4))
    assert gradient[1, 0] == 0.0 and gradient[0, 1] == 0.0 and gradient[0, 0] == 0.5
    # k3 with the log-ratio bound: e^{−c} − 1 + c at l = 2 > c = 1
    values, _ = value_and_gradient("k3", clamp_log_ratio=1.0)
    assert float(values[1, 0]) == pytest.approx(torch.exp(torch.tensor(-1.0)).item())


def test_estimate_passes_only_the_options_an_estimator_takes() -> None:
    def bare(logprobs, ref_logprobs, logits=None, ref_logits=None):  # the contract alone
        return logprobs - ref_logprobs

    mask = torch.ones_like(LOGPROBS)
    torch.testing.assert_close(estimate(bare, LOGPROBS, REF_LOGPROBS, mask=mask, clamp_value=0.3),
                               LOG_RATIO.clamp(-0.3, 0.3))


def test_importance_weighting_is_the_plain_estimate_on_policy() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=DOUBLE)
    weights = importance_weights(LOGPROBS, LOGPROBS.clone(), mask)
    assert torch.equal(weights, mask)
    for name in ("k3", "mse", "sequence_k1", "k3_plus"):
        plain_logprobs, weighted_logprobs = LOGPROBS.clone().requires_grad_(), LOGPROBS.clone().requires_grad_()
        plain = estimate(get("kl", name), plain_logprobs, REF_LOGPROBS, mask=mask) * mask
        weighted = estimate(get("kl", name), weighted_logprobs, REF_LOGPROBS, mask=mask) * importance_weights(
            weighted_logprobs, LOGPROBS, mask)
        assert torch.equal(plain, weighted)
        plain.sum().backward()
        weighted.sum().backward()
        assert torch.equal(plain_logprobs.grad, weighted_logprobs.grad)


def test_importance_weighting_corrects_off_policy_samples_exactly() -> None:
    """Samples from π_old ≠ π_θ: Σ_x π_old(x)·sg(π_θ/π_old)·∇k2(x) equals the on-policy Σ_x π_θ(x)·∇k2(x)."""
    theta = torch.tensor([1.0, 0.2, -0.5, 0.3], dtype=DOUBLE, requires_grad=True)
    old = torch.tensor([0.2, 0.9, -0.1, 0.0], dtype=DOUBLE).log_softmax(-1)
    ref = torch.tensor([-0.8, 0.5, 0.1, 1.1], dtype=DOUBLE).log_softmax(-1)
    log_pi = theta.log_softmax(-1)
    on_policy = weighted = unweighted = torch.zeros((), dtype=DOUBLE)
    one = torch.ones(1, 1, dtype=DOUBLE)
    for token in range(4):
        values = estimate(get("kl", "mse"), log_pi[token].view(1, 1), ref[token].view(1, 1))
        weight = importance_weights(log_pi[token].view(1, 1), old[token].view(1, 1), one)
        on_policy = on_policy + log_pi[token].exp().detach() * values.sum()
        weighted = weighted + old[token].exp() * (values * weight).sum()
        unweighted = unweighted + old[token].exp() * values.sum()
    gradients = [torch.autograd.grad(surrogate, theta, retain_graph=True)[0]
                 for surrogate in (on_policy, weighted, unweighted)]
    torch.testing.assert_close(gradients[1], gradients[0], rtol=0, atol=1e-14)
    assert float((gradients[2] - gradients[0]).norm()) > 0.05 * float(gradients[0].norm())


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "sequence_sum_constant"])
def test_loss_term_is_reduced_like_the_policy_loss(mode: str) -> None:
    kl = torch.tensor([[0.5, 0.2, 9.0], [0.3, -0.1, 0.4]], dtype=DOUBLE)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=DOUBLE)
    context = LossContext(minibatch_tokens=5.0, minibatch_rows=2, max_response_tokens=3)
    term = get("kl_placement", "loss").loss_term(kl, mask, 0.1, reduce=lambda v, m: aggregate(v, m, mode, context))
    expected = {"token_mean": (0.5 + 0.2 + 0.3 - 0.1 + 0.4) / 5,
                "sequence_mean": ((0.5 + 0.2) / 2 + (0.3 - 0.1 + 0.4) / 3) / 2,
                "sequence_sum_constant": (0.5 + 0.2 + 0.3 - 0.1 + 0.4) / 6}[mode]
    assert float(term) == pytest.approx(0.1 * expected, rel=1e-12)
    assert float(get("kl_placement", "reward").loss_term(kl, mask, 0.1, reduce=None)) == 0.0


def test_every_new_variant_has_a_config_option() -> None:
    from rlhf_lab.config.compose import group_options

    for name in ("k1_plus", "k3_plus", "sequence_k1", "sequence_full"):
        assert name in group_options("kl")
