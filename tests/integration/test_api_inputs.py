"""The Python API takes reward functions and ``datasets.Dataset`` splits beside overrides, as TRL's trainers do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from datasets import Dataset

import rlhf_lab
from rlhf_lab.app import api_inputs
from rlhf_lab.errors import ConfigError

ROWS = [{"prompt": f"Say the number {i}.", "answer": str(i)} for i in range(4)]
SEEN: list[list[str]] = []


def says_the_answer(prompts, responses, answer):
    """1 where the response contains the row's answer (the dataset's column, passed by name)."""
    SEEN.append(list(answer))
    return [float(a in r) for r, a in zip(responses, answer)]


def test_reward_functions_and_datasets_train_and_are_recorded(tiny_overrides, tmp_path: Path) -> None:
    run = tmp_path / "run"
    brevity = lambda prompts, responses: [-len(r) / 100 for r in responses]  # noqa: E731 (not importable by name)
    summary = rlhf_lab.train(tiny_overrides(tmp_path), run_dir=run, reward_funcs=[says_the_answer, brevity],
                             train_dataset=Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS[:2]))
    assert summary["steps"] == 2
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    for line in steps:  # each function's mean apart, their sum the reward
        assert line["reward/mean"] == pytest.approx(line["reward/says_the_answer"] + line["reward/_lambda_"])
    assert SEEN and all(set(answers) <= {"0", "1", "2", "3"} for answers in SEEN)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in samples} <= {row["prompt"] for row in ROWS}
    overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    assert "data=local" in overrides and f"data.path={(run / 'data').resolve()}" in overrides
    assert "reward=composite" in overrides
    components = next(o for o in overrides if o.startswith("reward.components="))
    assert "test_api_inputs:says_the_answer" in components  # importable: by its name
    assert "rlhf_lab.app.api_inputs:functions._lambda_" in components  # a lambda: this process only
    assert (run / "data" / "dataset_dict.json").is_file()


def test_one_function_is_the_python_reward_and_bad_inputs_are_one_line(tmp_path: Path) -> None:
    assert api_inputs.reward_overrides(says_the_answer) == [
        "reward=python", "reward.function=test_api_inputs:says_the_answer"]
    with pytest.raises(ConfigError, match="reward_funcs: 3 is not callable"):
        api_inputs.reward_overrides([3])
    with pytest.raises(ConfigError, match="train_dataset is a list; give a datasets.Dataset"):
        rlhf_lab.train(["model=tiny"], run_dir=tmp_path / "run", train_dataset=ROWS)
    with pytest.raises(ConfigError, match="eval_dataset needs a train_dataset"):
        rlhf_lab.train(["model=tiny"], run_dir=tmp_path / "run", eval_dataset=Dataset.from_list(ROWS))
