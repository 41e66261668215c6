"""Advantages, policy losses and loss aggregation (rlhf_lab/algorithms), against hand computation.

Every expected number below is worked out by hand in the comment next to it; none is produced by calling
the function under test a second way.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from rlhf_lab.algorithms.advantages import baseline_advantages, group_advantages
from rlhf_lab.algorithms.base import (
    Algorithm,
    LossContext,
    PolicyOutput,
    aggregate,
    policy_weights,
    sequence_returns,
)
from rlhf_lab.algorithms.losses import ClipRange, clip_loss
from rlhf_lab.errors import RegistryError
from rlhf_lab.generation.rollout import Rollout, last_token_index, scores_to_token_rewards
from rlhf_lab.registry import get

# Two prompts, G = 4 samples each.
RETURNS = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
# Group 1 [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], Bessel std sqrt((4+1+0+9)/3) = sqrt(14/3) = 2.1602469.
# Group 2 [0, 0, 1, 1]: mean 0.5, deviations [-.5, -.5, .5, .5], std sqrt((4·0.25)/3) = sqrt(1/3) = 0.5773503.
# GRPO adds eps = 1e-4 to the std: -2 / 2.1603469 = -0.9257772, 0.5 / 0.5774503 = 0.8658754.
GRPO_EXPECTED = [
    -0.9257772446135025, -0.46288862230675126, 0.0, 1.3886658669202538,
    -0.8658754297607016, -0.8658754297607016, 0.8658754297607016, 0.8658754297607016,
]
DR_GRPO_EXPECTED = [-2.0, -1.0, 0.0, 3.0, -0.5, -0.5, 0.5, 0.5]

def clipped_policy_loss(logprobs, old_logprobs, advantages, mask, low, high):
    """(per-token loss, 0/1 where either clip binds) of ``losses.clip_loss``."""
    result = clip_loss(logprobs, old_logprobs, advantages, mask, ClipRange(low, high))
    return result.per_token, sum(result.events.values(), torch.zeros_like(mask))



def make_rollout(token_rewards: torch.Tensor, response_mask: torch.Tensor, group_size: int) -> Rollout:
    """A rollout carrying only what ``Algorithm.prepare`` and ``Algorithm.loss`` read (prompt width 1).

    ``token_rewards`` are expressed as the rollout carries them: the sequence score (the reward on each row's
    last valid token) and a per-token KL penalty such that score-on-last-token − penalty = token_rewards.
    """
    batch, width = response_mask.shape
    scores = token_rewards.gather(1, last_token_index(response_mask)[:, None]).squeeze(1)
    return Rollout(
        input_ids=torch.zeros(batch, width + 1, dtype=torch.long),
        attention_mask=torch.cat([torch.ones(batch, 1, dtype=torch.long), response_mask.long()], dim=1),
        response_mask=response_mask,
        prompt_width=1,
        group_size=group_size,
        logprobs=torch.zeros(batch, width, dtype=response_mask.dtype),
        entropy=torch.zeros(batch, width, dtype=response_mask.dtype),
        scores=scores,
        kl_penalty=scores_to_token_rewards(scores, response_mask) - token_rewards,
    )


def rewards_on_last_token(returns: torch.Tensor, width: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards [B, width] with each return on the last token of a full row, and an all-ones mask."""
    token_rewards = torch.zeros(len(returns), width, dtype=returns.dtype)
    token_rewards[:, -1] = returns
    return token_rewards, torch.ones(len(returns), width, dtype=returns.dtype)


# ------------------------------------------------------------------------------------------------ GRPO


def test_grpo_group_advantages_two_groups() -> None:
    advantages = group_advantages(RETURNS, group_size=4, scale_by_std=True)
    torch.testing.assert_close(advantages, torch.tensor(GRPO_EXPECTED, dtype=torch.float64), rtol=0, atol=1e-12)


def test_dr_grpo_keeps_the_centred_returns() -> None:
    advantages = group_advantages(RETURNS, group_size=4, scale_by_std=False)
    torch.testing.assert_close(advantages, torch.tensor(DR_GRPO_EXPECTED, dtype=torch.float64), rtol=0, atol=1e-12)


