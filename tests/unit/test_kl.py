"""KL estimators, exact KL, controllers and placements (rlhf_lab/kl/).

The gradient tests enumerate every token of a tiny categorical policy, so "expected gradient" below is exact,
not sampled: they decide which estimator × placement pairs are unbiased for ∇KL(π‖π_ref).
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import rlhf_lab.kl as kl_module  # import first: its decorators fill the registry
from rlhf_lab.kl import REVERSE_KL_GRADIENT_UNBIASED, exact_kl
from rlhf_lab.registry import RegistryError, get

ESTIMATORS = ["kl", "abs", "mse", "k3", "full", "none"]
PLACEMENTS = ["reward", "loss"]


# ------------------------------------------------------------------------------------------------
# Values against hand computation
# ------------------------------------------------------------------------------------------------

# log r = logprobs − ref_logprobs = [[0.5, −1.0, 0.0], [2.0, −0.25, 0.1]]
LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, -1.5, -0.2]], dtype=torch.float64)
REF_LOGPROBS = torch.tensor([[-1.5, -1.0, -0.5], [-2.5, -1.25, -0.3]], dtype=torch.float64)
EXPECTED = {
    "kl": [[0.5, -1.0, 0.0], [2.0, -0.25, 0.1]],
    "abs": [[0.5, 1.0, 0.0], [2.0, 0.25, 0.1]],
    "mse": [[0.125, 0.5, 0.0], [2.0, 0.03125, 0.005]],
    # e^{-l} − 1 + l: e^{-0.5} = 0.60653066, e^{1} = 2.71828183, e^{-2} = 0.13533528,
    # e^{0.25} = 1.28402542, e^{-0.1} = 0.90483742
    "k3": [
        [0.10653065971263342, 0.7182818284590451, 0.0],
        [1.1353352832366128, 0.03402541668774148, 0.0048374180359595],
    ],
    "none": [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_estimator_matches_hand_computation(name: str) -> None:
    estimate = get("kl", name)(LOGPROBS, REF_LOGPROBS)
    assert estimate.shape == LOGPROBS.shape
    torch.testing.assert_close(
        estimate, torch.tensor(EXPECTED[name], dtype=torch.float64), rtol=0, atol=1e-12
    )


def _loop_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> list[list[float]]:
    """Σ_v π(v)(log π(v) − log π_ref(v)) with Python floats, one position at a time."""
    batch, time, vocab = logits.shape
    result = []
    for b in range(batch):
        row = []
        for t in range(time):
            z = [float(value) for value in logits[b, t]]
            w = [float(value) for value in ref_logits[b, t]]
            log_norm_z = math.log(sum(math.exp(value) for value in z))
            log_norm_w = math.log(sum(math.exp(value) for value in w))
            total = 0.0
            for v in range(vocab):
                log_p, log_q = z[v] - log_norm_z, w[v] - log_norm_w
                total += math.exp(log_p) * (log_p - log_q)
            row.append(total)
        result.append(row)
    return result


def test_full_and_exact_kl_match_loop_over_vocabulary() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(2, 3, 11, generator=generator)
    ref_logits = 2.0 * torch.randn(2, 3, 11, generator=generator)
    expected = torch.tensor(_loop_kl(logits, ref_logits))
    logprobs = torch.zeros(2, 3)  # only their shape matters to `full`
    torch.testing.assert_close(exact_kl(logits, ref_logits), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        get("kl", "full")(logprobs, logprobs, logits, ref_logits), expected, rtol=1e-5, atol=1e-6
    )
    # bf16 inputs are computed in float32 (and come back as float32)
    assert exact_kl(logits.bfloat16(), ref_logits.bfloat16()).dtype == torch.float32


def test_full_without_logits_raises() -> None:
    logprobs = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="logits"):
        get("kl", "full")(logprobs, logprobs)
    with pytest.raises(ValueError, match="ref_logits=None"):
        get("kl", "full")(logprobs, logprobs, logits=torch.zeros(2, 3, 5))


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 1024])
def test_exact_kl_chunked_equals_unchunked_with_gradients(chunk_size: int) -> None:
    generator = torch.Generator().manual_seed(1)
    base_logits = torch.randn(3, 4, 9, generator=generator, dtype=torch.float64)
    ref_logits = torch.randn(3, 4, 9, generator=generator, dtype=torch.float64)
    upstream = torch.randn(3, 4, generator=generator, dtype=torch.float64)

    logits = base_logits.clone().requires_grad_()
    (exact_kl(logits, ref_logits, chunk_size=chunk_size) * upstream).sum().backward()

    reference_logits = base_logits.clone().requires_grad_()
    log_p, log_q = reference_logits.log_softmax(-1), ref_logits.log_softmax(-1)
    unchunked = (log_p.exp() * (log_p - log_q)).sum(-1)
    (unchunked * upstream).sum().backward()

    torch.testing.assert_close(exact_kl(base_logits, ref_logits, chunk_size=chunk_size), unchunked.detach())
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    torch.testing.assert_close(logits.grad, reference_logits.grad)


def test_exact_kl_gradcheck_including_sliced_inputs() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    ref_logits = torch.randn(2, 5, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    # A slice along T cannot be viewed as [B·T, V]: exercises the per-batch-element path as well.
    assert torch.autograd.gradcheck(lambda z, w: exact_kl(z, w, chunk_size=2), (logits, ref_logits))
    assert torch.autograd.gradcheck(
        lambda z, w: exact_kl(z[:, 1:4], w[:, 1:4], chunk_size=2), (logits, ref_logits)
    )
    fixed_logits = logits.detach()
    assert torch.autograd.gradcheck(lambda w: exact_kl(fixed_logits, w, chunk_size=3), (ref_logits,))


@pytest.mark.parametrize("sliced", [False, True])
def test_exact_kl_rows_are_viewed_whole_or_per_batch_element_by_their_strides(sliced: bool) -> None:
    """[B, T, V] as one [B·T, V] view where the strides allow, else one [T, V] block per b (a slice along T); the
    same on the planner's fake tensors, whose view raises another error than a real tensor's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlhf_lab.kl.exact import _row_blocks

    def blocks(make):
        logits = make(2, 5, 6)
        part = logits[:, 1:4] if sliced else logits
        found = _row_blocks(part, part)
        return part, found, (len(found), [tuple(block.shape) for block in found[0]])

    expected = (2, [(3, 6), (3, 6)]) if sliced else (1, [(10, 6), (10, 6)])
    part, found, shape = blocks(torch.randn)
    assert shape == expected
    assert all(block._base is not None and block.data_ptr() >= part.data_ptr() for row in found for block in row)
    with FakeTensorMode():
        assert blocks(torch.empty)[2] == expected


