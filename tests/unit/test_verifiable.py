"""Rewards that read the data's columns: math-verify against an answer column, reasoning-gym's verifiers on its
generated tasks, and user functions that name the columns they want (as TRL passes dataset columns)."""

from __future__ import annotations

import sys
import types

import pytest

import rlhf_lab.components  # noqa: F401  (the built-in rewards)
from rlhf_lab.data.rows import make_prompt
from rlhf_lab.errors import RewardError
from rlhf_lab.registry import get


def rows(*answers: str):
    return [make_prompt(f"question {i}", {"answer": answer, "source": "test"}) for i, answer in enumerate(answers)]


def test_math_verify_compares_the_final_answer_with_the_answer_column() -> None:
    reward = get("reward", "math_verify")({"name": "math_verify"})
    prompts = rows("4", "\\frac{1}{2}", "12", "x^2")
    responses = ["So 2+2 = 4.", "The result is $\\boxed{0.5}$", "It is 13.", "$x \\cdot x$"]
    assert reward(prompts, responses).scores.tolist() == [1.0, 1.0, 0.0, 1.0]
    other = get("reward", "math_verify")({"name": "math_verify", "answer_column": "solution"})
    with pytest.raises(RewardError, match=r"^reward=math_verify reads the data column 'solution'; the prompts' "
                                          r"columns: answer, source$"):
        other(prompts, responses)
    with pytest.raises(RewardError, match="columns: none \\(plain text prompts\\)"):
        reward(["plain"], ["4"])


def test_a_python_reward_gets_the_columns_it_names(monkeypatch) -> None:
    module = types.ModuleType("column_rewards")
    module.exact = lambda prompts, responses, answer: [float(r == a) for r, a in zip(responses, answer)]
    module.everything = lambda prompts, responses, **columns: [float(len(columns))] * len(responses)
    module.plain = lambda prompts, responses: [1.0] * len(responses)
    monkeypatch.setitem(sys.modules, "column_rewards", module)
    build = lambda name: get("reward", "python")({"name": "python", "function": f"column_rewards:{name}"})  # noqa: E731
    prompts = rows("4", "6")
    assert build("exact")(prompts, ["4", "5"]).scores.tolist() == [1.0, 0.0]
    assert build("everything")(prompts, ["4", "5"]).scores.tolist() == [2.0, 2.0]  # answer and source
    assert build("plain")(prompts, ["4", "5"]).scores.tolist() == [1.0, 1.0]


@pytest.mark.extra("reasoning")
def test_reasoning_gym_tasks_are_generated_from_their_seed_and_scored_by_their_verifier() -> None:
    from omegaconf import OmegaConf

    from rlhf_lab.data.prompts import load_prompts
    from rlhf_lab.errors import DataError

    cfg = OmegaConf.create({"name": "reasoning_gym", "task": "basic_arithmetic", "size": 6, "eval_size": 3,
                            "task_seed": 4, "system_prompt": True})
    splits, again = load_prompts(cfg), load_prompts(cfg)
    assert splits.train == again.train and len(splits.train) == 6 and len(splits.eval) == 3
    assert load_prompts(OmegaConf.merge(cfg, {"task_seed": 5})).train != splits.train
    first = splits.train[0]
    assert [m["role"] for m in first.messages] == ["system", "user"] and "<answer>" in first.messages[0]["content"]
    assert set(first.columns) == {"question", "answer", "metadata"}
    reward = get("reward", "reasoning_gym")({"name": "reasoning_gym"})
    right = [f"Thinking... <answer>{p.columns['answer']}</answer>" for p in splits.train]
    assert reward(splits.train, right).scores.tolist() == [1.0] * 6
    assert reward(splits.train[:2], ["<answer>not a number</answer>", "no tags"]).scores.tolist() == [0.0, 0.0]
    with pytest.raises(DataError, match=r"^data.task='nosuch' is not a reasoning-gym task; tasks: .*basic_arithmetic"):
        load_prompts(OmegaConf.merge(cfg, {"task": "nosuch"}))


def test_pairwise_scores_each_response_by_its_round_robin_in_its_group() -> None:
    import math

    judged = get("reward", "pairwise")({"name": "pairwise", "judge": "tests.reward_fns:longer_wins"})
    prompts = ["p", "p", "p", "q", "q", "r"]
    responses = ["a", "bb", "ccc", "dd", "dd", "alone"]
    assert judged(prompts, responses).scores.tolist() == [0.0, 0.5, 1.0, 0.5, 0.5, 0.5]
    by_reward = get("reward", "pairwise")({"name": "pairwise", "temperature": 2.0, "base": {
        "name": "python", "function": "tests.reward_fns:count_letter"}})
    output = by_reward(["p", "p", "p"], ["x", "a", "aaa"])  # base scores 0, 1, 3
    sigma = lambda x: 1 / (1 + math.exp(-x / 2.0))  # noqa: E731
    expected = [(sigma(-1) + sigma(-3)) / 2, (sigma(1) + sigma(-2)) / 2, (sigma(3) + sigma(2)) / 2]
    assert output.scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert sum(output.scores.tolist()) == pytest.approx(1.5) and output.components["base"].tolist() == [0, 1, 3]
    with pytest.raises(RewardError, match="needs exactly one of reward.judge"):
        get("reward", "pairwise")({"name": "pairwise"})
    bad = get("reward", "pairwise")({"name": "pairwise", "judge": "tests.reward_fns:overconfident"})
    with pytest.raises(RewardError, match=r"returned 2.0; expected a probability in \[0, 1\]"):
        bad(["p", "p"], ["a", "b"])
