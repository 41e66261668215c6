"""Evaluation with its own settings: ``rlhf-lab eval`` on a run (samples per prompt, greedy, an eval-only reward,
win rate against the reference, exact KL, JSON and trackers), training's periodic evaluation with the same
settings, and one-line mistakes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import rlhf_lab
from rlhf_lab.trackers.jsonl import read_jsonl

# bf16-mixed on every machine, as auto resolved to where this test was written (auto is fp32 where bf16 products
# are slow): one small update from the reference, the two passes' bf16 logits agree and the exact KL reads 0.0;
# in float32 their last bits differ and the vocabulary-wide sums put the tiny true KL at about -2e-7.
TINY = ["model=tiny", "trainer.steps=1", "trainer.eval_prompts=2", "trainer.progress_bar=false",
        "algorithm.group_size=2", "trainer.prompts_per_step=2", "trainer.max_new_tokens=4",
        "trainer.precision=bf16-mixed"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("eval") / "run"
    # Training's periodic evaluation runs the eval settings too: two samples per prompt, a second reward.
    rlhf_lab.train([*TINY, "eval.samples_per_prompt=2", "eval.rewards=[length]"], run_dir=folder)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {line}\n" for line in TINY))
    return folder


def test_training_evaluation_uses_the_eval_settings(run_dir: Path) -> None:
    evals = [line for line in read_jsonl(run_dir / "metrics.jsonl") if "eval/reward/mean" in line]
    assert len(evals) == 2  # before and after training
    assert all("eval/reward/length/mean" in line and "eval/kl/exact_sequence" in line for line in evals)


def test_eval_command_with_its_own_sampling_rewards_and_win_rate(run_dir: Path, tmp_path: Path, run_cli) -> None:
    out = tmp_path / "out"
    code, printed, err = run_cli(["eval", str(run_dir), "eval.samples_per_prompt=2", "eval.greedy=true",
                              "eval.rewards=[length]", "eval.win_rate=true", "eval.win_rate_reward=length",
                              "logger=csv", "--out", str(out)])
    assert code == 0, err
    result = json.loads((out / "eval.json").read_text())
    metrics = result["metrics"]
    assert result["step"] == 1 and result["settings"]["greedy"] is True  # the policy after the run's 1 update
    assert 0.0 <= metrics["eval/win_rate"] <= 1.0
    assert metrics["eval/kl/exact"] >= 0.0 and "eval/reward/length/mean" in metrics
    samples = read_jsonl(out / "eval_samples.jsonl")
    assert len(samples) == 4  # 2 prompts x 2 samples
    assert samples[0]["response"] == samples[1]["response"]  # greedy: the same response for both samples
    with open(out / "metrics.csv", newline="") as handle:
        assert float(next(csv.DictReader(handle))["eval/win_rate"]) == pytest.approx(metrics["eval/win_rate"])
    assert "eval/win_rate" in printed


def test_eval_mistakes_are_one_line(run_dir: Path, tmp_path: Path, run_cli) -> None:
    code, _, err = run_cli(["eval", str(tmp_path / "missing")])
    assert code == 2 and "does not exist; give a run folder" in err and err.count("\n") == 1
    (tmp_path / "no_checkpoint").mkdir()
    code, _, err = run_cli(["eval", str(tmp_path / "no_checkpoint" / "checkpoints")])
    assert code == 2 and err.count("\n") == 1
    code, _, err = run_cli(["eval", str(run_dir), "eval.rewards=[nope]"])
    assert code == 2 and "eval.rewards: 'nope' is not a reward option; choose from:" in err