# ------------------------------------------------------------------------------------------------
# Sample means: k1 and k3 are unbiased for KL(π‖π_ref), k2 is not
# ------------------------------------------------------------------------------------------------

POLICY_PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64)
REF_PROBS = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.35], dtype=torch.float64)


def test_sample_means_converge_to_exact_kl() -> None:
    number_of_samples = 200_000
    log_pi, log_ref = POLICY_PROBS.log(), REF_PROBS.log()
    exact = float((POLICY_PROBS * (log_pi - log_ref)).sum())  # ≈ 1.33, clearly not small
    generator = torch.Generator().manual_seed(1234)
    samples = torch.multinomial(POLICY_PROBS, number_of_samples, replacement=True, generator=generator)
    logprobs, ref_logprobs = log_pi[samples][None], log_ref[samples][None]  # [1, N]
    for name in ["kl", "k3", "mse"]:
        per_token = get("kl", name)(logprobs, ref_logprobs)
        all_tokens = get("kl", name)(log_pi[None], log_ref[None])[0]  # the estimator at every token
        expectation = float((POLICY_PROBS * all_tokens).sum())
        std = float((POLICY_PROBS * (all_tokens - expectation) ** 2).sum().sqrt())
        # 5 standard errors of the sample mean: a false failure has probability ~6e-7 (and the seed is fixed).
        tolerance = 5 * std / math.sqrt(number_of_samples)
        sample_mean = float(per_token.mean())
        assert abs(sample_mean - expectation) < tolerance, name
        if name in ("kl", "k3"):
            assert expectation == pytest.approx(exact, abs=1e-12)
            assert abs(sample_mean - exact) < tolerance, name
        else:  # k2 is biased: E[½ l²] − KL is far beyond sampling noise here
            assert abs(expectation - exact) > 0.1
            assert abs(sample_mean - exact) > 20 * tolerance


# ------------------------------------------------------------------------------------------------
# Exact expected gradients by enumeration: which estimator × placement is unbiased for ∇KL(π‖π_ref)?
# ------------------------------------------------------------------------------------------------

THETA = torch.tensor([1.0, 0.2, -0.5, 0.3, -1.2], dtype=torch.float64)
REF_LOGITS = torch.tensor([-0.8, 0.5, 0.1, 1.1, -0.3], dtype=torch.float64)


def _estimate_for_sampled_token(name: str, theta: torch.Tensor, token: int) -> torch.Tensor:
    """The estimator as autograd sees it on one sampled token x: gradient through log π(x) only. [1, 1]"""
    log_pi, log_ref = theta.log_softmax(-1), REF_LOGITS.log_softmax(-1)
    return get("kl", name)(
        log_pi[token].view(1, 1), log_ref[token].view(1, 1), theta.view(1, 1, -1), REF_LOGITS.view(1, 1, -1)
    )


def _expected_penalty_gradient(name: str, placement_name: str) -> torch.Tensor:
    """Exact E_{x~π}[gradient of the penalty part of the surrogate loss], summing over all tokens.

    Surrogate per sample, as the trainer builds it: REINFORCE on the shaped reward (−Σ reward·log π with the
    reward detached) plus the placement's loss term. With zero task reward this is
      reward placement:  π(x).detach() · f(x).detach() · log π(x)
      loss placement:    π(x).detach() · f(x)
    """
    placement = get("kl_placement", placement_name)
    theta = THETA.clone().requires_grad_()
    log_pi = theta.log_softmax(-1)
    mask = torch.ones(1, 1, dtype=torch.float64)
    surrogate = torch.zeros((), dtype=torch.float64)
    for token in range(theta.shape[0]):
        estimate = _estimate_for_sampled_token(name, theta, token)
        if not placement.needs_grad:
            estimate = estimate.detach()
        shaped_reward = placement.shape_rewards(torch.zeros(1, 1, dtype=torch.float64), estimate, 1.0, mask)
        sample_loss = -(shaped_reward.detach() * log_pi[token]).sum() + placement.loss_term(
            estimate, mask, 1.0
        )
        surrogate = surrogate + log_pi[token].exp().detach() * sample_loss
    (gradient,) = torch.autograd.grad(surrogate, theta, allow_unused=True, materialize_grads=True)
    return gradient


def _reverse_kl_gradient() -> torch.Tensor:
    theta = THETA.clone().requires_grad_()
    log_pi, log_ref = theta.log_softmax(-1), REF_LOGITS.log_softmax(-1)
    (gradient,) = torch.autograd.grad((log_pi.exp() * (log_pi - log_ref)).sum(), theta)
    return gradient


def test_unbiasedness_table_covers_every_builtin_pair() -> None:
    # Every registered pair, the new variants included, is checked in tests/unit/test_kl_truth.py.
    assert set(REVERSE_KL_GRADIENT_UNBIASED) >= set(itertools.product(ESTIMATORS, PLACEMENTS))
    for name in ESTIMATORS:
        assert get("kl", name).__module__.startswith(kl_module.__name__ + ".")


@pytest.mark.parametrize(("name", "placement_name"), list(itertools.product(ESTIMATORS, PLACEMENTS)))
def test_expected_gradient_matches_table(name: str, placement_name: str) -> None:
    expected_gradient = _expected_penalty_gradient(name, placement_name)
    target = _reverse_kl_gradient()
    error = float((expected_gradient - target).norm())
    if REVERSE_KL_GRADIENT_UNBIASED[(name, placement_name)]:
        assert error < 1e-12, f"{name}/{placement_name} should be unbiased; |E[g] − ∇KL| = {error:.3g}"
    else:
        assert error > 0.05 * float(target.norm()), f"{name}/{placement_name} unexpectedly unbiased"


def test_k3_in_loss_gives_forward_kl_gradient() -> None:
    theta = THETA.clone().requires_grad_()
    log_pi, log_ref = theta.log_softmax(-1), REF_LOGITS.log_softmax(-1)
    (forward_kl_gradient,) = torch.autograd.grad((log_ref.exp() * (log_ref - log_pi)).sum(), theta)
    torch.testing.assert_close(
        _expected_penalty_gradient("k3", "loss"), forward_kl_gradient, rtol=0, atol=1e-12
    )


