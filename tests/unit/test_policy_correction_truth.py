"""``POLICY_CORRECTION_GRADIENT`` (rlhf_lab/kl/truth.py) by exact enumeration: every sample of the behaviour policy in
one batch, each row's advantage its reward times its probability under the sampler, so the trainer's own loss
(:meth:`Algorithm.importance_weights`, :meth:`Algorithm.rejection`, :meth:`Algorithm.loss` with the policy loss and the
V3.2 mask) sums to E_μ[surrogate]; its gradient against ∇E_π[R].
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

import rlhf_lab.components  # noqa: F401
from rlhf_lab.algorithms.base import Algorithm, LossContext, PolicyOutput
from rlhf_lab.config.schema import GRPOConfig
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.kl import CORRECTION_SETTINGS, POLICY_CORRECTION_GRADIENT, POLICY_CORRECTIONS
from tests.unit.test_kl_truth import DOUBLE, SAMPLER_THETA, STEP1_THETA, STEP2_THETA, THETA, cosine_and_error
from tests.unit.test_kl_truth_off_policy import MU_STEP1, MU_STEP2

REWARD = torch.tensor([0.3, -1.0, 2.0, 0.5, 1.2], dtype=DOUBLE)  # R(y), one token
SEQUENCE_REWARD = torch.tensor([[1.0, -0.5, 0.2, 2.0], [0.0, 1.5, -1.0, 0.3], [0.7, 0.1, 1.1, -0.2],
                                [-1.3, 0.4, 0.9, 0.6]], dtype=DOUBLE)  # R(x1, x2)
MU_A_STEP2 = torch.tensor([[0.9, -0.2, 0.4, 0.0], [0.3, 0.2, -0.6, 0.1], [0.0, 0.8, -0.5, 0.6],
                           [-0.4, 0.0, 0.2, 0.9]], dtype=DOUBLE)  # the first version's second step (not the sampler's)
LOOSE = {"tis_cap": 1e6, "tis_floor": 1e-6, "m2po_tau": 1e6}  # above every ratio and second moment
OPTIONS = {
    "none": {},
    "token_truncate": {"tis_mode": "token_truncate"}, "token_mask": {"tis_mode": "token_mask"},
    "sequence_truncate": {"tis_mode": "sequence_truncate"}, "sequence_mask": {"tis_mode": "sequence_mask"},
    "icepop": {"tis_mode": "icepop"}, "geo_mask": {"tis_mode": "geo_mask"}, "m2po": {"tis_mode": "m2po"},
    "dppo": {"policy_loss": "dppo", "dppo_tau": 0.0, "clip_eps": None}, "off_policy_mask": {"off_policy_mask": 1e6},
}
BINDING = {"tis_cap": 1.05, "tis_floor": 0.9, "m2po_tau": 0.01, "clip_eps": 0.01, "off_policy_mask": 0.0}


def options(correction: str, binding: bool) -> dict:
    chosen = dict(OPTIONS[correction])
    if correction not in ("none", "dppo", "off_policy_mask"):
        chosen.update(LOOSE)
        if binding:
            chosen.update(tis_cap=1.1 if correction in ("icepop", "geo_mask") else BINDING["tis_cap"])
            chosen.update({key: BINDING[key] for key in ("tis_floor", "m2po_tau")})
    elif binding and correction != "none":
        chosen.update(clip_eps=BINDING["clip_eps"]) if correction == "dppo" else chosen.update(off_policy_mask=0.0)
    return chosen


def expected_loss(chosen: dict, logprobs: torch.Tensor, sampler: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """The trainer's loss of the batch of every sample (π_old = π_θ), summed over tokens and rows."""
    cfg = OmegaConf.structured(GRPOConfig(name="grpo", advantage="grpo", loss_aggregation="sequence_sum_constant",
                                          **{"clip_eps": 0.2, **chosen}))
    method = Algorithm(cfg)
    mask = torch.ones_like(logprobs)
    rows, width = mask.shape
    batch = Rollout(input_ids=torch.zeros(rows, width + 1, dtype=torch.long),
                    attention_mask=torch.ones(rows, width + 1, dtype=torch.long), response_mask=mask, prompt_width=1,
                    group_size=1, logprobs=logprobs.detach(), entropy=torch.zeros_like(mask), sampler_logprobs=sampler,
                    advantages=advantages.expand_as(mask))
    weights, _ = method.importance_weights(batch)
    batch = replace(batch, tis_weights=weights)
    keep = method.rejection(batch)
    if keep is not None:
        batch = replace(batch, response_mask=mask * keep)
    context = LossContext(minibatch_tokens=float(mask.sum()), minibatch_rows=1, max_response_tokens=1)
    return method.loss(batch, PolicyOutput(logprobs, logprobs[..., None], None), context).loss


