"""DAPO's dynamic sampling and overlong shaping in the experience step, and ReMax's greedy baseline, on the tiny
model with a scripted reward whose ties are known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_lab.data.prompts import format_prompts
from rlhf_lab.generation.hf import generate
from rlhf_lab.rewards.base import RewardOutput
from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.training.loop import Trainer


class Scripted:
    """Score 0 for every sample of a prompt in ``tied``; else the sample's position in the call (all differ)."""

    def __init__(self, tied: set[str]) -> None:
        self.tied, self.calls = tied, []

    def describe(self) -> str:
        return "reward 'scripted'"

    def __call__(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        self.calls.append(list(prompts))
        return RewardOutput(torch.tensor([0.0 if p in self.tied else float(i) for i, p in enumerate(prompts)]))


def dapo_trainer(compose, tiny_overrides, tmp_path: Path, *overrides: str) -> Trainer:
    cfg = compose([*tiny_overrides(tmp_path), "algorithm=dapo", "algorithm.group_size=2", "kl=none",
                   "trainer.eval_prompts=0", "algorithm.overlong_window=0", "algorithm.mask_truncated=false",
                   *overrides])
    return Trainer(cfg, tmp_path / "run")


def refills(*batches: list[str]):
    calls = []

    def refill(round_: int, count: int):
        calls.append((round_, count))
        prompts = batches[round_ - 1][:count]
        return prompts, [f"refill {round_}.{j}" for j in range(count)], None

    return refill, calls


def test_tied_groups_are_dropped_and_the_batch_refilled(compose, tiny_overrides, tmp_path: Path) -> None:
    trainer = dapo_trainer(compose, tiny_overrides, tmp_path)
    trainer.experience.reward = Scripted(tied={"A"})
    refill, calls = refills(["C"])
    experience = trainer.experience.make(["A", "B"], 2, StepTimer(), ["a", "b"], 0.0, train=True, refill=refill)
    assert calls == [(1, 1)]  # one extra round for the one missing group
    assert experience.prompts == ["B", "B", "C", "C"]
    assert experience.rollout.scores.tolist() == [2.0, 3.0, 0.0, 1.0]  # B's places in round 0, C's in round 1
    assert experience.in_loss.tolist() == [True] * 4
    assert experience.stats["rounds"] == 2 and experience.stats["groups_dropped"] == 1
    assert experience.stats["refill_prompts"] == 1 and experience.stats["groups_filled"] == 0
    assert experience.rollout.kl_exact.shape[0] == 4 and experience.rollout.ref_logprobs.shape[0] == 4


def test_a_batch_without_ties_is_kept_as_sampled(compose, tiny_overrides, tmp_path: Path) -> None:
    """No group tied: no refill round, and the batch is the first sampling's rollout itself (not rebuilt)."""
    trainer = dapo_trainer(compose, tiny_overrides, tmp_path)
    trainer.experience.reward = Scripted(tied=set())
    sampled = []
    shaped = trainer.experience._shaped
    trainer.experience._shaped = lambda *args: sampled.append(shaped(*args)) or sampled[-1]
    refill, calls = refills(["C"])
    experience = trainer.experience.make(["A", "B"], 2, StepTimer(), ["a", "b"], 0.0, train=True, refill=refill)
    assert calls == [] and len(sampled) == 1 and experience is sampled[0]
    assert experience.prompts == ["A", "A", "B", "B"] and experience.rollout.scores.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert experience.stats["rounds"] == 1 and experience.stats["groups_dropped"] == 0
    assert experience.in_loss.tolist() == [True] * 4


def test_the_round_limit_keeps_the_batch_shape_with_tied_groups_out_of_the_loss(
        compose, tiny_overrides, tmp_path: Path) -> None:
    trainer = dapo_trainer(compose, tiny_overrides, tmp_path, "algorithm.max_refill_rounds=2")
    trainer.experience.reward = Scripted(tied={"A", "C", "D"})
    refill, calls = refills(["C"], ["D"])
    experience = trainer.experience.make(["A", "B"], 2, StepTimer(), ["a", "b"], 0.0, train=True, refill=refill)
    assert calls == [(1, 1), (2, 1)]  # stops after max_refill_rounds extra rounds
    assert experience.prompts == ["B", "B", "A", "A"]  # the first tied group holds the missing place
    assert experience.in_loss.tolist() == [True, True, False, False]
    assert experience.stats == {"rounds": 3.0, "groups_dropped": 3.0, "refill_prompts": 2.0, "groups_filled": 1.0,
                                "truncated": experience.stats["truncated"]}


def test_a_dapo_step_logs_its_sampling_counts_and_masks_the_filler(compose, tiny_overrides, tmp_path: Path) -> None:
    trainer = dapo_trainer(compose, tiny_overrides, tmp_path, "algorithm.max_refill_rounds=1")
    trainer.experience.reward = Scripted(tied=set(trainer.prompts.train))  # every group tied: nothing to learn
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    metrics = trainer.train_step(0)
    assert metrics["sampling/rounds"] == 2 and metrics["sampling/refill_prompts"] == 2
    assert metrics["sampling/groups_dropped"] == 4 and metrics["sampling/groups_filled"] == 2
    # Every sample is out of the loss: no gradient reaches the weights (AdamW's decay aside: lr·wd·w).
    lr, decay = trainer.cfg.trainer.lr, trainer.cfg.trainer.weight_decay
    for old, new in zip(before, trainer.policy.parameters()):
        torch.testing.assert_close(new.detach(), old * (1 - lr * decay))


def test_overlong_shaping_and_truncation_mask_in_a_step(compose, tiny_overrides, tmp_path: Path) -> None:
    # The tiny random model never emits EOS within 4 tokens: every response is cut at the limit.
    trainer = dapo_trainer(compose, tiny_overrides, tmp_path, "algorithm.overlong_window=2",
                           "algorithm.overlong_penalty=0.5", "algorithm.mask_truncated=true",
                           "algorithm.dynamic_sampling=false")
    trainer.experience.reward = Scripted(tied=set())
    experience = trainer.experience.make(trainer.prompts.train[:2], 2, StepTimer(), ["a", "b"], 0.0, train=True)
    lengths = experience.rollout.response_mask.sum(-1)
    assert lengths.tolist() == [4.0] * 4
    assert experience.rollout.scores.tolist() == [-0.5, 0.5, 1.5, 2.5]  # position in the call, minus 0.5 at L_max
    assert experience.rollout.extras["reward/overlong_penalty"].tolist() == [-0.5] * 4
    assert experience.in_loss.tolist() == [False] * 4
    metrics = trainer.train_step(0)
    assert metrics["response/truncated_frac"] == 1.0 and metrics["overlong/masked_frac"] == 1.0


def test_remax_scores_the_greedy_response_as_baseline(compose, tiny_overrides, tmp_path: Path) -> None:
    cfg = compose([*tiny_overrides(tmp_path), "algorithm=remax", "trainer.eval_prompts=0", "reward=length"])
    trainer = Trainer(cfg, tmp_path / "run")
    prompts = trainer.prompts.train[:2]
    timer = StepTimer()
    experience = trainer.experience.make(prompts, 2, timer, ["a", "b"], 0.0, train=True)
    assert "generate_greedy" in timer.times
    # The baseline of each sample is the length reward of its prompt's greedy continuation, decoded apart.
    formatted = format_prompts(prompts, trainer.tokenizer, cfg.model.chat_template, cfg.model.system_prompt)
    greedy = generate(trainer.experience.policy, trainer.tokenizer, formatted, 1, 4, 1.0, 1.0, 0, 512, False,
                      greedy=True)
    texts = trainer.tokenizer.batch_decode(greedy.response_ids, skip_special_tokens=True)
    expected = trainer.reward(prompts, texts).scores.repeat_interleave(2)
    torch.testing.assert_close(experience.rollout.baseline_scores, expected)
    # Greedy decoding is deterministic: a second call gives the same baseline.
    again = trainer.experience.make(prompts, 2, StepTimer(), ["a", "b"], 0.0, train=True)
    torch.testing.assert_close(again.rollout.baseline_scores, expected)


@pytest.mark.parametrize("preset", ["dapo", "remax"])
def test_the_new_presets_run_through_the_cli_path(compose, tiny_overrides, tmp_path: Path, preset: str) -> None:
    cfg = compose([*tiny_overrides(tmp_path), f"algorithm={preset}", "reward=length"])
    summary = Trainer(cfg, tmp_path / "run").train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_lines = [line for line in lines if "reward/mean" in line]
    assert [line["step"] for line in train_lines] == [0, 1]
    key = "sampling/rounds" if preset == "dapo" else "time/generate_greedy_s"
    assert all(key in line for line in train_lines)
    assert summary["steps"] == 2
