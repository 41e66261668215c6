"""`pairwise`: a response scored by how it compares with the other samples of its prompt's group.

In the spirit of a preference-comparison environment: instead of an absolute score, each response plays a round
robin against the other responses to the same prompt, and its reward is its mean probability of winning,

    score_i = 1/(G−1) · Σ_{j ≠ i} P(response_i ≻ response_j | prompt),

judged either by a function (``reward.judge: "module:function"``, ``judge(prompt, a, b) -> P(a ≻ b)`` in [0, 1]) or by
any other reward (``reward.base: {name: ..., its fields}``), through the Bradley–Terry model
P(a ≻ b) = σ((r_a − r_b) / ``reward.temperature``). Scores lie in [0, 1]; a group's scores sum to G/2 for a
judge that is consistent (P(a ≻ b) + P(b ≻ a) = 1). The group is the run of consecutive samples of the same prompt
(how the trainer lays out a batch); a sample alone scores 0.5. ``components`` logs the base reward's own mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlhf_lab.errors import RewardError
from rlhf_lab.registry import get, register
from rlhf_lab.rewards.base import ConfigLike, Reward, RewardOutput, build_reward, check_config_fields, to_plain
from rlhf_lab.rewards.python_function import load_function


@register("reward", "pairwise")
class PairwiseReward(Reward):
    """Mean win probability against the rest of the group (see the module's text). Config fields: ``judge`` or
    ``base`` (exactly one), ``temperature`` (Bradley–Terry scale of ``base``, default 1)."""

    name = "pairwise"
    config_fields = ("judge", "base", "temperature")
    reads_columns = True  # handed on to the base reward

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        judge, base = self.option("judge"), self.option("base")
        if (judge is None) == (base is None):
            raise RewardError("reward=pairwise needs exactly one of reward.judge (module:function) or reward.base "
                              "(a reward config, e.g. {name: sentiment})")
        self.temperature = float(self.option("temperature", 1.0))
        if self.temperature <= 0:
            raise RewardError(f"reward.temperature={self.temperature} must be > 0")
        self.judge = load_function(judge) if judge is not None else None
        self.spec = judge
        self.base: Reward | None = None
        if base is not None:
            base = to_plain(base)
            if not isinstance(base, Mapping) or "name" not in base:
                raise RewardError(f"reward.base must be a reward config with a 'name'; got {base!r}")
            check_config_fields(base, get("reward", base["name"]).config_fields, f"reward.base ({base['name']!r})")
            self.base = build_reward(dict(base), device=self.device)

    def score(self, prompts: list[str], responses: list[str], **columns: Any) -> RewardOutput:
        components = {}
        if self.base is not None:
            base = self.base(prompts, responses).scores.double()
            components["base"] = base.float()
        scores = torch.full((len(responses),), 0.5, dtype=torch.float64)
        for group in _groups(prompts):
            if len(group) < 2:
                continue
            if self.base is not None:
                values = base[group]
                wins = torch.sigmoid((values[:, None] - values[None, :]) / self.temperature)
            else:
                wins = torch.tensor([[self._judged(prompts[i], responses[i], responses[j]) if i != j else 0.0
                                      for j in group] for i in group], dtype=torch.float64)
            wins.fill_diagonal_(0.0)
            scores[group] = wins.sum(1) / (len(group) - 1)
        return RewardOutput(scores=scores.float(), components=components)

    def _judged(self, prompt: str, first: str, second: str) -> float:
        value = float(self.judge(prompt, first, second))
        if not 0.0 <= value <= 1.0:
            raise RewardError(f"reward judge {self.spec!r} returned {value}; expected a probability in [0, 1]")
        return value


def _groups(prompts: list[str]) -> list[list[int]]:
    """Runs of consecutive samples of the same prompt: the trainer's prompt groups."""
    groups: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups
