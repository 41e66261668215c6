"""What a step says is so: groups with no reward spread, response lengths and clipping, the exact KL's floor at
step 0, the launch line's measured time and the resume command that works in the user's shell."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlhf_lab.app import cli
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.step.step_metrics import clipped_responses, group_metrics, length_metrics, zero_spread_warning
from rlhf_lab.training.loop import Trainer

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def test_groups_without_reward_spread_are_counted_over_valid_samples() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 9.0, 4.0, 4.0])
    valid = torch.tensor([True, True, True, True, True, False, True, True])
    # groups of 2: (1,1) flat; (0,2) spread; (3, dropped) one valid sample: flat; (4,4) flat
    assert group_metrics(scores, valid, 2) == {"rollout/frac_reward_zero_std": 0.75}
    # groups of 4: (1,1,0,2) spread; (3,4,4) spread
    assert group_metrics(scores, valid, 4) == {"rollout/frac_reward_zero_std": 0.0}
    assert group_metrics(scores, valid, 1) == {}  # no groups, no statistic
    assert zero_spread_warning({"rollout/frac_reward_zero_std": 0.75}, 3, False) is None
    line = zero_spread_warning({"rollout/frac_reward_zero_std": 1.0}, 3, False)
    assert line.startswith("step 3: every prompt group's rewards are equal") and "\n" not in line
    assert zero_spread_warning({"rollout/frac_reward_zero_std": 1.0}, 4, True) is None  # once per run


def test_lengths_and_clipping_by_hand() -> None:
    eos = 2
    response_ids = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [5, 6, 7, 0], [2, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    rollout = Rollout(input_ids=torch.cat([response_ids[:, :1], response_ids], 1), attention_mask=mask,
                      response_mask=mask.float(), prompt_width=1, group_size=1, logprobs=mask.float(),
                      entropy=mask.float())
    # row 0 ended by EOS; row 1 reached 4 tokens without EOS: clipped; row 2 stopped short (a stop string); row 3 EOS
    clipped = clipped_responses(rollout, mask, 4, eos)
    assert clipped.tolist() == [False, True, False, False]
    assert length_metrics(mask, clipped) == {"response/length_min": 1, "response/length_max": 4,
                                             "response/clipped_frac": 0.25}
    rollout = replace(rollout, truncated=torch.tensor([True, False, False, True]))  # the environment's own cut
    assert clipped_responses(rollout, mask, 4, eos).tolist() == [True, False, False, True]


def test_a_run_logs_the_signals_and_warns_once_when_no_group_has_spread(compose, tiny_overrides, tmp_path, capsys,
                                                                        monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(PROJECT_ROOT))  # tests.reward_fns
    cfg = compose([*tiny_overrides(tmp_path), "trainer.steps=3", "reward=python",
                   "reward.function=tests.reward_fns:constant"])
    Trainer(cfg, tmp_path / "run").train()
    printed = capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    assert len(steps) == 3
    for line in steps:
        assert line["rollout/frac_reward_zero_std"] == 1.0
        assert 1 <= line["response/length_min"] <= line["response/length_mean"] <= line["response/length_max"] <= 4
        assert 0.0 <= line["response/clipped_frac"] <= 1.0
    assert printed.count("every prompt group's rewards are equal") == 1
    # The floor: step 0's exact KL, the policy being the reference; logged once, printed once.
    assert steps[0]["kl/exact_floor"] == steps[0]["kl/exact"] and 0.0 <= steps[0]["kl/exact_floor"] < 1e-5  # fp32
    assert all("kl/exact_floor" not in line for line in steps[1:])
    assert printed.count("kl/exact_floor:") == 1 and "trainer.precision=fp32" in printed


def test_the_launch_line_says_what_its_time_was_measured_for(capsys) -> None:
    cfg = {"experiment_name": "kl_ablation", "experiment_time": "about 1 h on 2 CPU cores: 36 jobs"}
    cli.say_experiment_time(cfg, ["experiment=kl_ablation", "hydra/launcher=joblib_local"])
    assert capsys.readouterr().err == "experiment=kl_ablation: about 1 h on 2 CPU cores: 36 jobs\n"
    cli.say_experiment_time(cfg, ["experiment=kl_ablation", "seed=0", "model=tiny"])
    assert capsys.readouterr().err == (
        "experiment=kl_ablation: about 1 h on 2 CPU cores: 36 jobs, measured for the experiment as written; this "
        "launch changes seed=0 model=tiny, so its time differs\n")


@pytest.mark.parametrize("on_path", [True, False])
def test_the_resume_command_works_in_the_users_shell(tmp_path, monkeypatch, on_path) -> None:
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    program = venv / "rlhf-lab"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(venv) if on_path else "/nonexistent")
    monkeypatch.setattr(sys, "argv", [".venv/bin/rlhf-lab", "seed=1"])
    line = cli.resume_command(["seed=1"], ("trainer.resume=auto",))
    assert line == ("rlhf-lab" if on_path else ".venv/bin/rlhf-lab") + " seed=1 trainer.resume=auto"
    monkeypatch.setattr(sys, "argv", ["-m"])  # python -m rlhf_lab
    line = cli.resume_command(["seed=1"], ("trainer.resume=auto",))
    assert line == f"{sys.executable} -m rlhf_lab seed=1 trainer.resume=auto"  # no `python` on this PATH
