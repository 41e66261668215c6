"""DAPO's sampling rules (overlong penalty, truncation, tied groups, refill prompts) and ReMax's advantage,
against hand computation."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_lab.algorithms.advantages import remax
from rlhf_lab.algorithms.base import Algorithm
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.step.sampling import SamplingRules, informative_groups, overlong_penalty, refill_indices, truncated


def test_overlong_penalty_at_the_window_edges() -> None:
    # L_max = 10, window W = 4: no penalty up to 6 tokens, then (6 - L) / 4, -1 at 10 (times the factor).
    lengths = torch.tensor([1, 5, 6, 7, 8, 9, 10])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    assert overlong_penalty(lengths, 10, 0).tolist() == [0.0] * 7  # window 0: off
    # The window as long as the limit: every token costs factor / L_max.
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 10).tolist() == [0.0, -0.5, -1.0]
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 25).tolist() == [0.0, -0.5, -1.0]  # capped at L_max


def test_truncated_means_no_eos_at_the_end() -> None:
    eos, pad = 2, 0
    response_ids = torch.tensor([[5, 6, eos, pad], [5, 6, 7, 8], [eos, pad, pad, pad], [5, 6, 7, eos]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]).float()
    assert truncated(response_ids, mask, eos).tolist() == [False, True, False, False]
    assert truncated(response_ids, mask, [eos, 9]).tolist() == [False, True, False, False]
    assert truncated(response_ids, mask, None).tolist() == [False] * 4  # no EOS at all (the exact task)


def test_informative_groups_need_two_different_valid_scores() -> None:
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 2.0, 3.0, 4.0, 5.0])
    valid = torch.tensor([True] * 6 + [True, True, True, False] + [True, False])
    # groups of 2: tied, differ, tied, tied, then two groups with one valid sample each (no comparison)
    informative = informative_groups(scores, valid, 2)
    assert informative.tolist() == [False, True, False, False, False, False]
    assert informative_groups(scores, torch.ones(12, dtype=torch.bool), 3).tolist() == [False, True, True, True]
    assert informative_groups(torch.zeros(6), torch.ones(6, dtype=torch.bool), 3).tolist() == [False, False]


def test_refill_indices_are_a_pure_function_of_step_and_round() -> None:
    first = refill_indices(3, 1, 5, 20, seed=0)
    assert first == refill_indices(3, 1, 5, 20, seed=0)
    assert len(set(first)) == 5 and all(0 <= i < 20 for i in first)
    assert first != refill_indices(3, 2, 5, 20, seed=0)
    assert first != refill_indices(4, 1, 5, 20, seed=0)
    assert len(refill_indices(0, 1, 7, 3, seed=0)) == 7  # more than the prompts: the permutation wraps


def test_sampling_rules_read_the_algorithm_config() -> None:
    cfg = OmegaConf.create({"dynamic_sampling": True, "max_refill_rounds": 2, "overlong_window": 6,
                            "overlong_penalty": 0.5, "mask_truncated": True})
    assert SamplingRules.from_config(cfg) == SamplingRules(True, 2, 6, 0.5, True)
    assert not SamplingRules.from_config(OmegaConf.create({})).shapes_rewards


def test_remax_subtracts_the_greedy_score_from_the_return() -> None:
    token_rewards = torch.tensor([[0.0, -0.1, 1.0], [0.0, 0.5, 0.0], [-0.2, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]]).float()
    baseline = torch.tensor([0.4, 0.4, 1.0])
    # Returns: 0.9, 0.5, 1.8 -> minus baselines 0.5, 0.1, 0.8 on every valid token.
    expected = torch.tensor([[0.5, 0.5, 0.5], [0.1, 0.1, 0.0], [0.8, 0.8, 0.0]])
    torch.testing.assert_close(remax(token_rewards, mask, 1, None, baseline_scores=baseline), expected)
    with pytest.raises(ValueError, match="greedy"):
        remax(token_rewards, mask, 1, None)


def test_the_remax_algorithm_uses_the_rollouts_baseline() -> None:
    cfg = OmegaConf.create({"advantage": "remax", "policy_loss": "reinforce", "clip_eps": 0.2, "clip_eps_low": None,
                            "clip_eps_high": None, "clip_ratio_c": None, "tis_cap": None, "weight_by": "advantage",
                            "whiten_advantages": False, "clamp_negative_weights": False,
                            "loss_aggregation": "token_mean"})
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rollout = Rollout(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3),
                      response_mask=mask, prompt_width=1, group_size=2, logprobs=torch.zeros(2, 2),
                      entropy=torch.zeros(2, 2), scores=torch.tensor([1.0, -1.0]), kl_penalty=torch.zeros(2, 2),
                      baseline_scores=torch.tensor([0.25, 0.25]))
    rollout, stats = Algorithm(cfg).prepare(rollout)
    torch.testing.assert_close(rollout.advantages, torch.tensor([[0.75, 0.75], [-1.25, 0.0]]))
    assert stats["advantages/baseline_mean"] == pytest.approx(0.25)


def _part(prompt_width: int, response_width: int, score: float | None) -> Rollout:
    rows = 2
    return Rollout(input_ids=torch.ones(rows, prompt_width + response_width, dtype=torch.long),
                   attention_mask=torch.ones(rows, prompt_width + response_width, dtype=torch.long),
                   response_mask=torch.ones(rows, response_width), prompt_width=prompt_width, group_size=2,
                   logprobs=torch.full((rows, response_width), -1.0), entropy=torch.ones(rows, response_width),
                   scores=None if score is None else torch.full((rows,), score),
                   extras={} if score is None else {"reward/x": torch.full((rows,), 2 * score)})


@pytest.mark.parametrize("scored", [False, True])
def test_concat_rollouts_pads_and_carries_scores_when_there_are_any(scored: bool) -> None:
    from rlhf_lab.generation.rollout import concat_rollouts

    joined = concat_rollouts([_part(3, 2, 1.0 if scored else None), _part(1, 4, 3.0 if scored else None)], 0)
    assert joined.prompt_width == 3 and joined.response_mask.shape == (4, 4)
    assert joined.response_mask.sum(-1).tolist() == [2.0, 2.0, 4.0, 4.0]
    assert joined.attention_mask[2].tolist() == [0, 0, 1, 1, 1, 1, 1]  # left-padded prompt, full response
    if scored:
        assert joined.scores.tolist() == [1.0, 1.0, 3.0, 3.0]
        assert joined.extras["reward/x"].tolist() == [2.0, 2.0, 6.0, 6.0]
    else:
        assert joined.scores is None and joined.extras == {}
