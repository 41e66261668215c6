"""The scoring pass: π_old from the training model where the engine's log-probs are not the trainer's, the
sampler-trainer gap logged, and the exact KL every step, at evaluation only, or never, with no [B, T, V] kept."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.training.loop import Trainer

BASE = ["trainer.eval_prompts=2", "reward=length", "trainer.lr=1e-3"]


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("epochs", [1, 2])
def test_under_bf16_nothing_clips_at_the_first_update(compose, tiny_overrides, tmp_path: Path, epochs: int) -> None:
    """GSPO's ε = 3e-4 clips nearly every token when π_old is the bf16 decode's and π_θ the training pass's. With one
    update per rollout π_old is the training pass's own (detached) log-probs; with more, a scoring pass of the
    training model gives π_old (``generation.logprobs=auto``), the engine's kept beside them. Either way the first
    update clips nothing."""
    cfg = compose([*tiny_overrides(tmp_path), *BASE, "algorithm=gspo", "trainer.precision=bf16-mixed",
                   "trainer.steps=1", f"algorithm.epochs={epochs}"])
    trainer = Trainer(cfg, tmp_path / "run")
    maker = trainer.experience
    assert (maker.plan.rescore, maker.plan.old_from_update) == (epochs > 1, epochs == 1)
    experience = maker.make(trainer.prompts.train[:2], 2, StepTimer(), ["a", "b"], 0.05, train=True)
    rollout = experience.rollout
    assert rollout.policy_logits is None  # no [B, T, V] kept
    if epochs > 1:
        gap = ((rollout.logprobs - rollout.sampler_logprobs).abs() * rollout.response_mask).max()
        assert 0 < float(gap) < 0.1  # bf16 decode vs bf16 training pass: close, not equal
    updates = []
    minibatch_update = trainer.updater.minibatch_update
    trainer.updater.minibatch_update = lambda *args: updates.append(minibatch_update(*args)) or updates[-1]
    trainer.train()
    assert len(updates) == epochs and updates[0]["policy/clipfrac"] == 0.0  # the first update, before any move
    if epochs > 1:
        line = next(line for line in lines(tmp_path / "run") if "reward/mean" in line)
        assert 0.0 < line["rollout/logprob_diff_mean"] <= line["rollout/logprob_diff_max"]


def test_in_fp32_the_hf_engine_s_log_probs_are_the_trainer_s(compose, tiny_overrides, tmp_path: Path) -> None:
    cfg = compose([*tiny_overrides(tmp_path), *BASE, "trainer.steps=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    assert not trainer.experience.plan.rescore  # auto: the hf engine in fp32 samples with the trainer's numbers
    forced = compose([*tiny_overrides(tmp_path / "forced"), *BASE, "generation.logprobs=trainer"])
    maker = Trainer(forced, tmp_path / "forced" / "run").experience
    torch.manual_seed(0)
    rollout = maker.make(trainer.prompts.train[:2], 2, StepTimer(), ["a", "b"], 0.05).rollout
    gap = ((rollout.logprobs - rollout.sampler_logprobs).abs() * rollout.response_mask).max()
    assert float(gap) < 1e-4  # the decode's logits and the scoring pass's agree to float32 rounding


@pytest.mark.parametrize("mode", ["step", "eval", "off"])
def test_the_exact_kl_every_step_at_evaluation_only_or_never(compose, tiny_overrides, tmp_path: Path,
                                                             mode: str) -> None:
    cfg = compose([*tiny_overrides(tmp_path), *BASE, f"kl.exact={mode}"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.train()
    steps = [line for line in lines(tmp_path / "run") if "reward/mean" in line]
    evaluations = [line for line in lines(tmp_path / "run") if "eval/reward/mean" in line]
    assert all(("kl/exact" in line) == (mode == "step") for line in steps)
    assert all(("eval/kl/exact" in line) == (mode != "off") for line in evaluations)
    assert all("kl/estimate" in line for line in steps)


def test_a_sampler_without_the_trainer_s_numbers_cannot_be_corrected(compose, tiny_overrides) -> None:
    from rlhf_lab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^algorithm.tis_cap=2.0 corrects the sampler's log-probs"):
        compose([*tiny_overrides(None), "generation.logprobs=sampler", "algorithm.tis_cap=2.0"])
    with pytest.raises(ConfigError, match=r"^kl.exact='always' is not valid; choose from: step, eval, off"):
        compose([*tiny_overrides(None), "kl.exact=always"])


def _without_logits(monkeypatch) -> list[bool]:
    """The hf engine as an engine that reports no logits or entropies (as vLLM): zeros for the entropy, logits
    never kept. Returns the list that records the scoring pass's policy passes."""
    from rlhf_lab.generation.hf import HFGeneration
    from rlhf_lab.step.scoring_pass import ScoringPass

    generate, policy_pass, passes = HFGeneration.generate, ScoringPass._policy_pass, []

    def engine_generate(self, *args, **kwargs):
        self.keep_logits = False
        samples = generate(self, *args, **kwargs)  # frozen: the engine's output is never written after
        return dataclasses.replace(samples, entropy=torch.zeros_like(samples.entropy))

    def recorded_pass(self, part, timer):
        passes.append(True)
        return policy_pass(self, part, timer)

    monkeypatch.setattr(HFGeneration, "reports_entropy", False, raising=False)
    monkeypatch.setattr(HFGeneration, "generate", engine_generate)
    monkeypatch.setattr(ScoringPass, "_policy_pass", recorded_pass)
    return passes


