"""``reward=route``: each row scored by the reward its data column names, each reward's mean logged apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rlhf_lab.components  # noqa: F401  (registers the built-in rewards)
from rlhf_lab.data.rows import Prompt
from rlhf_lab.errors import RewardError
from rlhf_lab.rewards.base import build_reward


def three(prompts, responses):
    return [3.0] * len(responses)


def length(prompts, responses):
    return [float(len(r)) for r in responses]


ROUTES = {"math": {"name": "python", "function": "test_reward_route:three"},
          "code": {"name": "python", "function": "test_reward_route:length"}}


def rows(*sources: str) -> list[Prompt]:
    return [Prompt(f"q{i}", columns={"data_source": source}) for i, source in enumerate(sources)]


def test_each_row_gets_the_reward_its_column_names() -> None:
    reward = build_reward({"name": "route", "by": "data_source", "rewards": ROUTES})
    out = reward(rows("math", "code", "code", "math"), ["a", "bb", "cccc", "d"])
    assert out.scores.tolist() == [3.0, 2.0, 4.0, 3.0]
    assert out.components["math"].tolist()[::3] == [3.0, 3.0] and out.components["math"][1:3].isnan().all()
    assert torch.nanmean(out.components["code"]).item() == 3.0  # the code rows' mean: (2 + 4) / 2


def test_unrouted_values_use_the_default_or_are_one_line() -> None:
    reward = build_reward({"name": "route", "rewards": ROUTES})
    with pytest.raises(RewardError, match=r"data_source='chat' of prompt 1 has no reward; routed: math, code"):
        reward(rows("math", "chat"), ["a", "b"])
    with pytest.raises(RewardError, match=r"prompt 0 has no 'data_source' column \(reward.by\); its columns: none"):
        reward([Prompt("q")], ["a"])
    fallback = build_reward({"name": "route", "rewards": ROUTES, "default": {"name": "python",
                                                                              "function": "test_reward_route:three"}})
    assert fallback(rows("chat", "code"), ["a", "bb"]).scores.tolist() == [3.0, 2.0]
    with pytest.raises(RewardError, match=r"reward 'route' needs reward.rewards"):
        build_reward({"name": "route", "rewards": {}})


def test_a_run_logs_each_routed_rewards_mean(compose, tiny_overrides, tmp_path: Path) -> None:
    from rlhf_lab.training.loop import Trainer

    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Task {i}.", "data_source": source}) + "\n"
                            for i, source in enumerate(["math", "code"] * 4)))
    routes = ("{math: {name: python, function: 'test_reward_route:three'}, "
              "code: {name: python, function: 'test_reward_route:length'}}")
    cfg = compose([*tiny_overrides(tmp_path), "data=local", f"data.path={data}", "reward=route",
                   "reward.by=data_source", f"reward.rewards={routes}", "trainer.prompts_per_step=4"])
    Trainer(cfg, tmp_path / "run").train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    assert steps and all(line["reward/math"] == 3.0 and line["reward/code"] >= 0.0 for line in steps)


def test_the_check_before_the_model_asks_each_route_s_reward_about_its_own_rows() -> None:
    """``check_prompts`` (run before any model loads): a math row whose answer math-verify cannot read is named by
    its row and prompt; a code row with no answer is no concern of the math reward; an unrouted value is one line;
    a composite reward asks each of its parts."""
    routes = {"math": {"name": "math_verify"}, "code": {"name": "python", "function": "test_reward_route:length"}}
    reward = build_reward({"name": "route", "rewards": routes})
    good = [Prompt("1 + 1?", columns={"data_source": "math", "answer": "2"}, origin="row 0 of m.jsonl"),
            Prompt("print 1", columns={"data_source": "code"}, origin="row 1 of m.jsonl")]
    reward.check_prompts(good)
    bad = [*good, Prompt("2 + 2?", columns={"data_source": "math", "answer": ""}, origin="row 2 of m.jsonl")]
    with pytest.raises(RewardError, match=r"^reward=math_verify cannot read the data's 'answer' '' at row 2 "
                                          r"of m.jsonl, prompt '2 \+ 2\?'; give it an answer"):
        reward.check_prompts(bad)
    with pytest.raises(RewardError, match=r"data_source='chat' of prompt 2 has no reward"):
        reward.check_prompts([*good, Prompt("hi", columns={"data_source": "chat"})])
    composite = build_reward({"name": "composite", "components": [{"name": "math_verify"}, {"name": "length"}]})
    with pytest.raises(RewardError, match=r"the data's 'answer' is empty \(null\) at prompt 'x'"):
        composite.check_prompts([Prompt("x", columns={"answer": None})])
