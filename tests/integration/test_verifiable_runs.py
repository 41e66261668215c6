"""Verifiable-reward runs on the tiny model: a conversational prompt set with an answer column scored by
math-verify, and a reasoning-gym task scored by its own verifier (the prompts' system message reaches the model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_lab.training.loop import Trainer


def train(compose, overrides: list[str], folder: Path) -> list[dict]:
    Trainer(compose([*overrides, f"trainer.output_dir={folder}"]), folder).train()
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_conversational_prompts_with_an_answer_column_train_under_math_verify(compose, tiny_overrides,
                                                                               tmp_path: Path) -> None:
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "system", "content": "Answer with a number."},
                                                   {"role": "user", "content": f"What is {a} + {b}?"}],
                                        "answer": str(a + b)}) + "\n" for a in range(3) for b in range(3)))
    lines = train(compose, [*tiny_overrides(tmp_path), "data=jsonl", f"data.path={data}", "data.eval_fraction=0.25",
                            "reward=math_verify"], tmp_path / "run")
    assert [line["step"] for line in lines if "reward/mean" in line] == [0, 1]
    assert all(0.0 <= line["reward/mean"] <= 1.0 for line in lines if "reward/mean" in line)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["prompt"].startswith("system: Answer with a number.\nuser: What is ")


@pytest.mark.extra("reasoning")
def test_a_reasoning_gym_task_trains_with_its_verifier(compose, tiny_overrides, tmp_path: Path) -> None:
    lines = train(compose, [*tiny_overrides(tmp_path), "data=reasoning_gym", "data.size=8", "data.eval_size=2",
                            "reward=reasoning_gym"], tmp_path / "run")
    assert [line["step"] for line in lines if "reward/mean" in line] == [0, 1]
    assert any("eval/reward/mean" in line for line in lines)


def test_pairwise_comparison_trains_on_group_win_rates(compose, tiny_overrides, tmp_path: Path) -> None:
    lines = train(compose, [*tiny_overrides(tmp_path), "reward=pairwise", "algorithm.group_size=3"], tmp_path / "run")
    steps = [line for line in lines if "reward/mean" in line]
    # a consistent comparison: every group's win rates sum to G/2, so the mean is 1/2
    assert [line["step"] for line in steps] == [0, 1]
    assert all(line["reward/mean"] == pytest.approx(0.5, abs=1e-6) and "reward/base" in line for line in steps)