def test_grpo_group_with_equal_rewards_has_zero_advantage() -> None:
    # std 0: (R − mean) / (0 + eps) = 0 / 1e-4 = 0, not NaN.
    advantages = group_advantages(torch.tensor([0.7, 0.7, 0.7]), group_size=3)
    assert advantages.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("scale_by_std", "expected"), [("true", GRPO_EXPECTED), ("false", DR_GRPO_EXPECTED)])
def test_grpo_prepare_spreads_advantages_over_valid_tokens(compose, scale_by_std: str, expected: list[float]) -> None:
    cfg = compose(["algorithm=grpo", "algorithm.group_size=4", f"algorithm.scale_by_std={scale_by_std}"])
    algorithm = get("algorithm", "grpo")(cfg.algorithm)
    # Returns split over two tokens of each row; a third token is masked and carries a reward of 100 that
    # must not count: row i has rewards [R_i − 1, 1, 100] and mask [1, 1, 0].
    token_rewards = torch.stack([RETURNS - 1, torch.ones(8, dtype=torch.float64), torch.full((8,), 100.0,
                                 dtype=torch.float64)], dim=1)
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 8, dtype=torch.float64)
    rollout = make_rollout(token_rewards, mask, group_size=4)
    rollout, _ = algorithm.prepare(rollout)
    expected_tokens = torch.tensor(expected, dtype=torch.float64)[:, None] * mask
    torch.testing.assert_close(rollout.advantages, expected_tokens, rtol=0, atol=1e-12)
    torch.testing.assert_close(rollout.returns, RETURNS[:, None] * mask, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- REINFORCE


def test_reinforce_without_baseline_uses_the_returns() -> None:
    assert baseline_advantages(RETURNS, 4, "none").tolist() == RETURNS.tolist()


def test_reinforce_batch_mean_baseline() -> None:
    # mean over all 8 returns = 14 / 8 = 1.75
    expected = [-0.75, 0.25, 1.25, 4.25, -1.75, -1.75, -0.75, -0.75]
    torch.testing.assert_close(
        baseline_advantages(RETURNS, 4, "batch_mean"), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_rloo_leave_one_out_baseline() -> None:
    # b_i = mean of the other three of the group:
    # group 1: 1 − (2+3+6)/3 = −8/3, 2 − (1+3+6)/3 = −4/3, 3 − (1+2+6)/3 = 0, 6 − (1+2+3)/3 = 4
    # group 2: 0 − (0+1+1)/3 = −2/3 (twice), 1 − (0+0+1)/3 = 2/3 (twice)
    expected = [-8 / 3, -4 / 3, 0.0, 4.0, -2 / 3, -2 / 3, 2 / 3, 2 / 3]
    torch.testing.assert_close(
        baseline_advantages(RETURNS, 4, "loo"), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_unknown_baseline_names_the_valid_ones() -> None:
    with pytest.raises(RegistryError) as error:
        baseline_advantages(RETURNS, 4, "median")
    assert str(error.value) == "unknown baseline 'median'; registered: batch_mean, loo, none"


@pytest.mark.parametrize(
    ("baseline", "expected"),
    [("none", [1.0, 3.0]), ("batch_mean", [-1.0, 1.0]), ("loo", [-2.0, 2.0])],
)
def test_reinforce_prepare_per_baseline(compose, baseline: str, expected: list[float]) -> None:
    # returns [1, 3]: batch mean 2 -> [-1, 1]; leave-one-out with G = 2: 1 − 3 = −2, 3 − 1 = 2.
    cfg = compose(["algorithm=reinforce", "algorithm.group_size=2", f"algorithm.baseline={baseline}"])
    token_rewards, mask = rewards_on_last_token(torch.tensor([1.0, 3.0], dtype=torch.float64))
    rollout = make_rollout(token_rewards, mask, group_size=2)
    rollout, _ = Algorithm(cfg.algorithm).prepare(rollout)
    torch.testing.assert_close(rollout.advantages[:, 0], torch.tensor(expected, dtype=torch.float64))


def test_whitening_uses_valid_tokens_only(compose) -> None:
    cfg = compose(["algorithm=reinforce", "algorithm.group_size=2", "algorithm.baseline=none",
                   "algorithm.whiten_advantages=true"])
    # Row 0: return 1 over 3 valid tokens; row 1: return 3 on its single valid token.
    # Valid token weights [1, 1, 1, 3]: mean 1.5, unbiased variance (3·0.25 + 2.25)/3 = 1, std 1.
    # Whitened: (1 − 1.5)/1 = −0.5 and (3 − 1.5)/1 = 1.5; masked positions 0. (Had the 4 masked zeros
    # counted, the mean would be 6/8 = 0.75 and every value would differ.)
    token_rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = make_rollout(token_rewards, mask, group_size=2)
    rollout, _ = Algorithm(cfg.algorithm).prepare(rollout)
    expected = torch.tensor([[-0.5, -0.5, -0.5, 0.0], [1.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rollout.advantages, expected, rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------------- policy weights


def test_weight_by_reward_and_clamping() -> None:
    advantages = torch.tensor([-2.0, -1.0, 0.0, 3.0])
    scores = torch.tensor([-1.0, 2.0, 0.5, -3.0])
    mask = torch.ones(4, 1)

    def weights(weight_by: str, clamp: bool) -> list[float]:
        return policy_weights(advantages, scores, mask, weight_by, False, clamp)[:, 0].tolist()

    assert weights("advantage", False) == [-2.0, -1.0, 0.0, 3.0]
    assert weights("advantage", True) == [0.0, 0.0, 0.0, 3.0]
    assert weights("reward", False) == [-1.0, 2.0, 0.5, -3.0]
    assert weights("reward", True) == [0.0, 2.0, 0.5, 0.0]


def test_whitening_then_clamping_leaves_no_negative_weight() -> None:
    # Advantages [0, 0, 0, 4] on one token each: mean 1, unbiased std sqrt((1+1+1+9)/3) = 2, whitened
    # [-0.5, -0.5, -0.5, 1.5]; the clamp comes after the whitening, so the result is [0, 0, 0, 1.5]
    # (clamping first and whitening after would bring -0.5 back).
    advantages = torch.tensor([0.0, 0.0, 0.0, 4.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.float64)
    weights = policy_weights(advantages, advantages, mask, "advantage", True, True)
    torch.testing.assert_close(weights[:, 0], torch.tensor([0.0, 0.0, 0.0, 1.5], dtype=torch.float64),
                               rtol=0, atol=1e-7)


def test_weight_by_reward_uses_the_raw_score_not_the_kl_penalised_return(compose) -> None:
    cfg = compose(["algorithm=reinforce", "algorithm.group_size=2", "algorithm.baseline=none",
                   "algorithm.weight_by=reward"])
    # Scores [1, 3]; a KL penalty of 0.25 on each of 2 tokens makes the returns [0.5, 2.5].
    rollout = replace(make_rollout(torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64), 2),
                      scores=torch.tensor([1.0, 3.0], dtype=torch.float64),
                      kl_penalty=torch.full((2, 2), 0.25, dtype=torch.float64))
    rollout, _ = Algorithm(cfg.algorithm).prepare(rollout)
    assert rollout.returns[:, 0].tolist() == [0.5, 2.5]
    assert rollout.advantages[:, 0].tolist() == [1.0, 3.0]


def test_prepare_weight_by_reward_ignores_the_baseline(compose) -> None:
    cfg = compose(["algorithm=grpo", "algorithm.group_size=4", "algorithm.weight_by=reward",
                   "algorithm.clamp_negative_weights=true"])
    # The weights are the raw returns [-1, 2, 0.5, -3] with negatives set to 0, not the GRPO advantages.
    token_rewards, mask = rewards_on_last_token(torch.tensor([-1.0, 2.0, 0.5, -3.0], dtype=torch.float64))
    rollout = make_rollout(token_rewards, mask, group_size=4)
    rollout, _ = get("algorithm", "grpo")(cfg.algorithm).prepare(rollout)
    assert rollout.advantages[:, 0].tolist() == [0.0, 2.0, 0.5, 0.0]
    assert rollout.advantages[:, 2].tolist() == [0.0, 2.0, 0.5, 0.0]


def test_prepare_clamps_negative_advantages(compose) -> None:
    cfg = compose(["algorithm=grpo", "algorithm.group_size=4", "algorithm.scale_by_std=false",
                   "algorithm.clamp_negative_weights=true"])
    # Dr. GRPO advantages of [1, 2, 3, 6] are [-2, -1, 0, 3]; clamped [0, 0, 0, 3].
    token_rewards, mask = rewards_on_last_token(torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64))
    rollout = make_rollout(token_rewards, mask, group_size=4)
    rollout, _ = get("algorithm", "grpo")(cfg.algorithm).prepare(rollout)
    assert rollout.advantages[:, 1].tolist() == [0.0, 0.0, 0.0, 3.0]


# ------------------------------------------------------------------------------- clipped policy loss


def _clip_case(ratio: float, advantage: float, low: float | None, high: float | None) -> tuple[float, float, float]:
    """(loss, binds, d loss / d logprob) for one token with the given ratio and advantage."""
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    logprobs = (old + math.log(ratio)).requires_grad_(True)
    loss, binds = clipped_policy_loss(logprobs, old, torch.tensor([[advantage]], dtype=torch.float64),
                                      torch.ones(1, 1, dtype=torch.float64), low, high)
    loss.sum().backward()
    return loss.item(), binds.item(), logprobs.grad.item()


@pytest.mark.parametrize(
    ("ratio", "advantage", "loss", "binds", "grad"),
    [
        # A > 0, ratio 1.5 > 1.2: max(−2·1.5, −2·1.2) = −2.4, clipped, no gradient.
        (1.5, 2.0, -2.4, 1.0, 0.0),
        # A > 0, ratio 0.5 < 0.8: max(−2·0.5, −2·0.8) = −1.0, the clip does not bind; grad −A·ratio = −1.
        (0.5, 2.0, -1.0, 0.0, -1.0),
        # A < 0, ratio 0.5 < 0.8: max(2·0.5, 2·0.8) = 1.6, clipped, no gradient.
        (0.5, -2.0, 1.6, 1.0, 0.0),
        # A < 0, ratio 1.5 > 1.2: max(2·1.5, 2·1.2) = 3.0, not clipped; grad −A·ratio = 3.
        (1.5, -2.0, 3.0, 0.0, 3.0),
        # inside [0.8, 1.2]: −2·1.1 = −2.2, grad −2.2.
        (1.1, 2.0, -2.2, 0.0, -2.2),
    ],
)
def test_clipped_policy_loss_symmetric(ratio: float, advantage: float, loss: float, binds: float, grad: float) -> None:
    got_loss, got_binds, got_grad = _clip_case(ratio, advantage, 0.2, 0.2)
    assert got_loss == pytest.approx(loss, abs=1e-12)
    assert got_binds == binds
    assert got_grad == pytest.approx(grad, abs=1e-12)


def test_clipped_policy_loss_separate_low_and_high() -> None:
    # ε_low = 0.1, ε_high = 0.3: the range is [0.9, 1.3].
    # ratio 1.25, A = 1: inside the range -> −1.25 (with a symmetric 0.2 it would clip to −1.2).
    assert _clip_case(1.25, 1.0, 0.1, 0.3)[:2] == pytest.approx((-1.25, 0.0), abs=1e-12)
    assert _clip_case(1.25, 1.0, 0.2, 0.2)[:2] == pytest.approx((-1.2, 1.0), abs=1e-12)
    # ratio 0.85, A = −1: below 0.9 -> max(0.85, 0.9) = 0.9, clipped (a symmetric 0.2 would not clip it).
    assert _clip_case(0.85, -1.0, 0.1, 0.3)[:2] == pytest.approx((0.9, 1.0), abs=1e-12)
    assert _clip_case(0.85, -1.0, 0.2, 0.2)[:2] == pytest.approx((0.85, 0.0), abs=1e-12)
    # Only a high bound: ratio 0.1, A = −1 is never clipped below -> 0.1.
    assert _clip_case(0.1, -1.0, None, 0.3)[:2] == pytest.approx((0.1, 0.0), abs=1e-12)


def test_unclipped_policy_loss_is_minus_advantage_times_ratio() -> None:
    # No clip: −A·ratio = −2·3 = −6 and its gradient w.r.t. log π is also −A·ratio = −6.
    assert _clip_case(3.0, 2.0, None, None) == pytest.approx((-6.0, 0.0, -6.0), abs=1e-12)


def test_clipped_policy_loss_is_zero_on_masked_tokens() -> None:
    logprobs = torch.tensor([[0.0, 5.0]])
    loss, binds = clipped_policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]),
                                      torch.tensor([[1.0, 0.0]]), 0.2, 0.2)
    assert loss.tolist() == [[-1.0, 0.0]]
    assert binds.tolist() == [[0.0, 0.0]]


# ------------------------------------------------------------------------------------------ aggregate

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]])  # 100 sits on masked tokens
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_aggregate_token_mean_and_sequence_mean() -> None:
    whole = LossContext(minibatch_tokens=4.0, minibatch_rows=2)
    # token_mean: (1+2+3+4)/4 = 2.5; sequence_mean: (mean(1,2,3) + 4)/2 = (2 + 4)/2 = 3.
    assert aggregate(PER_TOKEN, MASK, "token_mean", whole).item() == pytest.approx(2.5)
    assert aggregate(PER_TOKEN, MASK, "sequence_mean", whole).item() == pytest.approx(3.0)
    # As one micro-batch of a mini-batch with 8 tokens in 4 rows: 10/8 = 1.25 and 6/4 = 1.5.
    part = LossContext(minibatch_tokens=8.0, minibatch_rows=4)
    assert aggregate(PER_TOKEN, MASK, "token_mean", part).item() == pytest.approx(1.25)
    assert aggregate(PER_TOKEN, MASK, "sequence_mean", part).item() == pytest.approx(1.5)