# Two-step autoregressive policy: x1 ~ p1(θ1), x2 ~ p2(· | x1; θ2). The KL at step 2 depends on x1.
STEP1_THETA = torch.tensor([0.4, -0.6, 1.0, 0.0], dtype=torch.float64)
STEP2_THETA = torch.tensor(
    [[1.5, -1.0, 0.0, 0.2], [0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.5, 0.3], [0.3, 0.3, -0.9, 1.2]],
    dtype=torch.float64,
)
STEP1_REF = torch.tensor([0.0, 0.5, -0.5, 0.2], dtype=torch.float64)
STEP2_REF = torch.tensor(
    [[0.0, 0.1, 0.2, 0.3], [1.0, -1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [-0.5, 0.8, 0.1, -0.2]],
    dtype=torch.float64,
)


def _two_step_gradients(
    name: str, placement_name: str, use_return_to_go: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact expected surrogate gradient, exact ∇ sequence-level reverse KL), both flattened over θ1, θ2."""
    placement = get("kl_placement", placement_name)
    step1_theta, step2_theta = STEP1_THETA.clone().requires_grad_(), STEP2_THETA.clone().requires_grad_()
    log_p1, log_p2 = step1_theta.log_softmax(-1), step2_theta.log_softmax(-1)
    log_ref1, log_ref2 = STEP1_REF.log_softmax(-1), STEP2_REF.log_softmax(-1)
    vocab = STEP1_THETA.shape[0]
    mask = torch.ones(1, 2, dtype=torch.float64)
    surrogate = torch.zeros((), dtype=torch.float64)
    sequence_kl = torch.zeros((), dtype=torch.float64)
    for first, second in itertools.product(range(vocab), range(vocab)):
        logprobs = torch.stack([log_p1[first], log_p2[first, second]])[None]  # [1, 2]
        ref_logprobs = torch.stack([log_ref1[first], log_ref2[first, second]])[None]
        logits = torch.stack([step1_theta, step2_theta[first]])[None]  # [1, 2, V]
        ref_logits = torch.stack([STEP1_REF, STEP2_REF[first]])[None]
        estimate = get("kl", name)(logprobs, ref_logprobs, logits, ref_logits)
        if not placement.needs_grad:
            estimate = estimate.detach()
        shaped = placement.shape_rewards(torch.zeros(1, 2, dtype=torch.float64), estimate, 1.0, mask).detach()
        returns = shaped.flip(-1).cumsum(-1).flip(-1) if use_return_to_go else shaped
        summed_loss_term = placement.loss_term(estimate, mask, 1.0) * 2  # per-sequence sum, not mean
        sample_loss = -(returns * logprobs).sum() + summed_loss_term
        sequence_logprob = logprobs.sum()
        weight = sequence_logprob.exp().detach()
        surrogate = surrogate + weight * sample_loss
        sequence_kl = sequence_kl + sequence_logprob.exp() * (sequence_logprob - ref_logprobs.sum())
    parameters = (step1_theta, step2_theta)
    estimated = torch.autograd.grad(
        surrogate, parameters, retain_graph=True, allow_unused=True, materialize_grads=True
    )
    target = torch.autograd.grad(sequence_kl, parameters)
    return torch.cat([g.reshape(-1) for g in estimated]), torch.cat([g.reshape(-1) for g in target])


def test_k1_reward_with_return_to_go_is_unbiased_for_sequence_kl() -> None:
    estimated, target = _two_step_gradients("kl", "reward", use_return_to_go=True)
    torch.testing.assert_close(estimated, target, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "placement_name", "use_return_to_go"),
    [("kl", "reward", False), ("mse", "loss", False), ("full", "loss", False), ("full", "reward", True)],
)
def test_per_position_penalties_are_biased_for_sequence_kl(
    name: str, placement_name: str, use_return_to_go: bool
) -> None:
    # Immediate penalties only (or gradients through the per-position value only) miss how the first token
    # changes the KL of the second step: E[∇log p1(x1) · KL_2(x1)].
    estimated, target = _two_step_gradients(name, placement_name, use_return_to_go)
    assert float((estimated - target).norm()) > 0.05 * float(target.norm())


def test_k2_in_loss_equals_k1_reward_with_immediate_penalties() -> None:
    k2_loss, _ = _two_step_gradients("mse", "loss", use_return_to_go=False)
    k1_immediate, _ = _two_step_gradients("kl", "reward", use_return_to_go=False)
    torch.testing.assert_close(k2_loss, k1_immediate, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Controllers
# ------------------------------------------------------------------------------------------------


def test_adaptive_controller_matches_hand_computation() -> None:
    controller = get("kl_controller", "adaptive")(coef=0.1, target=6.0, horizon=10000)
    controller.update(current_kl=7.0, n_steps=256)
    # error = 7/6 − 1 = 1/6 (inside ±0.2); coef = 0.1 · (1 + (1/6)·256/10000) = 0.1 · 1.0042666…
    assert controller.coef == pytest.approx(0.10042666666666667, rel=1e-12)


@pytest.mark.parametrize(
    ("current_kl", "expected_coef"), [(100.0, 0.100512), (0.0, 0.099488), (-5.0, 0.099488)]
)
def test_adaptive_controller_clips_error_on_both_sides(current_kl: float, expected_coef: float) -> None:
    # error clipped to +0.2 → 0.1 · (1 + 0.2·256/10000) = 0.100512; to −0.2 → 0.1 · (1 − 0.00512) = 0.099488
    controller = get("kl_controller", "adaptive")(coef=0.1, target=6.0, horizon=10000)
    controller.update(current_kl, n_steps=256)
    assert controller.coef == pytest.approx(expected_coef, rel=1e-12)


def test_adaptive_controller_state_dict_round_trip() -> None:
    adaptive = get("kl_controller", "adaptive")
    controller = adaptive(coef=0.2, target=3.0, horizon=500)
    for kl_value in [1.0, 5.0, 2.5]:
        controller.update(kl_value, n_steps=64)
    state = json.loads(json.dumps(controller.state_dict()))  # must be JSON-serialisable
    restored = adaptive(coef=0.2, target=3.0, horizon=500)
    restored.load_state_dict(state)
    assert restored.coef == controller.coef
    controller.update(4.0, n_steps=64)
    restored.update(4.0, n_steps=64)
    assert restored.coef == controller.coef


@pytest.mark.parametrize("target", [None, 0.0, -1.0])
def test_adaptive_controller_requires_positive_target(target: float | None) -> None:
    with pytest.raises(ValueError, match=f"target={target!r}"):
        get("kl_controller", "adaptive")(coef=0.1, target=target)


def test_fixed_controller_never_changes() -> None:
    fixed = get("kl_controller", "fixed")
    controller = fixed(coef=0.05, target=1.0)
    for kl_value in [0.0, 100.0, -3.0, 0.01]:
        controller.update(kl_value, n_steps=10_000)
    assert controller.coef == 0.05
    restored = fixed(coef=1.0)
    restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert restored.coef == 0.05


# ------------------------------------------------------------------------------------------------
# Placements
# ------------------------------------------------------------------------------------------------


def test_masked_positions_never_change_rewards_or_loss() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    token_rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    kl = torch.tensor([[0.5, -0.2, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0]])
    huge = torch.where(mask > 0, kl, torch.tensor(1e30))  # what a bug reading padding would produce
    huge[1, 3] = float("inf")
    reward, loss = get("kl_placement", "reward"), get("kl_placement", "loss")

    expected_rewards = torch.tensor([[-0.05, 1.02, 0.0, 0.0], [1.97, 0.0, 0.0, 0.0]])  # r − 0.1·kl on mask
    torch.testing.assert_close(reward.shape_rewards(token_rewards, kl, 0.1, mask), expected_rewards)
    torch.testing.assert_close(reward.shape_rewards(token_rewards, huge, 0.1, mask), expected_rewards)
    assert torch.equal(loss.shape_rewards(token_rewards, huge, 0.1, mask), token_rewards)

    expected_loss = torch.tensor(0.1 * (0.5 - 0.2 + 0.3) / 3)
    torch.testing.assert_close(loss.loss_term(kl, mask, 0.1), expected_loss)
    torch.testing.assert_close(loss.loss_term(huge, mask, 0.1), expected_loss)
    assert float(reward.loss_term(huge, mask, 0.1)) == 0.0


def test_placement_gradients_and_flags() -> None:
    reward, loss = get("kl_placement", "reward"), get("kl_placement", "loss")
    assert loss.needs_grad is True and reward.needs_grad is False
    kl = torch.tensor([[0.5, 0.2]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.float64)
    assert not reward.shape_rewards(torch.zeros(1, 2, dtype=torch.float64), kl, 0.1, mask).requires_grad
    zero = reward.loss_term(kl, mask, 0.1)
    assert zero.shape == () and zero.dtype == torch.float64 and zero.device == kl.device
    loss.loss_term(kl, mask, 0.5).backward()
    torch.testing.assert_close(kl.grad, torch.tensor([[0.25, 0.25]], dtype=torch.float64))


# ------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------


def test_registry_lookup_and_unknown_name() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref_logprobs = torch.tensor([[-1.0, -1.0]])
    torch.testing.assert_close(get("kl", "k3")(logprobs, ref_logprobs), torch.tensor([[0.0, math.e - 2.0]]))
    with pytest.raises(RegistryError) as error:
        get("kl", "bogus")
    listed = str(error.value).split("registered:")[1].replace(",", " ").split()
    assert set(ESTIMATORS) <= set(listed)
