"""Every cell of the KL truth tables (rlhf_lab/kl/truth.py), checked by exact enumeration on tabular policies.

"Expected gradient" is exact: the trainer's surrogate loss of every sequence, weighted by its probability
(detached) and summed over all sequences, then differentiated. It is compared with the exact gradient of the
reverse KL(π‖π_ref) (cosine and relative error). One token: a categorical over 5 symbols; sequences: two
steps over 4 symbols, the second step's logits depending on the first token.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

import rlhf_lab.components  # noqa: F401  (registers estimators, placements, advantage estimators)
from rlhf_lab.kl import (
    MULTI_TURN_MASK,
    REVERSE_KL_GRADIENT_UNBIASED,
    REWARD_KL_UNDER_ADVANTAGE,
    SAMPLER_CORRECTION,
    SEQUENCE_KL_GRADIENT_UNBIASED,
    ZERO_KL_GRADIENT,
    estimate,
    zero_gradient_warning,
)
from rlhf_lab.registry import get, names

DOUBLE = torch.float64
THETA = torch.tensor([1.0, 0.2, -0.5, 0.3, -1.2], dtype=DOUBLE)
REF = torch.tensor([-0.8, 0.5, 0.1, 1.1, -0.3], dtype=DOUBLE)
STEP1_THETA = torch.tensor([0.4, -0.6, 1.0, 0.0], dtype=DOUBLE)
STEP2_THETA = torch.tensor([[1.5, -1.0, 0.0, 0.2], [0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.5, 0.3],
                            [0.3, 0.3, -0.9, 1.2]], dtype=DOUBLE)
STEP1_REF = torch.tensor([0.0, 0.5, -0.5, 0.2], dtype=DOUBLE)
STEP2_REF = torch.tensor([[0.0, 0.1, 0.2, 0.3], [1.0, -1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0],
                          [-0.5, 0.8, 0.1, -0.2]], dtype=DOUBLE)


def sample_loss(name: str, placement_name: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's surrogate as the trainer builds it, with zero task reward and β = 1: the reward placement
    puts −estimate into every token's reward and weighs every log π(x_t) by the return (REINFORCE, no baseline);
    the loss placement adds the estimates, with their gradient, summed over the sequence. [1, T] inputs; ``mask``
    the loss mask (default: every token)."""
    placement = get("kl_placement", placement_name)
    mask = torch.ones_like(logprobs) if mask is None else mask
    values = estimate(get("kl", name), logprobs, ref_logprobs, logits, ref_logits, mask=mask)
    if not placement.needs_grad:
        values = values.detach()
    shaped = placement.shape_rewards(torch.zeros_like(logprobs), values, 1.0, mask).detach()
    return_ = (shaped * mask).sum()
    return -return_ * (logprobs * mask).sum() + placement.loss_term(values, mask, 1.0) * mask.sum()


