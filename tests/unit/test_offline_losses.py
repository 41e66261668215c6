"""The DPO family and Bradley–Terry against hand computation on fixed log-probs."""

from __future__ import annotations

import math

import pytest
import torch

import rlhf_lab.components  # noqa: F401
from rlhf_lab.offline.losses import (
    PairLogps,
    bradley_terry_loss,
    chosen_nll,
    implicit_rewards,
    preference_loss,
    preference_metrics,
)
from rlhf_lab.registry import names

# Two pairs: policy and reference sequence log-probs, response lengths.
LOGPS = PairLogps(chosen=torch.tensor([-10.0, -4.0]), rejected=torch.tensor([-12.0, -3.0]),
                  ref_chosen=torch.tensor([-11.0, -4.5]), ref_rejected=torch.tensor([-11.5, -2.0]),
                  chosen_lengths=torch.tensor([5.0, 2.0]), rejected_lengths=torch.tensor([4.0, 3.0]))
BETA = 0.5
# h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)) per pair: 1.5 and 1.5
H = [(-10 + 11) - (-12 + 11.5), (-4 + 4.5) - (-3 + 2)]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_every_variant_is_registered():
    assert {"sigmoid", "ipo", "hinge", "robust", "simpo"} <= set(names("preference_loss"))


def test_sigmoid_ipo_hinge_match_hand_computation():
    torch.testing.assert_close(preference_loss("sigmoid", LOGPS, BETA),
                               torch.tensor([-log_sigmoid(BETA * h) for h in H]))
    torch.testing.assert_close(preference_loss("ipo", LOGPS, BETA), torch.tensor([(h - 1 / (2 * BETA)) ** 2 for h in H]))
    torch.testing.assert_close(preference_loss("hinge", LOGPS, BETA), torch.tensor([max(0.0, 1 - BETA * h) for h in H]))


def test_label_smoothing_cdpo_and_robust():
    eps = 0.1
    cdpo = [-(1 - eps) * log_sigmoid(BETA * h) - eps * log_sigmoid(-BETA * h) for h in H]
    robust = [(-(1 - eps) * log_sigmoid(BETA * h) + eps * log_sigmoid(-BETA * h)) / (1 - 2 * eps) for h in H]
    torch.testing.assert_close(preference_loss("sigmoid", LOGPS, BETA, label_smoothing=eps), torch.tensor(cdpo))
    torch.testing.assert_close(preference_loss("robust", LOGPS, BETA, label_smoothing=eps), torch.tensor(robust))
    torch.testing.assert_close(preference_loss("robust", LOGPS, BETA), preference_loss("sigmoid", LOGPS, BETA))


def test_simpo_is_length_normalised_and_reference_free():
    gamma = 0.3
    chosen_mean = [-10 / 5, -4 / 2]
    rejected_mean = [-12 / 4, -3 / 3]
    expected = [-log_sigmoid(BETA * (c - r) - gamma) for c, r in zip(chosen_mean, rejected_mean)]
    torch.testing.assert_close(preference_loss("simpo", LOGPS, BETA, gamma=gamma), torch.tensor(expected))
    shifted = PairLogps(LOGPS.chosen, LOGPS.rejected, LOGPS.ref_chosen + 7, LOGPS.ref_rejected - 3,
                        LOGPS.chosen_lengths, LOGPS.rejected_lengths)
    torch.testing.assert_close(preference_loss("simpo", shifted, BETA, gamma=gamma), torch.tensor(expected))
    chosen, rejected = implicit_rewards("simpo", LOGPS, BETA)
    torch.testing.assert_close(chosen, BETA * torch.tensor(chosen_mean))
    torch.testing.assert_close(rejected, BETA * torch.tensor(rejected_mean))



def test_ipo_from_summed_or_per_token_log_ratios():
    """``sum`` is eq. 17 as written (h above); ``mean`` divides each response's log-ratio by its token count, as
    TRL's ipo: pair 0 (1/5 − (−0.5)/4) = 0.325, pair 1 (0.5/2 − (−1)/3) = 0.58333."""
    per_token = [(-10 + 11) / 5 - (-12 + 11.5) / 4, (-4 + 4.5) / 2 - (-3 + 2) / 3]
    assert per_token == pytest.approx([0.325, 0.5833333])
    torch.testing.assert_close(preference_loss("ipo", LOGPS, BETA, ipo_normalize="mean"),
                               torch.tensor([(h - 1 / (2 * BETA)) ** 2 for h in per_token]))
    torch.testing.assert_close(preference_loss("ipo", LOGPS, BETA, ipo_normalize="sum"),
                               torch.tensor([(h - 1 / (2 * BETA)) ** 2 for h in H]))