def one_token(chosen: dict) -> tuple[torch.Tensor, torch.Tensor]:
    theta = THETA.clone().requires_grad_()
    log_pi, log_mu = theta.log_softmax(-1), SAMPLER_THETA.log_softmax(-1)
    advantages = (log_mu.exp() * REWARD)[:, None]
    loss = expected_loss(chosen, log_pi[:, None], log_mu[:, None], advantages)
    (estimated,) = torch.autograd.grad(-loss, theta, retain_graph=True, allow_unused=True, materialize_grads=True)
    (target,) = torch.autograd.grad((log_pi.exp() * REWARD).sum(), theta)
    return estimated, target


def sequences(chosen: dict, own_versions: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x1 ~ μ_a, x2 ~ μ_b(·|x1): the trainer given each token's own version's log-prob, or μ_a's for both."""
    theta1, theta2 = STEP1_THETA.clone().requires_grad_(), STEP2_THETA.clone().requires_grad_()
    log_p1, log_p2 = theta1.log_softmax(-1), theta2.log_softmax(-1)
    log_a1, log_b2, log_a2 = MU_STEP1.log_softmax(-1), MU_STEP2.log_softmax(-1), MU_A_STEP2.log_softmax(-1)
    pairs = list(itertools.product(range(4), range(4)))
    logprobs = torch.stack([torch.stack([log_p1[x1], log_p2[x1, x2]]) for x1, x2 in pairs])
    second = log_b2 if own_versions else log_a2
    sampler = torch.stack([torch.stack([log_a1[x1], second[x1, x2]]) for x1, x2 in pairs])
    probability = torch.stack([(log_a1[x1] + log_b2[x1, x2]).exp() for x1, x2 in pairs])
    rewards = torch.stack([SEQUENCE_REWARD[x1, x2] for x1, x2 in pairs])
    loss = expected_loss(chosen, logprobs, sampler, (probability * rewards)[:, None])
    (g1, g2) = torch.autograd.grad(-loss, (theta1, theta2), retain_graph=True, allow_unused=True,
                                    materialize_grads=True)
    on_policy = sum((log_p1[x1] + log_p2[x1, x2]).exp() * SEQUENCE_REWARD[x1, x2] for x1, x2 in pairs)
    (t1, t2) = torch.autograd.grad(on_policy, (theta1, theta2))
    return torch.cat([g1, g2.flatten()]), torch.cat([t1, t2.flatten()])


def gradients(correction: str, setting: str) -> tuple[torch.Tensor, torch.Tensor]:
    if setting in ("one token", "binding"):
        return one_token(options(correction, setting == "binding"))
    return sequences(options(correction, False), own_versions=setting == "per-token versions")


@pytest.mark.parametrize("correction", POLICY_CORRECTIONS)
@pytest.mark.parametrize("setting", CORRECTION_SETTINGS)
def test_policy_correction_truth_table(correction: str, setting: str) -> None:
    estimated, target = gradients(correction, setting)
    cosine, error = cosine_and_error(estimated, target)
    exact = error < 1e-10
    assert exact == POLICY_CORRECTION_GRADIENT[(correction, setting)], (cosine, error)
    if not exact:
        assert error > 1e-3  # clearly biased, not a rounding difference
