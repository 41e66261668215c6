"""The compute layer on a real step (tiny model, in-process): LM-head chunks, token-budget micro-batches and
padding-free packing leave the scoring pass's and the update's numbers alone; its bad inputs are one line."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_lab.runtime.timer import StepTimer
from rlhf_lab.training.loop import Trainer
from tests.limits import HANG_GUARD_S

WIDER = ["trainer.max_new_tokens=8", "trainer.prompts_per_step=2", "algorithm.group_size=4", "trainer.eval_prompts=0",
         "data.max_prompt_tokens=90"]  # a budget of 100 admits the longest row the config admits
COMPUTE = ["trainer.chunked_logprobs=true", "trainer.lm_head_chunk=5", "trainer.max_tokens_per_micro_batch=100",
           "trainer.pack_rows=true"]
ALGORITHMS = {  # readers of every quantity the layer computes: the full logits in the loss, entropy, a critic
    "grpo_full_kl_in_loss": ["algorithm=grpo", "kl=full", "kl.placement=loss", "algorithm.entropy_coef=0.01"],
    "ppo_separate_critic": ["algorithm=ppo", "algorithm.critic=separate", "algorithm.mini_batch_size=0"],
}


def scored_and_updated(compose, tiny_overrides, run_dir: Path, *overrides: str):
    trainer = Trainer(compose([*tiny_overrides(None), *WIDER, *overrides]), run_dir)
    torch.manual_seed(0)
    experience = trainer.experience.make(trainer.prompts.train[:2], 4, StepTimer(), ["a", "b"], kl_coef=0.05)
    rollout = experience.rollout.for_training()  # the training batch of the scored one
    scored = {key: getattr(rollout, key).clone() for key in ("response_mask", "ref_logprobs", "kl_exact", "kl_estimate")}
    kept_as_head = type(rollout.ref_logits).__name__  # what the update reads of the reference's logits
    rollout, _ = trainer.algorithm.prepare(rollout, trainer.updater.forward)
    grads = []
    trainer.updater.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: grads.extend(p.grad.clone() for p in trainer.updater.parameters))
    metrics = trainer.updater.update(rollout, 0.05, 0, StepTimer())
    return scored, grads, metrics, kept_as_head


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_compute_options_leave_a_step_s_numbers_alone(compose, tiny_overrides, tmp_path, algorithm):
    plain, plain_grads, plain_metrics, _ = scored_and_updated(compose, tiny_overrides, tmp_path / "plain",
                                                              *ALGORITHMS[algorithm])
    chunked, grads, metrics, kept_as_head = scored_and_updated(compose, tiny_overrides, tmp_path / "chunked",
                                                               *ALGORITHMS[algorithm], *COMPUTE)
    # The reference's logits were never made whole: kept as the head's inputs where the loss reads them.
    assert kept_as_head == ("HeadLogits" if "kl=full" in ALGORITHMS[algorithm] else "NoneType")
    assert torch.equal(chunked["response_mask"], plain["response_mask"])  # the same samples
    for key in ("ref_logprobs", "kl_exact", "kl_estimate"):
        torch.testing.assert_close(chunked[key], plain[key], rtol=1e-5, atol=1e-5, msg=key)
    assert len(grads) == len(plain_grads) > 0
    for grad, expected in zip(grads, plain_grads, strict=True):
        assert (grad - expected).abs().max() <= 1e-5 * expected.abs().max() + 1e-9
    assert metrics["loss/total"] == pytest.approx(plain_metrics["loss/total"], rel=1e-5, abs=1e-7)


def run_cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(Path.cwd())}
    command = [sys.executable, "-m", "rlhf_lab", "model=tiny", "trainer.steps=1", "trainer.prompts_per_step=2",
               "algorithm.group_size=2", "trainer.max_new_tokens=4", "trainer.eval_prompts=0",
               "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)


@pytest.mark.parametrize("override,message", [
    ("trainer.lm_head_chunk=0", r"trainer\.lm_head_chunk=0 is out of range; must be >= 1"),
    ("trainer.max_tokens_per_micro_batch=8", r"trainer\.max_tokens_per_micro_batch=8 is smaller than the longest row "
                                             r"a step may sample \(260 tokens: data\.max_prompt_tokens=256 \+ "
                                             r"trainer\.max_new_tokens=4\); raise it to at least 260, or set it to 0 "
                                             r"\(micro-batches by rows\) or null \(the device's default\)"),
])
def test_bad_compute_settings_stop_with_one_line(tmp_path, override, message):
    result = run_cli(tmp_path, override)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert re.fullmatch(f"error: {message}", result.stderr.rstrip().splitlines()[-1]), result.stderr[-2000:]


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_a_critic_s_sampling_time_values_run_in_the_training_pass_s_micro_batches(compose, tiny_overrides, tmp_path,
                                                                                  monkeypatch, critic):
    """PPO's values at sampling time (a separate critic's trunk, or the policy's where the decode kept no hidden
    states) run over the training pass's micro-batches, packed where it packs, and equal the whole batch's."""
    from rlhf_lab.algorithms.critic import SeparateCritic
    from rlhf_lab.step.update import Updater

    overrides = [*tiny_overrides(None), *WIDER, "algorithm=ppo", f"algorithm.critic={critic}",
                 "algorithm.mini_batch_size=0"]
    trainer = Trainer(compose([*overrides, *COMPUTE]), tmp_path / "cut")
    torch.manual_seed(0)
    rollout = trainer.experience.make(trainer.prompts.train[:2], 4, StepTimer(), ["a", "b"],
                                      kl_coef=0.05).rollout.for_training()
    rollout = dataclasses.replace(rollout, hidden=None)  # the shared head reads a forward pass, as on vLLM
    seen = []
    spied = SeparateCritic.forward if critic == "separate" else Updater.forward

    def spy(self, *args, **kwargs):
        batch = args[0]
        seen.append(batch.shape[0] if critic == "separate" else batch.input_ids.shape[0])
        return spied(self, *args, **kwargs)

    monkeypatch.setattr(SeparateCritic if critic == "separate" else Updater, "forward", spy)
    with trainer.precision.autocast():
        cut = trainer.algorithm.sampling_values(rollout, trainer.updater.forward)
    expected_groups = [len(rows) for rows in trainer.updater.row_groups(rollout)]
    assert len(expected_groups) > 1 and seen == expected_groups  # one pass per micro-batch, none whole
    trainer.algorithm.by_micro_batches = None
    with trainer.precision.autocast():
        whole = trainer.algorithm.sampling_values(rollout, trainer.updater.forward)
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-6)
