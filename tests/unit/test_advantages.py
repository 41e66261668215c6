"""Advantage estimators (rlhf_lab/algorithms/advantages.py) against hand computation and independent references."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import rlhf_lab.components  # noqa: F401
from rlhf_lab.algorithms.advantages import rewards_to_go
from rlhf_lab.registry import get

CFG = OmegaConf.create({"scale_by_std": True, "baseline": "batch_mean"})
# Two prompts × G = 2; ragged: rows end after 3, 1, 2, 3 tokens. Token rewards: a KL penalty of −0.1 on every
# token and the score on the last one, so the returns are [1 − 0.3, 2 − 0.1, 0 − 0.2, 4 − 0.3] = [.7, 1.9, −.2, 3.7].
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float64)
SCORES = torch.tensor([1.0, 2.0, 0.0, 4.0], dtype=torch.float64)


def token_rewards() -> torch.Tensor:
    rewards = -0.1 * MASK.clone()
    last = MASK.sum(-1).long() - 1
    rewards[torch.arange(4), last] += SCORES
    return rewards


def advantages(name: str, cfg=CFG) -> torch.Tensor:
    return get("advantage", name)(token_rewards(), MASK, 2, cfg)


def test_rewards_to_go_by_hand() -> None:
    expected = torch.tensor([[0.7, 0.8, 0.9], [1.9, 0, 0], [-0.2, -0.1, 0], [3.7, 3.8, 3.9]], dtype=torch.float64)
    torch.testing.assert_close(rewards_to_go(token_rewards(), MASK), expected)


def test_group_estimators_by_hand() -> None:
    # Groups [.7, 1.9] (mean 1.3, deviations ∓0.6, Bessel std 0.8485) and [−.2, 3.7] (mean 1.75, ∓1.95, std 2.7577).
    dr = torch.tensor([-0.6, 0.6, -1.95, 1.95], dtype=torch.float64)
    torch.testing.assert_close(advantages("dr_grpo"), dr[:, None] * MASK)
    std = torch.tensor([0.6 * 2 ** 0.5] * 2 + [1.95 * 2 ** 0.5] * 2, dtype=torch.float64)
    torch.testing.assert_close(advantages("grpo"), (dr / (std + 1e-4))[:, None] * MASK)
    # Leave-one-out with G = 2: R_i − R_other = 2 × the deviation.
    torch.testing.assert_close(advantages("rloo"), 2 * dr[:, None] * MASK)
    # Batch mean of returns: (0.7 + 1.9 − 0.2 + 3.7) / 4 = 1.525.
    batch = torch.tensor([0.7, 1.9, -0.2, 3.7], dtype=torch.float64) - 1.525
    torch.testing.assert_close(advantages("reinforce"), batch[:, None] * MASK)
    none = OmegaConf.create({"scale_by_std": True, "baseline": "none"})
    torch.testing.assert_close(advantages("reinforce", none)[:, 0], torch.tensor([0.7, 1.9, -0.2, 3.7],
                                                                                  dtype=torch.float64))


def whiten_valid(values: torch.Tensor) -> torch.Tensor:
    valid = values[MASK > 0]
    return (values - valid.mean()) / (valid.std() + 1e-8) * MASK


def test_reinforce_pp_whitens_rewards_to_go_over_the_batch() -> None:
    torch.testing.assert_close(advantages("reinforce_pp"), whiten_valid(rewards_to_go(token_rewards(), MASK)))


def test_reinforce_pp_baseline_centres_per_group_then_whitens() -> None:
    dr = torch.tensor([-0.6, 0.6, -1.95, 1.95], dtype=torch.float64)[:, None] * MASK
    torch.testing.assert_close(advantages("reinforce_pp_baseline"), whiten_valid(dr))


def test_gae_is_ppo_s_alone() -> None:
    with pytest.raises(ValueError, match="algorithm.advantage=gae needs a critic; use algorithm=ppo"):
        advantages("gae")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_against_a_loop_reference(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, 3, generator=generator, dtype=torch.float64) * MASK
    got = get("advantage", "grpo")(rewards, MASK, 2, CFG)
    returns = [float((rewards[i] * MASK[i]).sum()) for i in range(4)]
    for i in range(4):
        group = returns[(i // 2) * 2 : (i // 2) * 2 + 2]
        mean = sum(group) / 2
        std = (sum((r - mean) ** 2 for r in group) / 1) ** 0.5
        assert got[i, 0].item() == pytest.approx((returns[i] - mean) / (std + 1e-4), abs=1e-9)


def test_remax_by_hand_on_the_ragged_batch() -> None:
    # Returns [.7, 1.9, -.2, 3.7]; greedy scores 1.0 for prompt 0 and 0.5 for prompt 1, per sample: [1, 1, .5, .5].
    baseline = torch.tensor([1.0, 1.0, 0.5, 0.5], dtype=torch.float64)
    got = get("advantage", "remax")(token_rewards(), MASK, 2, CFG, baseline_scores=baseline)
    expected = torch.tensor([-0.3, 0.9, -0.7, 3.2], dtype=torch.float64)[:, None] * MASK
    torch.testing.assert_close(got, expected)



def test_remax_reward_to_go_by_hand() -> None:
    """``remax_return=to_go`` (verl's): token t's reward-to-go minus the greedy score. Rewards-to-go
    [[.7, .8, .9], [1.9], [−.2, −.1], [3.7, 3.8, 3.9]] minus [1, 1, .5, .5]; the last token's advantage is the
    score minus the last KL term minus the baseline, as in ``total`` only at the first token."""
    baseline = torch.tensor([1.0, 1.0, 0.5, 0.5], dtype=torch.float64)
    cfg = OmegaConf.merge(CFG, {"remax_return": "to_go"})
    got = get("advantage", "remax")(token_rewards(), MASK, 2, cfg, baseline_scores=baseline)
    expected = torch.tensor([[-0.3, -0.2, -0.1], [0.9, 0, 0], [-0.7, -0.6, 0], [3.2, 3.3, 3.4]], dtype=torch.float64)
    torch.testing.assert_close(got, expected)
    total = get("advantage", "remax")(token_rewards(), MASK, 2, CFG, baseline_scores=baseline)
    torch.testing.assert_close(got[:, 0], total[:, 0])
    # Without a reward-placed KL (the score on the last token only) the two are the same.
    scores_only = token_rewards() + 0.1 * MASK
    torch.testing.assert_close(get("advantage", "remax")(scores_only, MASK, 2, cfg, baseline_scores=baseline),
                               get("advantage", "remax")(scores_only, MASK, 2, CFG, baseline_scores=baseline))


@pytest.mark.parametrize("eps", [1e-4, 1e-6])
def test_grpo_std_eps_is_the_configured_one(eps: float) -> None:
    # Group [.7, 1.9]: deviations ∓0.6, Bessel std 0.6·√2; group [−.2, 3.7]: ∓1.95, std 1.95·√2.
    got = advantages("grpo", OmegaConf.merge(CFG, {"std_eps": eps}))[:, 0]
    expected = [-0.6 / (0.6 * 2 ** 0.5 + eps), 0.6 / (0.6 * 2 ** 0.5 + eps),
                -1.95 / (1.95 * 2 ** 0.5 + eps), 1.95 / (1.95 * 2 ** 0.5 + eps)]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_remax_against_a_loop_reference(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(4, 3, generator=generator, dtype=torch.float64) * MASK
    greedy = torch.randn(2, generator=generator, dtype=torch.float64)
    got = get("advantage", "remax")(rewards, MASK, 2, CFG, baseline_scores=greedy.repeat_interleave(2))
    for i in range(4):
        ret = sum(float(rewards[i, t]) for t in range(3) if MASK[i, t])
        for t in range(3):
            assert got[i, t].item() == pytest.approx((ret - float(greedy[i // 2])) * float(MASK[i, t]), abs=1e-9)
