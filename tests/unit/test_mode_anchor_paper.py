"""``reward.rescale=mode_anchor`` against Mode Anchored Reward Augmentation as GX-Chen et al. (arXiv 2510.20817,
Algorithm 1) state it: the high-reward set H = {y : R(y) ≥ τ}, the anchor z = argmax over H of π_ref(y), and for
every y in H the reward R(z) + β·(log π_ref(z) − log π_ref(y)); the rest unchanged. Numbers worked by hand, and the
training batch's hook (the reference's sequence log-probs over the response tokens, β = the KL coefficient)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from rlhf_lab.generation.rollout import Scored
from rlhf_lab.rewards.rescale import mode_anchor
from rlhf_lab.step.experience import ExperienceMaker

DOUBLE = torch.float64


def test_one_group_worked_by_hand() -> None:
    """τ = 0.5, β = 0.1. H = {0, 1, 3}; sample 2 is the reference's likeliest but below τ, so not the anchor; the
    anchor is sample 1 (log π_ref −1 within H), R(z) = 0.8:
    R̄0 = 0.8 + 0.1·(−1 + 3) = 1.0, R̄1 = 0.8, R̄3 = 0.8 + 0.1·(−1 + 2) = 0.9, R̄2 = 0.3."""
    scores = torch.tensor([1.0, 0.8, 0.3, 0.9], dtype=DOUBLE)
    ref = torch.tensor([-3.0, -1.0, -0.5, -2.0], dtype=DOUBLE)
    rescaled = mode_anchor(scores, ref, 4, 0.1, 0.5)
    torch.testing.assert_close(rescaled, torch.tensor([1.0, 0.8, 0.3, 0.9], dtype=DOUBLE), rtol=0, atol=1e-12)
    # The paper's property: the regularised target π_ref·exp(R̄/β) is the same for every y in H (here e^7) ...
    target = ref + rescaled / 0.1
    torch.testing.assert_close(target[[0, 1, 3]], torch.full((3,), 7.0, dtype=DOUBLE), rtol=0, atol=1e-12)
    # ... and the anchor keeps its reward while the others only go up (the "minimal change" to the rewards).
    assert bool((rescaled[[0, 1, 3]] >= scores[1]).all())


def test_the_threshold_is_inclusive_and_groups_are_separate() -> None:
    """R(y) = τ is in H; each prompt group has its own anchor; a group with nothing at τ keeps its scores."""
    scores = torch.tensor([0.5, 0.2, 0.9, 0.9, 0.1, 0.2], dtype=DOUBLE)  # three groups of 2
    ref = torch.tensor([-2.0, -0.1, -4.0, -1.0, -3.0, -1.0], dtype=DOUBLE)
    rescaled = mode_anchor(scores, ref, 2, 0.5, 0.5)
    expected = [0.5, 0.2,  # H = {0}: the anchor itself
                0.9 + 0.5 * (-1.0 + 4.0), 0.9,  # H = {2, 3}, z = 3
                0.1, 0.2]  # H empty
    torch.testing.assert_close(rescaled, torch.tensor(expected, dtype=DOUBLE), rtol=0, atol=1e-12)


def test_the_training_batch_passes_sequence_log_probs_over_the_response_and_the_kl_coefficient() -> None:
    """log π_ref(y) is the sum of the reference's token log-probs over the response mask (padding left out), β the
    step's KL coefficient; the task's scores are kept as ``reward/task``."""
    ref_tokens = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -0.5, -9.0]])  # the last token of each row is padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    rollout = Scored(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5),
                     response_mask=mask, prompt_width=2, group_size=2, logprobs=torch.zeros(2, 3),
                     entropy=torch.zeros(2, 3), scores=torch.tensor([1.0, 1.0]), ref_logprobs=ref_tokens, extras={})
    maker = SimpleNamespace(rescale=mode_anchor, cfg=OmegaConf.create({"reward": {"rescale_threshold": 0.9}}))
    rollout = ExperienceMaker._rescale(maker, rollout, 2, 0.25)  # the scored stage is frozen: a new one back
    # log π_ref = (−3, −1): the anchor is sample 1; R̄0 = 1 + 0.25·(−1 + 3) = 1.5
    torch.testing.assert_close(rollout.scores, torch.tensor([1.5, 1.0]))
    torch.testing.assert_close(rollout.extras["reward/task"], torch.tensor([1.0, 1.0]))


def _batch_of_two_groups(anchor: str | None) -> Scored:
    """Two prompts' groups of 2, every sample at the threshold: log π_ref = (−3, −2 | −1, −4)."""
    ref_tokens = torch.tensor([[-3.0], [-2.0], [-1.0], [-4.0]])
    rollout = Scored(input_ids=torch.zeros(4, 3, dtype=torch.long), attention_mask=torch.ones(4, 3),
                     response_mask=torch.ones(4, 1), prompt_width=2, group_size=2, logprobs=torch.zeros(4, 1),
                     entropy=torch.zeros(4, 1), scores=torch.tensor([1.0, 1.0, 1.0, 1.0]), ref_logprobs=ref_tokens,
                     extras={})
    reward = {"rescale_threshold": 0.9, **({"rescale_anchor": anchor} if anchor else {})}
    maker = SimpleNamespace(rescale=mode_anchor, cfg=OmegaConf.create({"reward": reward}))
    return ExperienceMaker._rescale(maker, rollout, 2, 0.5)


def test_the_batch_anchor_is_one_z_over_the_batch_as_the_paper_takes_it() -> None:
    """reward.rescale_anchor=batch (the default): one anchor over all four samples, z = sample 2 (log π_ref −1), so
    R̄(y) = 1 + 0.5·(−1 − log π_ref(y)) and π_ref·exp(R̄/β) is the same for all four (e^1 · e^2 = e^1 after −1)."""
    for anchor in (None, "batch"):
        scores = _batch_of_two_groups(anchor).scores
        torch.testing.assert_close(scores, torch.tensor([2.0, 1.5, 1.0, 2.5]))
        target = torch.tensor([-3.0, -2.0, -1.0, -4.0]) + scores / 0.5
        torch.testing.assert_close(target, torch.full((4,), 1.0))


def test_the_group_anchor_is_one_z_per_prompt_a_deviation() -> None:
    """reward.rescale_anchor=group: z = sample 1 in the first group (−2), sample 2 in the second (−1); the two
    groups' targets differ (e^0 against e^1), which the batch anchor does not allow."""
    scores = _batch_of_two_groups("group").scores
    torch.testing.assert_close(scores, torch.tensor([1.5, 1.0, 1.0, 2.5]))
    target = torch.tensor([-3.0, -2.0, -1.0, -4.0]) + scores / 0.5
    torch.testing.assert_close(target, torch.tensor([0.0, 0.0, 1.0, 1.0]))