def test_aggregate_sequence_sum_constant_divides_by_rows_times_max_tokens() -> None:
    # Dr. GRPO: Σ loss·mask / (rows × max_new_tokens) = (1+2+3+4) / (2 × 4) = 1.25, whatever the lengths;
    # as a micro-batch of a 4-row mini-batch with max_new_tokens 5: 10 / 20 = 0.5.
    assert aggregate(PER_TOKEN, MASK, "sequence_sum_constant", LossContext(4.0, 2, 4)).item() == pytest.approx(1.25)
    assert aggregate(PER_TOKEN, MASK, "sequence_sum_constant", LossContext(8.0, 4, 5)).item() == pytest.approx(0.5)
    # Adding a token to a row changes token_mean's denominator, never this one's: (10 + 7) / 8.
    longer = MASK.clone()
    longer[1, 1] = 1.0
    per_token = PER_TOKEN.clone()
    per_token[1, 1] = 7.0
    assert aggregate(per_token, longer, "sequence_sum_constant", LossContext(5.0, 2, 4)).item() == pytest.approx(17 / 8)


def test_aggregate_rejects_unknown_mode() -> None:
    with pytest.raises(RegistryError) as error:
        aggregate(PER_TOKEN, MASK, "sum", LossContext(4.0, 2))
    assert str(error.value) == (
        "unknown loss_aggregation 'sum'; registered: sequence_mean, sequence_sum_constant, token_mean"
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_micro_batch_accumulation_equals_the_whole_mini_batch(compose, aggregation: str) -> None:
    cfg = compose(["algorithm=grpo", "algorithm.group_size=2", f"algorithm.loss_aggregation={aggregation}"])
    algorithm: Algorithm = get("algorithm", "grpo")(cfg.algorithm)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 1, 4])  # the halves hold 8 and 5 tokens: unequal on purpose
    mask = (torch.arange(5)[None, :] < lengths[:, None]).double()
    batch = make_rollout(torch.zeros(4, 5, dtype=torch.float64), mask, group_size=2)
    batch = replace(batch, logprobs=-torch.rand(4, 5, generator=generator, dtype=torch.float64) * mask,
                    advantages=torch.tensor([[1.5], [-0.5], [2.0], [-1.0]], dtype=torch.float64) * mask)
    # New log-probs move the ratio by up to ±0.5, so the 0.2 clip binds on some tokens and not others.
    shift = (torch.rand(4, 5, generator=generator, dtype=torch.float64) - 0.5) * mask
    new_logprobs = (batch.logprobs + shift).requires_grad_(True)

    def loss_of(rows: torch.Tensor, context: LossContext) -> tuple[torch.Tensor, dict]:
        part = batch.select(rows)
        output = PolicyOutput(logprobs=new_logprobs[rows], logits=torch.zeros(0), hidden=None)
        result = algorithm.loss(part, output, context)
        return result.loss, result.stats

    context = LossContext(minibatch_tokens=float(mask.sum()), minibatch_rows=4)
    whole_loss, whole_stats = loss_of(torch.arange(4), context)
    whole_grad, = torch.autograd.grad(whole_loss, new_logprobs)
    first, first_stats = loss_of(torch.tensor([0, 1]), context)
    second, second_stats = loss_of(torch.tensor([2, 3]), context)
    accumulated_grad, = torch.autograd.grad(first + second, new_logprobs)

    assert 0 < whole_stats["policy/clipfrac"].item() < 1  # the clip binds on some tokens only
    torch.testing.assert_close(first + second, whole_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(accumulated_grad, whole_grad, rtol=0, atol=1e-12)
    for key in ("loss/policy", "policy/clipfrac", "policy/approxkl"):
        torch.testing.assert_close(first_stats[key] + second_stats[key], whole_stats[key], rtol=0, atol=1e-12)
    # Without the mini-batch context (each half normalised by itself) the sum would differ.
    alone = loss_of(torch.tensor([0, 1]), LossContext(8.0, 2))[0] + loss_of(torch.tensor([2, 3]), LossContext(5.0, 2))[0]
    assert abs((alone - whole_loss).item()) > 1e-3


# ---------------------------------------------------------------------------------- names and returns


def test_rloo_is_reinforce_with_the_loo_baseline(compose) -> None:
    assert get("algorithm", "rloo") is Algorithm
    assert get("algorithm", "reinforce") is Algorithm
    assert compose(["algorithm=rloo"]).algorithm.advantage == "rloo"
    cfg = compose(["algorithm=rloo"])
    assert (cfg.algorithm.name, cfg.algorithm.baseline) == ("rloo", "loo")
    assert compose(["algorithm=reinforce"]).algorithm.baseline == "batch_mean"
    assert compose(["algorithm=grpo"]).algorithm.advantage == "grpo"  # the group is its baseline


def test_sequence_returns_sums_only_masked_tokens() -> None:
    token_rewards = torch.tensor([[1.0, 2.0, 3.0, 100.0], [-1.0, 50.0, 50.0, 50.0]])
    assert sequence_returns(token_rewards, MASK).tolist() == [6.0, -1.0]


def test_the_training_batch_is_a_frozen_stage_made_by_the_algorithm_alone(compose) -> None:
    """``Algorithm.training_batch``: a new, frozen batch with the advantages; the scored batch it came from is
    untouched; a sample left out of the loss takes part in the group statistics and is then masked out of every
    token; the sampling-time logits and hidden states are let go (the reference's too where the update reads none)."""
    import dataclasses

    cfg = compose(["algorithm=grpo", "algorithm.group_size=2"])
    algorithm = get("algorithm", "grpo")(cfg.algorithm)
    mask = torch.ones(4, 3, dtype=torch.float64)
    token_rewards = torch.zeros(4, 3, dtype=torch.float64)
    token_rewards[:, -1] = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    scored = replace(make_rollout(token_rewards, mask, 2), policy_logits=torch.zeros(4, 3, 5), hidden=torch.zeros(4, 3, 2),
                     ref_logits=torch.zeros(4, 3, 5))
    in_loss = torch.tensor([True, True, True, False])
    batch, stats = algorithm.training_batch(scored, in_loss=in_loss, keep_ref_logits=False)
    whole, _ = algorithm.prepare(scored)
    assert scored.advantages is None and scored.response_mask is mask  # the scored batch is not written
    assert torch.equal(batch.response_mask, mask * in_loss[:, None].double())
    assert torch.equal(batch.advantages[:3], whole.advantages[:3]) and torch.all(batch.advantages[3] == 0)
    assert whole.advantages[3].abs().sum() > 0  # the dropped sample had its own advantage in the group's statistics
    assert batch.policy_logits is None and batch.hidden is None and batch.ref_logits is None
    assert stats["advantages/mean"] == pytest.approx(float(whole.advantages.mean()))
    kept, _ = algorithm.training_batch(scored)
    assert kept.ref_logits is scored.ref_logits and torch.equal(kept.response_mask, mask)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.advantages = torch.zeros(4, 3)