def one_token_gradients(name: str, placement_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact E[∇ surrogate], ∇KL(π‖π_ref)) for the categorical policy softmax(THETA)."""
    theta = THETA.clone().requires_grad_()
    log_pi, log_ref = theta.log_softmax(-1), REF.log_softmax(-1)
    surrogate = torch.zeros((), dtype=DOUBLE)
    for token in range(len(THETA)):
        loss = sample_loss(name, placement_name, log_pi[token].view(1, 1), log_ref[token].view(1, 1),
                           theta.view(1, 1, -1), REF.view(1, 1, -1))
        surrogate = surrogate + log_pi[token].exp().detach() * loss
    (estimated,) = torch.autograd.grad(surrogate, theta, retain_graph=True, allow_unused=True,
                                    materialize_grads=True)
    (target,) = torch.autograd.grad((log_pi.exp() * (log_pi - log_ref)).sum(), theta)
    return estimated, target


def two_step_gradients(name: str, placement_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact E[∇ surrogate], ∇ sequence KL(π‖π_ref)) for x1 ~ p1(θ1), x2 ~ p2(· | x1; θ2), flattened."""
    theta1, theta2 = STEP1_THETA.clone().requires_grad_(), STEP2_THETA.clone().requires_grad_()
    log_p1, log_p2 = theta1.log_softmax(-1), theta2.log_softmax(-1)
    log_ref1, log_ref2 = STEP1_REF.log_softmax(-1), STEP2_REF.log_softmax(-1)
    surrogate, sequence_kl = torch.zeros((), dtype=DOUBLE), torch.zeros((), dtype=DOUBLE)
    for first, second in itertools.product(range(4), range(4)):
        logprobs = torch.stack([log_p1[first], log_p2[first, second]])[None]
        ref_logprobs = torch.stack([log_ref1[first], log_ref2[first, second]])[None]
        logits = torch.stack([theta1, theta2[first]])[None]
        ref_logits = torch.stack([STEP1_REF, STEP2_REF[first]])[None]
        sequence_logprob = logprobs.sum()
        loss = sample_loss(name, placement_name, logprobs, ref_logprobs, logits, ref_logits)
        surrogate = surrogate + sequence_logprob.exp().detach() * loss
        sequence_kl = sequence_kl + sequence_logprob.exp() * (sequence_logprob - ref_logprobs.sum())
    parameters = (theta1, theta2)
    estimated = torch.autograd.grad(surrogate, parameters, retain_graph=True, allow_unused=True,
                                    materialize_grads=True)
    target = torch.autograd.grad(sequence_kl, parameters)
    return torch.cat([g.reshape(-1) for g in estimated]), torch.cat([g.reshape(-1) for g in target])


