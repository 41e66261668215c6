"""Mode collapse measured exactly (rlhf_lab/testbed/modes.py): the optimal modes' masses, coverage and effective
number against hand computation, and the reward table's equally rewarded modes."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lab.testbed.metrics import exact_metrics, regularised_optimum
from rlhf_lab.testbed.modes import mode_metrics
from rlhf_lab.testbed.task import reward_table

DOUBLE = torch.float64


def test_two_modes_by_hand() -> None:
    # Four responses; the first two tie at R = 1 (the modes); π_ref = (0.1, 0.4, 0.3, 0.2) prefers the second.
    log_ref = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=DOUBLE).log()
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5], dtype=DOUBLE)
    log_policy = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=DOUBLE).log()  # collapsed onto the reference's minor mode
    log_optimal, _ = regularised_optimum(log_ref, rewards, 0.5)
    optimal = log_optimal.exp()
    metrics = mode_metrics(log_policy, log_optimal, log_ref, rewards)
    # mode 0 is the reference's favourite (response 1), mode 1 response 0
    assert metrics["exact/mode_mass/0"] == pytest.approx(0.1) and metrics["exact/mode_mass/1"] == pytest.approx(0.7)
    assert metrics["exact/mode_mass_optimal/0"] == pytest.approx(float(optimal[1]))
    assert metrics["exact/mode_mass"] == pytest.approx(0.8)
    split, split_optimal = (0.1 / 0.8, 0.7 / 0.8), (0.8, 0.2)  # π* splits the modes as π_ref does: 0.4 : 0.1
    assert metrics["exact/mode_coverage"] == pytest.approx(min(split[0], 0.8) + min(split[1], 0.2))
    assert metrics["exact/modes_effective"] == pytest.approx(math.exp(-sum(p * math.log(p) for p in split)))
    assert metrics["exact/modes_effective_optimal"] == pytest.approx(
        math.exp(-sum(p * math.log(p) for p in split_optimal)))
    at_optimum = mode_metrics(log_optimal, log_optimal, log_ref, rewards)
    assert at_optimum["exact/mode_coverage"] == pytest.approx(1.0)


def test_one_best_response_has_no_mode_metrics_and_beta_zero_spreads_by_the_reference() -> None:
    log_ref = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=DOUBLE).log()
    single = mode_metrics(log_ref, log_ref, log_ref, torch.tensor([1.0, 0.9, 0.0, 0.0], dtype=DOUBLE))
    assert set(single) == {"exact/entropy", "exact/entropy_optimal"}
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5], dtype=DOUBLE)
    metrics = exact_metrics(log_ref[:, None], log_ref[:, None], rewards, 0.0)  # β = 0: π* = π_ref on the modes
    assert metrics["exact/mode_mass_optimal"] == pytest.approx(1.0)
    assert metrics["exact/mode_mass_optimal/0"] == pytest.approx(0.8)
    assert metrics["exact/entropy_optimal"] == pytest.approx(-(0.8 * math.log(0.8) + 0.2 * math.log(0.2)))


def test_the_reward_table_ties_its_first_peaks() -> None:
    plain = reward_table(4, 3, seed=0, peaks=3, peak_reward=1.0, noise=0.3)
    tied = reward_table(4, 3, seed=0, peaks=3, peak_reward=1.0, noise=0.3, modes=3)
    best = (tied == tied.max()).nonzero().squeeze(-1)
    assert len(best) == 3 and float(tied.max()) == 1.0
    assert set(best.tolist()) == set(plain.topk(3).indices.tolist())  # the same responses, now tied
    others = torch.ones_like(tied, dtype=torch.bool)
    others[best] = False
    assert torch.equal(tied[others], plain[others])
    with pytest.raises(ValueError, match=r"reward.modes=1 is out of range; must be 0 \(off\) or in \[2, reward.peaks=3\]"):
        reward_table(4, 3, seed=0, peaks=3, peak_reward=1.0, noise=0.3, modes=1)


def test_mode_anchor_gives_every_high_reward_sample_the_anchors_regularised_weight() -> None:
    from rlhf_lab.registry import get
    from rlhf_lab.rewards.rescale import mode_anchor

    assert get("reward_rescale", "mode_anchor") is mode_anchor
    scores = torch.tensor([1.0, 0.2, 1.0, 0.9, 0.5, 0.1, 0.3, 0.0], dtype=DOUBLE)  # two groups of 4
    ref = torch.tensor([-2.0, -1.0, -3.0, -1.5, -0.5, -1.0, -2.0, -4.0], dtype=DOUBLE)
    beta = 0.5
    rescaled = mode_anchor(scores, ref, 4, beta, 0.9)
    # group 1: samples 0, 2, 3 reach τ = 0.9; the anchor is sample 3 (log π_ref −1.5), R(z) = 0.9
    expected = torch.tensor([0.9 + beta * (-1.5 + 2.0), 0.2, 0.9 + beta * (-1.5 + 3.0), 0.9, 0.5, 0.1, 0.3, 0.0],
                            dtype=DOUBLE)
    torch.testing.assert_close(rescaled, expected)  # group 2 has no sample at τ: unchanged
    weights = ref[[0, 2, 3]] + rescaled[[0, 2, 3]] / beta  # log(π_ref·exp(R̄/β)): equal for every mode
    torch.testing.assert_close(weights, weights[2].expand(3))
    assert torch.equal(get("reward_rescale", "none")(scores, ref, 4, beta, None), scores)