def test_an_engine_without_logits_gets_the_entropy_from_the_training_pass(compose, tiny_overrides, tmp_path,
                                                                          monkeypatch) -> None:
    """One update per rollout, the exact KL at evaluation only: an engine that reports no logits (vLLM) needs no
    scoring pass of the training model for its training batches. π_old and the entropy come from the training
    pass, and the logged ``policy/entropy`` is the one the hf engine's decode reports for the same samples (fp32:
    the same numbers to rounding). Evaluation, which reads the exact KL, still gets the pass."""
    settings = [*BASE, "trainer.steps=2", "trainer.eval_every=1", "kl.exact=eval", "trainer.seed_per_prompt=true"]
    Trainer(compose([*tiny_overrides(tmp_path / "hf"), *settings]), tmp_path / "hf" / "run").train()
    passes = _without_logits(monkeypatch)
    trainer = Trainer(compose([*tiny_overrides(tmp_path / "engine"), *settings]), tmp_path / "engine" / "run")
    evaluations = []
    evaluate = trainer.evaluate
    trainer.evaluate = lambda step: evaluations.append(len(passes)) or evaluate(step)
    trainer.train()
    expected, measured = (
        [line for line in lines(tmp_path / name / "run") if "reward/mean" in line] for name in ("hf", "engine"))
    assert len(measured) == 2
    for want, got in zip(expected, measured, strict=True):
        assert got["policy/entropy"] > 0.1
        assert got["policy/entropy"] == pytest.approx(want["policy/entropy"], rel=1e-5)
        assert got["reward/mean"] == want["reward/mean"] and got["loss/policy"] == pytest.approx(want["loss/policy"])
    # Every policy pass ran inside an evaluation (each evaluation's batch rescored), none for a training batch.
    assert passes and len(passes) == sum(1 for line in lines(tmp_path / "engine" / "run") if "eval/kl/exact" in line)
    assert evaluations == sorted(evaluations) and evaluations[0] == 0


@pytest.mark.parametrize("setting", ["kl.exact=step", "algorithm.epochs=2", "kl=full"])
def test_an_engine_without_logits_is_rescored_where_a_batch_reads_them(compose, tiny_overrides, tmp_path,
                                                                       monkeypatch, setting: str) -> None:
    """The exact KL every step, a second update (π_old must stay the sampling policy's) or an estimator of full
    logits: the training batch gets the scoring pass, its entropy from there."""
    passes = _without_logits(monkeypatch)
    cfg = compose([*tiny_overrides(tmp_path), *BASE, "trainer.eval_prompts=0", "kl.exact=off", setting])
    maker = Trainer(cfg, tmp_path / "run").experience
    rollout = maker.make(["a b", "c d"], 2, StepTimer(), ["a", "b"], 0.05, train=True).rollout
    assert len(passes) == 1 and not rollout.entropy_from_update and not rollout.old_from_update
    assert float((rollout.entropy * rollout.response_mask).sum()) > 0.1