def cosine_and_error(estimated: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    cosine = float(estimated @ target / (estimated.norm() * target.norm()).clamp(min=1e-300))
    return cosine, float((estimated - target).norm() / target.norm())


def test_tables_cover_every_registered_pair() -> None:
    pairs = set(itertools.product(names("kl"), names("kl_placement")))
    assert set(REVERSE_KL_GRADIENT_UNBIASED) == pairs
    assert set(SEQUENCE_KL_GRADIENT_UNBIASED) == pairs
    assert set(ZERO_KL_GRADIENT) <= pairs


@pytest.mark.parametrize(("name", "placement_name"), sorted(REVERSE_KL_GRADIENT_UNBIASED))
def test_one_token_cell(name: str, placement_name: str) -> None:
    estimated, target = one_token_gradients(name, placement_name)
    cosine, error = cosine_and_error(estimated, target)
    if REVERSE_KL_GRADIENT_UNBIASED[(name, placement_name)]:
        assert error < 1e-12, f"{name}/{placement_name}: relative error {error:.3g}"
    else:
        assert error > 0.05, f"{name}/{placement_name} is unbiased (cosine {cosine:.4f})"
    zero = float(estimated.norm()) < 1e-12
    assert zero == ((name, placement_name) in ZERO_KL_GRADIENT or name == "none")


@pytest.mark.parametrize(("name", "placement_name"), sorted(SEQUENCE_KL_GRADIENT_UNBIASED))
def test_two_token_cell(name: str, placement_name: str) -> None:
    estimated, target = two_step_gradients(name, placement_name)
    cosine, error = cosine_and_error(estimated, target)
    if SEQUENCE_KL_GRADIENT_UNBIASED[(name, placement_name)]:
        assert error < 1e-12, f"{name}/{placement_name}: relative error {error:.3g}"
    else:
        assert error > 0.05, f"{name}/{placement_name} is unbiased for sequences (cosine {cosine:.4f})"


def test_k3_in_the_loss_follows_the_forward_kl_for_one_token() -> None:
    theta = THETA.clone().requires_grad_()
    log_pi, log_ref = theta.log_softmax(-1), REF.log_softmax(-1)
    (forward_kl_gradient,) = torch.autograd.grad((log_ref.exp() * (log_ref - log_pi)).sum(), theta)
    torch.testing.assert_close(one_token_gradients("k3", "loss")[0], forward_kl_gradient, rtol=0, atol=1e-12)


def test_zero_gradient_warning_names_the_table_entry() -> None:
    message = zero_gradient_warning("kl", "loss")
    assert message is not None and "REVERSE_KL_GRADIENT_UNBIASED[('kl', 'loss')]" in message and "\n" not in message
    assert zero_gradient_warning("kl", "reward") is None and zero_gradient_warning("none", "loss") is None


# ------------------------------------------------------------------------------------------------
# Advantage estimators and a reward-placed k1: groups of 2, every pair of samples enumerated
# ------------------------------------------------------------------------------------------------

ADVANTAGES = {  # table key -> (algorithm.advantage, algorithm config)
    "reinforce/none": ("reinforce", {"baseline": "none"}),
    "reinforce/loo": ("reinforce", {"baseline": "loo"}),
    "reinforce/batch_mean": ("reinforce", {"baseline": "batch_mean"}),
    "rloo": ("rloo", {}),
    "dr_grpo": ("dr_grpo", {}),
    "grpo": ("grpo", {}),
    "reinforce_pp": ("reinforce_pp", {}),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", {}),
}
GROUP = 2


def reward_kl_gradient_under(advantage: str, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact expected per-sample policy-loss gradient with return −k1, ∇KL) for one group of 2 samples."""
    cfg = SimpleNamespace(**{"scale_by_std": True, "baseline": "batch_mean", **options})
    estimator = get("advantage", advantage)
    theta = THETA.clone().requires_grad_()
    log_pi, log_ref = theta.log_softmax(-1), REF.log_softmax(-1)
    surrogate = torch.zeros((), dtype=DOUBLE)
    mask = torch.ones(GROUP, 1, dtype=DOUBLE)
    for pair in itertools.product(range(len(THETA)), repeat=GROUP):
        tokens = torch.tensor(pair)
        penalty = (log_pi[tokens] - log_ref[tokens]).detach()[:, None]  # β = 1, k1 in the reward
        advantages = estimator(-penalty, mask, GROUP, cfg).detach()
        loss = -(advantages[:, 0] * log_pi[tokens]).sum() / GROUP  # the policy loss at ratio 1, per sample
        surrogate = surrogate + log_pi[tokens].sum().exp().detach() * loss
    (estimated,) = torch.autograd.grad(surrogate, theta, retain_graph=True)
    (target,) = torch.autograd.grad((log_pi.exp() * (log_pi - log_ref)).sum(), theta)
    return estimated, target


def test_advantage_table_covers_the_estimators_tested() -> None:
    assert set(REWARD_KL_UNDER_ADVANTAGE) == set(ADVANTAGES)


@pytest.mark.parametrize("key", sorted(ADVANTAGES))
def test_advantage_estimator_with_reward_placed_k1(key: str) -> None:
    estimated, target = reward_kl_gradient_under(*ADVANTAGES[key])
    cosine, error = cosine_and_error(estimated, target)
    verdict = REWARD_KL_UNDER_ADVANTAGE[key]
    if verdict == "exact":
        assert error < 1e-12, f"{key}: relative error {error:.3g}"
    elif verdict == "scaled":  # a baseline that includes the sample itself: × (1 − 1/G)
        torch.testing.assert_close(estimated, (1 - 1 / GROUP) * target, rtol=0, atol=1e-12)
    else:  # divided by a standard deviation of the returns: the direction turns
        assert 0.9 < cosine < 0.999, f"{key}: cosine {cosine:.4f}"
        assert not math.isclose(cosine, 1.0, abs_tol=1e-6)


# ------------------------------------------------------------------------------------------------
# A task reward with k2 in the loss beside it, and kl.loss_scale: groups of 2, every pair enumerated
# ------------------------------------------------------------------------------------------------

TASK = torch.tensor([1.0, 0.2, 0.6, 0.0, 0.9], dtype=DOUBLE)  # the task reward of each of the 5 symbols
BETA = 0.2


def regularised_gradient(theta: torch.Tensor, advantage: str, options: dict, loss_scale: str,
                         batch_groups: int = 1, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact E[∇ loss], ∇(E_π[R] − β KL(π‖π_ref))) with the trainer's advantage estimator, its factor
    (``kl_loss_scale``) and ``mse`` (k2) placed in the loss through :class:`~rlhf_lab.kl.KLPenalty`.
    ``batch_groups`` groups of ``group`` samples in a batch (the batch-mean baseline sees all of them)."""
    from rlhf_lab.algorithms.advantages import kl_loss_scale
    from rlhf_lab.kl import KLPenalty

    cfg = SimpleNamespace(**{"scale_by_std": True, "baseline": "batch_mean", "std_eps": 1e-4, **options})
    penalty = KLPenalty(SimpleNamespace(name="mse", placement="loss", get=lambda key, default=None: {
        "loss_scale": loss_scale}.get(key, default)))
    estimator = get("advantage", advantage)
    theta = theta.clone().requires_grad_()
    log_pi, log_ref = theta.log_softmax(-1), REF.log_softmax(-1)
    rows = group * batch_groups
    surrogate = torch.zeros((), dtype=DOUBLE)
    mask = torch.ones(rows, 1, dtype=DOUBLE)
    for sample in itertools.product(range(len(theta)), repeat=rows):
        tokens = torch.tensor(sample)
        rewards = TASK[tokens][:, None]
        advantages = estimator(rewards, mask, group, cfg).detach()
        batch = SimpleNamespace(response_mask=mask, ref_logprobs=log_ref[tokens][:, None], ref_logits=None,
                                kl_loss_scale=kl_loss_scale(advantage, rewards[:, 0], group, cfg))
        kl_term = penalty.loss_term(log_pi[tokens][:, None], None, batch, BETA, reduce=lambda v, m: (v * m).sum())
        loss = (-(advantages[:, 0] * log_pi[tokens]).sum() + kl_term) / rows
        surrogate = surrogate + log_pi[tokens].sum().exp().detach() * loss
    (estimated,) = torch.autograd.grad(surrogate, theta, retain_graph=True)
    (target,) = torch.autograd.grad(-(log_pi.exp() * (TASK - BETA * (log_pi - log_ref))).sum(), theta)
    return estimated, target


def every_group_gradient(theta: torch.Tensor, advantage: str, loss_scale: str, group: int) -> torch.Tensor:
    """E[∇ loss] as :func:`regularised_gradient` for an estimator that works group by group: every one of the
    5^G groups at once, as the rows of one batch, each group's loss weighted by its probability. GRPO's factor of
    a group of equal returns is a batch mean, here its large-batch limit: the mean factor of the other groups
    weighted by their probability."""
    from rlhf_lab.algorithms.advantages import kl_loss_scale
    from rlhf_lab.kl import KLPenalty

    cfg = SimpleNamespace(scale_by_std=True, std_eps=1e-4)
    penalty = KLPenalty(SimpleNamespace(name="mse", placement="loss", get=lambda key, default=None: {
        "loss_scale": loss_scale}.get(key, default)))
    theta = theta.clone().requires_grad_()
    log_pi, log_ref = theta.log_softmax(-1), REF.log_softmax(-1)
    tokens = torch.tensor(list(itertools.product(range(len(theta)), repeat=group))).reshape(-1)  # [5^G · G]
    rewards, mask = TASK[tokens][:, None], torch.ones(len(tokens), 1, dtype=DOUBLE)
    advantages = get("advantage", advantage)(rewards, mask, group, cfg).detach()[:, 0]
    weights = log_pi[tokens].reshape(-1, group).sum(-1).exp().detach()  # each group's probability
    scale = kl_loss_scale(advantage, rewards[:, 0], group, cfg).reshape(-1, group)
    tied = rewards.reshape(-1, group).std(-1) == 0
    if advantage == "grpo" and tied.any():
        scale[tied] = float((weights[~tied] * scale[~tied, 0]).sum() / weights[~tied].sum())
    batch = SimpleNamespace(response_mask=mask, ref_logprobs=log_ref[tokens][:, None], ref_logits=None,
                            kl_loss_scale=scale.reshape(-1))
    kl_rows = penalty.loss_term(log_pi[tokens][:, None], None, batch, BETA, reduce=lambda v, m: v[:, 0] * m[:, 0])
    rows = -advantages * log_pi[tokens] + kl_rows
    (gradient,) = torch.autograd.grad((weights * rows.reshape(-1, group).mean(-1)).sum(), theta)
    return gradient


def fixed_point_gap(advantage: str, loss_scale: str, steps: int = 400, group: int = 4) -> float:
    """J* − J at the fixed point of the exact expected gradient (Adam from the reference), J = E[R] − β KL, with
    groups of ``group`` (4, as the exact task's experiments)."""
    theta = REF.clone().requires_grad_()
    optimizer = torch.optim.Adam([theta], lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        theta.grad = every_group_gradient(theta.detach(), advantage, loss_scale, group)
        optimizer.step()

    def objective(logits: torch.Tensor) -> float:
        log_pi, log_ref = logits.log_softmax(-1), REF.log_softmax(-1)
        return float((log_pi.exp() * (TASK - BETA * (log_pi - log_ref))).sum())

    optimum = REF.log_softmax(-1) + TASK / BETA  # π* ∝ π_ref · exp(R / β)
    return objective(optimum) - objective(theta.detach())


def test_every_group_at_once_is_the_enumeration_group_by_group() -> None:
    for advantage, loss_scale in (("dr_grpo", "advantage"), ("grpo", "none"), ("rloo", "advantage")):
        torch.testing.assert_close(every_group_gradient(THETA, advantage, loss_scale, GROUP),
                                   regularised_gradient(THETA, advantage, {}, loss_scale)[0], rtol=0, atol=1e-12)


SCALE_CASES = {"rloo": ("rloo", {}, 1), "dr_grpo": ("dr_grpo", {}, 1), "grpo": ("grpo", {}, 1),
               "reinforce/batch_mean": ("reinforce", {"baseline": "batch_mean"}, 2)}


def test_loss_scale_table_covers_the_cases_tested() -> None:
    from rlhf_lab.kl import KL_LOSS_SCALE_UNDER_ADVANTAGE

    assert set(KL_LOSS_SCALE_UNDER_ADVANTAGE) == {(key, scale) for key in SCALE_CASES for scale in ("none", "advantage")}


@pytest.mark.parametrize("loss_scale", ["none", "advantage"])
@pytest.mark.parametrize("key", sorted(SCALE_CASES))
def test_a_loss_placed_kl_beside_the_task_reward(key: str, loss_scale: str) -> None:
    from rlhf_lab.kl import KL_LOSS_SCALE_UNDER_ADVANTAGE

    advantage, options, batch_groups = SCALE_CASES[key]
    estimated, target = regularised_gradient(THETA, advantage, options, loss_scale, batch_groups)
    verdict = KL_LOSS_SCALE_UNDER_ADVANTAGE[(key, loss_scale)]
    rows = GROUP * batch_groups
    if verdict == "exact":
        torch.testing.assert_close(estimated, target, rtol=0, atol=1e-12)
    elif verdict == "scaled":  # a mean baseline over n samples that include the sample itself: × (1 − 1/n)
        n = GROUP if advantage == "dr_grpo" else rows
        torch.testing.assert_close(estimated, (1 - 1 / n) * target, rtol=0, atol=1e-12)
    else:  # the KL's weight against the task reward is not β: not proportional to the target
        cosine, _ = cosine_and_error(estimated, target)
        assert cosine < 0.999, f"{key}/{loss_scale}: cosine {cosine:.5f}"


def test_under_grpo_the_scaled_kl_ends_far_closer_to_the_regularised_optimum() -> None:
    """GRPO's std division makes the loss-placed KL's β act as β·(std + ε) of a group: the fixed point drifts to
    the reward maximiser. Scaled like the advantages, the KL keeps most of its weight (the remaining gap: the
    division by a sample-dependent std turns the direction, which no scalar factor undoes). RLOO, for contrast,
    reaches π* (gap < 1e-5 after 400 steps)."""
    plain, scaled, rloo = fixed_point_gap("grpo", "none"), fixed_point_gap("grpo", "advantage"), \
        fixed_point_gap("rloo", "none")
    assert rloo < 1e-5
    assert plain > 0.1 and scaled < 0.3 * plain, (plain, scaled)  # measured: 0.164 and 0.038


# ------------------------------------------------------------------------------------------------
# The sampler-trainer correction: samples of the engine's π_s, gradients wanted under the trainer's π_t
# ------------------------------------------------------------------------------------------------

SAMPLER_THETA = torch.tensor([0.6, 0.5, -0.9, 0.8, -0.7], dtype=DOUBLE)  # π_s: another engine's numbers


def corrected_gradient(term: str, correction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact E_{y ~ π_s}[∇ loss of y] with the trainer's pieces, the same term's gradient under π_t itself)."""
    from rlhf_lab.algorithms.losses import ClipRange, sampler_correction
    from rlhf_lab.kl import KLPenalty

    theta = THETA.clone().requires_grad_()
    log_pi, log_ref, log_sampler = theta.log_softmax(-1), REF.log_softmax(-1), SAMPLER_THETA.log_softmax(-1)
    ratios = (log_pi - log_sampler).exp().detach()
    cap = {"none": None, "uncapped": float(ratios.max()) * 2, "binding cap": float(ratios.max()) * 0.8}[correction]
    penalty = KLPenalty(SimpleNamespace(name="mse", placement="loss", get=lambda key, default=None: default))
    mask = torch.ones(1, 1, dtype=DOUBLE)

    def loss(y: int, with_correction: bool) -> torch.Tensor:
        logprob, old = log_pi[y].view(1, 1), log_pi[y].detach().view(1, 1)
        weights = sampler_correction(old, log_sampler[y].view(1, 1), mask, cap) if with_correction and cap else None
        if term == "k2 in the loss":
            batch = SimpleNamespace(response_mask=mask, ref_logprobs=log_ref[y].view(1, 1), ref_logits=None,
                                    tis_weights=weights)
            return penalty.loss_term(logprob, None, batch, 1.0, reduce=lambda v, m: (v * m).sum())
        advantage = TASK[y] if term == "task reward" else -(log_pi[y] - log_ref[y]).detach()  # k1 in the return
        per_token = get("policy_loss", "clip")(logprob, old, advantage.view(1, 1), mask, ClipRange(None, None)).per_token
        return (per_token * (weights if weights is not None else 1.0)).sum()

    estimated = sum(log_sampler[y].exp() * loss(y, True) for y in range(len(THETA)))
    target = sum(log_pi[y].exp().detach() * loss(y, False) for y in range(len(THETA)))
    return (torch.autograd.grad(estimated, theta, retain_graph=True)[0],
            torch.autograd.grad(target, theta, retain_graph=True)[0])


@pytest.mark.parametrize(("term", "correction"), sorted(SAMPLER_CORRECTION))
def test_the_sampler_correction_cell(term: str, correction: str) -> None:
    estimated, target = corrected_gradient(term, correction)
    _, error = cosine_and_error(estimated, target)
    if SAMPLER_CORRECTION[(term, correction)]:
        assert error < 1e-12, f"{term}/{correction}: relative error {error:.3g}"
    else:
        assert error > 0.01, f"{term}/{correction} is exact (relative error {error:.3g})"


# ------------------------------------------------------------------------------------------------
# Multi-turn masking: x1 (model), e(x1) (the environment's, fixed by x1), x2 (model)
# ------------------------------------------------------------------------------------------------

ENV_THETA = torch.tensor([[0.3, -0.2, 0.9, 0.0], [1.1, 0.0, -0.4, 0.2], [0.0, 0.5, 0.5, -1.0],
                          [-0.7, 0.2, 0.0, 0.6]], dtype=DOUBLE)  # the policy's own logits at the environment's position
ENV_REF = torch.tensor([[0.0, 0.4, -0.3, 0.1], [0.2, 0.2, 0.0, -0.5], [1.0, 0.0, 0.0, 0.3],
                        [0.0, -0.6, 0.4, 0.0]], dtype=DOUBLE)


def multi_turn_gradients(name: str, placement_name: str, mask_kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact E[∇ surrogate], ∇ KL(π‖π_ref) over the model's tokens) for x1 ~ p1, e = (x1 + 1) mod 4 written by the
    environment (the policy gives it p_e(e | x1)), x2 ~ p2(· | x1): every parameter, the environment position's
    included (its target gradient is 0)."""
    thetas = [STEP1_THETA.clone().requires_grad_(), ENV_THETA.clone().requires_grad_(),
              STEP2_THETA.clone().requires_grad_()]
    log_p1, log_pe, log_p2 = (theta.log_softmax(-1) for theta in thetas)
    log_ref1, log_refe, log_ref2 = STEP1_REF.log_softmax(-1), ENV_REF.log_softmax(-1), STEP2_REF.log_softmax(-1)
    mask = torch.tensor([[1.0, 0.0 if mask_kind == "model tokens" else 1.0, 1.0]], dtype=DOUBLE)
    surrogate, kl = torch.zeros((), dtype=DOUBLE), torch.zeros((), dtype=DOUBLE)
    for first, second in itertools.product(range(4), range(4)):
        env = (first + 1) % 4
        logprobs = torch.stack([log_p1[first], log_pe[first, env], log_p2[first, second]])[None]
        ref_logprobs = torch.stack([log_ref1[first], log_refe[first, env], log_ref2[first, second]])[None]
        logits = torch.stack([thetas[0], thetas[1][first], thetas[2][first]])[None]
        ref_logits = torch.stack([STEP1_REF, ENV_REF[first], STEP2_REF[first]])[None]
        trajectory = log_p1[first] + log_p2[first, second]  # the environment's token is certain given x1
        loss = sample_loss(name, placement_name, logprobs, ref_logprobs, logits, ref_logits, mask)
        surrogate = surrogate + trajectory.exp().detach() * loss
        kl = kl + trajectory.exp() * (trajectory - log_ref1[first] - log_ref2[first, second])
    estimated = torch.autograd.grad(surrogate, thetas, retain_graph=True, allow_unused=True, materialize_grads=True)
    target = torch.autograd.grad(kl, thetas, allow_unused=True, materialize_grads=True)
    return torch.cat([g.reshape(-1) for g in estimated]), torch.cat([g.reshape(-1) for g in target])


def test_the_multi_turn_table_covers_every_pair_under_both_masks() -> None:
    pairs = set(itertools.product(names("kl"), names("kl_placement")))
    assert set(MULTI_TURN_MASK) == {(*pair, mask) for pair in pairs for mask in ("model tokens", "all tokens")}


@pytest.mark.parametrize(("name", "placement_name", "mask_kind"), sorted(MULTI_TURN_MASK))
def test_the_multi_turn_mask_cell(name: str, placement_name: str, mask_kind: str) -> None:
    estimated, target = multi_turn_gradients(name, placement_name, mask_kind)
    environment_position = slice(4, 20)  # θ_e's 16 entries, after θ1's 4
    assert float(target[environment_position].abs().max()) == 0.0
    cosine, error = cosine_and_error(estimated, target)
    if MULTI_TURN_MASK[(name, placement_name, mask_kind)]:
        assert error < 1e-12, f"{name}/{placement_name}/{mask_kind}: relative error {error:.3g}"
    elif name != "none":
        assert error > 0.01, f"{name}/{placement_name}/{mask_kind} is unbiased (cosine {cosine:.4f})"
    if mask_kind == "model tokens":  # the environment's position never moves under the right mask
        assert float(estimated[environment_position].abs().max()) == 0.0