def test_simpo_takes_label_smoothing_as_cdpo():
    gamma, eps = 0.3, 0.2
    z = [BETA * (c - r) - gamma for c, r in zip([-10 / 5, -4 / 2], [-12 / 4, -3 / 3])]
    expected = [-(1 - eps) * log_sigmoid(v) - eps * log_sigmoid(-v) for v in z]
    torch.testing.assert_close(preference_loss("simpo", LOGPS, BETA, eps, gamma), torch.tensor(expected))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_the_chosen_nll_adds_weight_times_the_mean_token_nll(loss_type):
    """α · (−log π(y_w) / |y_w|): 2.0 and 2.0 for the two pairs (−10 over 5 tokens, −4 over 2)."""
    alpha = 0.7
    torch.testing.assert_close(chosen_nll(LOGPS), torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(preference_loss(loss_type, LOGPS, BETA, nll_weight=alpha),
                               preference_loss(loss_type, LOGPS, BETA) + alpha * 2.0)


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.loss_type=hinge", "algorithm.label_smoothing=0.1"],
     "algorithm.label_smoothing=0.1 has no meaning for algorithm.loss_type=hinge; it applies to robust, sigmoid, "
     "simpo"),
    (["algorithm.ipo_normalize=token"], "algorithm.ipo_normalize='token' is not valid; choose from: sum, mean"),
    (["algorithm.nll_weight=-1"], "algorithm.nll_weight=-1.0 is out of range; must be >= 0.0"),
])
def test_preference_options_refuse_what_they_cannot_mean(compose, overrides, message):
    from rlhf_lab.errors import ConfigError

    with pytest.raises(ConfigError) as raised:
        compose(["algorithm=dpo", "data=preferences", "data.path=x.jsonl", "model=tiny", *overrides])
    assert str(raised.value) == message


def test_metrics_carry_trl_names_and_values():
    metrics = preference_metrics("sigmoid", LOGPS, BETA)
    chosen = BETA * (LOGPS.chosen - LOGPS.ref_chosen)  # [0.5, 0.25]
    rejected = BETA * (LOGPS.rejected - LOGPS.ref_rejected)  # [-0.25, -0.5]
    assert set(metrics) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                            "logps/chosen", "logps/rejected"}
    assert metrics["rewards/chosen"].item() == pytest.approx(float(chosen.sum()))
    assert metrics["rewards/rejected"].item() == pytest.approx(float(rejected.sum()))
    assert metrics["rewards/margins"].item() == pytest.approx(float((chosen - rejected).sum()))
    assert metrics["rewards/accuracies"].item() == 2.0
    assert metrics["logps/chosen"].item() == -14.0 and metrics["logps/rejected"].item() == -15.0


def test_dpo_gradient_equals_closed_form():
    """∂L/∂log π(y_w) = −β σ(−βh) and ∂L/∂log π(y_l) = +β σ(−βh) (Rafailov et al. 2023, §4)."""
    chosen = LOGPS.chosen.clone().requires_grad_(True)
    rejected = LOGPS.rejected.clone().requires_grad_(True)
    logps = PairLogps(chosen, rejected, LOGPS.ref_chosen, LOGPS.ref_rejected, LOGPS.chosen_lengths,
                      LOGPS.rejected_lengths)
    preference_loss("sigmoid", logps, BETA).sum().backward()
    weight = torch.sigmoid(-BETA * torch.tensor(H))
    torch.testing.assert_close(chosen.grad, -BETA * weight)
    torch.testing.assert_close(rejected.grad, BETA * weight)


def test_bradley_terry_with_margin_and_centring():
    chosen, rejected, margin = torch.tensor([1.0, -0.5]), torch.tensor([0.2, 0.5]), torch.tensor([0.3, 0.0])
    expected = [-log_sigmoid(1.0 - 0.2 - 0.3) + 0.01 * (1.2) ** 2, -log_sigmoid(-1.0) + 0.01 * 0.0]
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected, margin, 0.01), torch.tensor(expected))
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected),
                               torch.tensor([-log_sigmoid(0.8), -log_sigmoid(-1.0)]))
