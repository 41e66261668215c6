"""experience: a scored rollout with its KL terms kept apart from the scores (ExperienceMaker, screen_scores)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlhf_lab.errors import RewardError
from rlhf_lab.kl import exact_kl
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.step.experience import screen_scores
from rlhf_lab.training.loop import Trainer


def test_screen_scores_errors_or_fills() -> None:
    scores = torch.tensor([0.5, float("nan"), 1.0, 2.0])
    components = {"a": torch.tensor([0.5, float("nan"), 1.0, 2.0])}
    with pytest.raises(RewardError) as raised:
        screen_scores(scores, components, ["p0", "p1"], 2, "error", "reward 'x'")
    assert str(raised.value) == ("component 'a' of reward 'x' returned nan for sample 1 (p0); "
                                 "reward.on_nonfinite=drop drops such samples instead")
    assert raised.value.sample == 1
    filled, valid = screen_scores(scores, components, ["p0", "p1"], 2, "drop", "reward 'x'")
    assert valid.tolist() == [True, False, True, True]
    assert filled.tolist() == [0.5, 0.5, 1.0, 2.0]  # the group's mean of its finite scores
    same, all_valid = screen_scores(scores[2:], {}, ["p"], 2, "error", "r")
    assert same is not None and bool(all_valid.all())


@pytest.mark.parametrize("placement", ["reward", "loss"])
def test_make_keeps_scores_and_kl_terms_apart(compose, tiny_overrides, tmp_path: Path, placement: str) -> None:
    cfg = compose([*tiny_overrides(tmp_path), "kl=kl", f"kl.placement={placement}", "kl.coef=0.5",
                   "trainer.eval_prompts=0", "reward=length"])
    trainer = Trainer(cfg, tmp_path / "run")
    with torch.no_grad():  # move the policy off the reference so the KL terms are not all zero
        for parameter in trainer.policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    timer = StepTimer()
    experience = trainer.experience.make(trainer.prompts.train[:2], 2, timer, ["a", "b"], kl_coef=0.5)
    rollout, mask = experience.rollout, experience.rollout.response_mask
    assert len(experience.prompts) == len(experience.responses) == rollout.batch_size == 4
    assert experience.prompts[:2] == [trainer.prompts.train[0]] * 2
    assert set(timer.times) == {"generate", "reward", "reference", "kl"}
    # k1 per token is log π − log π_ref of the sampled token; the exact KL comes from the full logits.
    torch.testing.assert_close(rollout.kl_estimate, (rollout.logprobs - rollout.ref_logprobs) * mask)
    with torch.no_grad():
        logits, _ = response_logits(trainer.policy, rollout.input_ids, rollout.attention_mask, rollout.prompt_width,
                                    1.0)
        ref_logits, _ = response_logits(trainer.models.reference, rollout.input_ids, rollout.attention_mask,
                                        rollout.prompt_width, 1.0)
    torch.testing.assert_close(rollout.kl_exact, exact_kl(logits, ref_logits) * mask, rtol=1e-4, atol=1e-6)
    assert rollout.policy_logits is None  # the [B, T, V] logits died with the scoring pass
    assert float(rollout.kl_exact.abs().sum()) > 0
    expected_penalty = 0.5 * rollout.kl_estimate if placement == "reward" else torch.zeros_like(mask)
    torch.testing.assert_close(rollout.kl_penalty, expected_penalty)
    assert rollout.kl_coef == 0.5
    # The scores are the reward's alone: the length rule on the decoded responses (4 tokens: few words).
    lengths = [len(text.split()) for text in experience.responses]
    assert rollout.scores.tolist() == pytest.approx([max(1 - (10 - n) / 20, -1.0) for n in lengths])
    assert all(math.isfinite(s) for s in rollout.scores.tolist())


def test_a_clamp_bounds_the_reward_placed_penalty(compose, tiny_overrides, tmp_path: Path) -> None:
    cfg = compose([*tiny_overrides(tmp_path), "kl=kl", "kl.placement=reward", "kl.coef=1.0", "kl.clamp_value=0.01",
                   "trainer.eval_prompts=0", "reward=length"])
    trainer = Trainer(cfg, tmp_path / "run")
    with torch.no_grad():  # far from the reference: |log r| well above the bound
        for parameter in trainer.policy.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    rollout = trainer.experience.make(trainer.prompts.train[:2], 2, StepTimer(), ["a", "b"], kl_coef=1.0).rollout
    raw = (rollout.logprobs - rollout.ref_logprobs) * rollout.response_mask
    assert float(raw.abs().max()) > 0.01
    torch.testing.assert_close(rollout.kl_estimate, raw.clamp(-0.01, 0.01))
    assert float(rollout.kl_penalty.abs().max()) <= 0.01 + 1e-7


@pytest.mark.parametrize("chunk", [0, 3])
def test_bf16_policy_and_reference_logits_give_the_float32_ones_kl_terms(compose, tiny_overrides, tmp_path: Path,
                                                                         chunk: int) -> None:
    cfg = compose([*tiny_overrides(tmp_path), "trainer.precision=bf16-mixed", "kl=k3", "trainer.eval_prompts=0",
                   f"trainer.logprob_chunk={chunk}"])
    trainer = Trainer(cfg, tmp_path / "run")
    maker = trainer.experience
    assert maker.logits_float32 is False  # temperature 1, k3 reads no logits
    with torch.no_grad():  # move the policy off the reference so the KL terms are not all zero
        for parameter in trainer.policy.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    rollouts = {}
    for float32 in (False, True):
        maker.logits_float32 = maker.engine.logits_float32 = maker.scoring.logits_float32 = float32
        torch.manual_seed(3)
        rollouts[float32] = maker.make(trainer.prompts.train[:2], 3, StepTimer(), ["a", "b"], kl_coef=0.1).rollout
    narrow, wide = rollouts[False], rollouts[True]
    assert narrow.policy_logits is None and narrow.ref_logits is None  # every chunk's logits died with it
    assert float(narrow.kl_exact.abs().sum()) > 0
    for key in ("response_ids", "logprobs", "entropy", "ref_logprobs", "kl_estimate", "kl_exact"):
        assert torch.equal(getattr(narrow, key), getattr(wide, key)), key
