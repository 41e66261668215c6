"""Mode collapse through the real trainer on the exact task (reward.modes): every exact step logs the entropy and
the optimal modes' split, reward.rescale=mode_anchor rescores the training batch (the task reward logged beside it),
and an evaluation with several samples per prompt logs pass@k and the group's distinct-n."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_lab.errors import ConfigError
from rlhf_lab.training.loop import Trainer

TASK = ["experiment=exact", "model.exact.symbols=3", "trainer.max_new_tokens=2", "reward.peaks=2", "reward.modes=2",
        "kl.coef=0.05", "algorithm=rloo", "trainer.steps=3", "trainer.exact_every=1", "logger.samples_every=1000",
        "trainer.eval_prompts=1", "trainer.eval_every=3", "eval.samples_per_prompt=4", "eval.pass_threshold=0.99"]


def test_mode_metrics_rescaled_rewards_and_pass_at_k(compose, tmp_path: Path) -> None:
    cfg = compose([*TASK, "reward.rescale=mode_anchor", "reward.rescale_threshold=0.99",
                   f"trainer.output_dir={tmp_path}"])
    Trainer(cfg, tmp_path).train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "reward/mean" in line]
    assert len(train) == 3
    for line in train:
        assert 0.0 < line["exact/mode_coverage"] <= 1.0 + 1e-9
        assert line["exact/mode_mass/0"] + line["exact/mode_mass/1"] == pytest.approx(line["exact/mode_mass"])
        assert 1.0 <= line["exact/modes_effective_optimal"] <= 2.0 and line["exact/entropy"] > 0
        assert "reward/task" in line  # the task's reward beside the rescaled one the algorithm optimises
    evaluations = [line for line in lines if "eval/pass@1" in line]
    assert evaluations and set(evaluations[-1]) >= {"eval/pass@4", "eval/group_distinct_1", "eval/group_distinct_2"}
    assert "eval/pass@16" not in evaluations[-1]  # 16 > 4 samples per prompt
    assert 0.0 <= evaluations[-1]["eval/pass@1"] <= evaluations[-1]["eval/pass@4"] <= 1.0


def test_rescale_needs_its_threshold_and_modes_their_range(compose) -> None:
    with pytest.raises(ConfigError, match="reward.rescale=mode_anchor rescores the samples at or above "
                                          "reward.rescale_threshold, which is null"):
        compose([*TASK, "reward.rescale=mode_anchor"])
    with pytest.raises(ConfigError, match=r"reward.rescale='anchor' is not valid; did you mean 'mode_anchor'\? choose from: mode_anchor, none"):
        compose([*TASK, "reward.rescale=anchor"])
    with pytest.raises(ConfigError, match=r"reward.modes=3 is out of range; must be 0 \(off\) or in \[2, reward.peaks=2\]"):
        compose([*TASK, "reward.modes=3"])
    with pytest.raises(ConfigError, match=r"reward.rescale_anchor='prompt' is not valid; choose from: batch, group"):
        compose([*TASK, "reward.rescale=mode_anchor", "reward.rescale_threshold=0.99", "reward.rescale_anchor=prompt"])


def test_the_exact_metrics_carry_the_initial_gap(compose, tmp_path: Path) -> None:
    """exact/gap_initial is π_ref's gap J* − E_π_ref[R] (the policy starts as π_ref), the same at every step; the
    report's `diverged` compares the last gap with it."""
    from rlhf_lab.tools.report_exact import exact_job_metrics

    cfg = compose([*TASK, f"trainer.output_dir={tmp_path}", "trainer.eval_prompts=0"])
    Trainer(cfg, tmp_path).train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "exact/gap" in line]
    starts = {line["exact/gap_initial"] for line in train}
    assert len(starts) == 1 and starts.pop() > 0
    assert exact_job_metrics(train)["diverged"] == float(train[-1]["exact/gap"] > train[-1]["exact/gap_initial"])
    assert exact_job_metrics([{**train[-1], "exact/gap": train[-1]["exact/gap_initial"] + 1}])["diverged"] == 1.0
    assert exact_job_metrics([{**train[-1], "exact/gap": train[-1]["exact/gap_initial"] - 1e-3}])["diverged"] == 0.0
    old = {key: value for key, value in train[-1].items() if key != "exact/gap_initial"}
    assert exact_job_metrics([old])["diverged"] != exact_job_metrics([old])["diverged"]  # NaN: no start logged


def test_the_initial_gap_is_the_references_gap() -> None:
    """exact_metrics of π = π_ref: its gap is exact/gap_initial, whatever the current policy is."""
    from rlhf_lab.testbed.metrics import exact_metrics

    generator = torch.Generator().manual_seed(0)
    ref = torch.log_softmax(torch.randn(9, 3, generator=generator, dtype=torch.float64), 0) / 2  # [N, T]
    policy = torch.log_softmax(torch.randn(9, 3, generator=generator, dtype=torch.float64), 0) / 2
    rewards = torch.rand(9, generator=generator, dtype=torch.float64)
    at_ref = exact_metrics(ref, ref, rewards, 0.3)
    assert at_ref["exact/gap_initial"] == pytest.approx(at_ref["exact/gap"], abs=1e-12)
    assert exact_metrics(policy, ref, rewards, 0.3)["exact/gap_initial"] == pytest.approx(at_ref["exact/gap"],
                                                                                          abs=1e-12)
