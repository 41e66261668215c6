"""Verifiable rewards: an answer checked against the data's ground truth.

- ``math_verify``: the ``math-verify`` package parses the data's answer (``reward.answer_column``) and the
  response's final answer (LaTeX, ``\\boxed{}``, plain numbers and expressions) to sympy and compares them: 1 when
  they are equal, else 0;
- ``reasoning_gym``: the answer in ``<answer>...</answer>`` (``reward.tag``), scored by the reasoning-gym task's
  own verifier against the row of ``data=reasoning_gym`` (its ``question``, ``answer`` and ``metadata`` columns).

Both read the data's columns (:mod:`rlhf_lab.data.rows`); a prompt set without them is a one-line error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlhf_lab.data.rows import columns_of, origin_of
from rlhf_lab.errors import RewardError
from rlhf_lab.registry import register
from rlhf_lab.rewards.base import Reward, RewardOutput


def column(columns: dict[str, list[Any]], name: str, reward: str) -> list[Any]:
    if name not in columns:
        have = ", ".join(sorted(columns)) or "none (plain text prompts)"
        raise RewardError(f"reward={reward} reads the data column {name!r}; the prompts' columns: {have}")
    return columns[name]


@register("reward", "math_verify")
class MathVerifyReward(Reward):
    """1 where math-verify finds the response's answer equal to the data's ``answer_column``, else 0."""

    name = "math_verify"
    config_fields = ("answer_column",)
    reads_columns = True

    def __init__(self, cfg: Any, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        import math_verify  # a dependency; imported where a run uses it

        self.math_verify = math_verify

    def _gold(self, prompt: str, answer: Any) -> list[Any]:
        """The data's answer parsed; a row without one, or with one math-verify cannot read, is one line naming it."""
        name = self.option("answer_column", "answer")
        if answer is None or (isinstance(answer, float) and answer != answer):  # null / NaN, never the text "None"
            raise RewardError(f"reward=math_verify: the data's {name!r} is empty (null) at {origin_of(prompt)}; "
                              "give every row an answer")
        text = str(answer)
        parsed = self.math_verify.parse(text)
        parsed = parsed or self.math_verify.parse(f"${text}$")  # bare LaTeX ("\\frac12") is read inside math mode
        if not parsed:
            raise RewardError(f"reward=math_verify cannot read the data's {name!r} {text[:40]!r} at "
                              f"{origin_of(prompt)}; give it an answer math-verify parses (a number, an expression, "
                              "LaTeX)")
        return parsed

    def check_prompts(self, prompts: Sequence[str]) -> None:
        answers = column(columns_of(list(prompts)), self.option("answer_column", "answer"), self.name) if prompts else []
        for prompt, answer in zip(prompts, answers, strict=True):
            self._gold(prompt, answer)

    def score(self, prompts: list[str], responses: list[str], **columns: Any) -> RewardOutput:
        answers = column(columns, self.option("answer_column", "answer"), self.name)
        scores = [float(self.math_verify.verify(self._gold(prompt, answer), self.math_verify.parse(response)))
                  for prompt, answer, response in zip(prompts, answers, responses, strict=True)]
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32))


@register("reward", "reasoning_gym")
class ReasoningGymReward(Reward):
    """The reasoning-gym task's own score of the answer in ``<tag>...</tag>`` (0 where there is none)."""

    name = "reasoning_gym"
    config_fields = ("tag",)
    reads_columns = True

    def __init__(self, cfg: Any, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        from rlhf_lab.data.reasoning_gym import reasoning_gym_module

        self.gym = reasoning_gym_module()

    def score(self, prompts: list[str], responses: list[str], **columns: Any) -> RewardOutput:
        rows = zip(column(columns, "question", self.name), column(columns, "answer", self.name),
                   column(columns, "metadata", self.name), responses, strict=True)
        scores = []
        for question, answer, metadata, response in rows:
            verify = self.gym.get_score_answer_fn(metadata["source_dataset"])
            given = self.gym.utils.extract_answer(response, tag_name=self.option("tag", "answer"))
            entry = {"question": question, "answer": answer, "metadata": metadata}
            scores.append(float(verify(answer=given, entry=entry)) if given is not None else 0.0)
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32))
