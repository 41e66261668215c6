"""`route`: each row scored by the reward a data column names (verl's ``data_source``), each reward's mean apart."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlhf_lab.errors import RewardError
from rlhf_lab.registry import get, register
from rlhf_lab.rewards.base import ConfigLike, Reward, RewardOutput, build_reward, check_config_fields, to_plain


@register("reward", "route")
class RouteReward(Reward):
    """score_i = rewards[row_i[by]](prompt_i, response_i): one data set mixing tasks (math rows, code rows, chat
    rows), each row scored by its own reward, as verl routes by ``data_source``.

    Config fields:
        by: the data column whose value names the reward (default ``data_source``);
        rewards: mapping of a column value to a reward config (``{name: <registered reward>, ...its fields}``);
        default: the reward config of rows whose value is not in ``rewards`` (null: such a row is a RewardError
            naming the value and the routed ones).

    ``components`` maps each routed value to its reward's scores on its own rows and NaN elsewhere, so
    ``reward/<value>`` is that reward's mean over the rows it scored (a step with none of its rows logs nothing).
    """

    name = "route"
    config_fields = ("by", "rewards", "default")

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        self.by = str(self.option("by", "data_source"))
        routes = self.option("rewards", {})
        if not isinstance(routes, Mapping) or not routes:
            raise RewardError(f"reward 'route' needs reward.rewards: a mapping from each value of the {self.by!r} "
                              "column to a reward config, e.g. {math: {name: math_verify}, chat: {name: sentiment}}")
        self.routes = {str(value): self._build(str(value), config) for value, config in routes.items()}
        default = self.option("default")
        self.default = self._build("default", default) if default is not None else None

    def _build(self, key: str, config: Any) -> Reward:
        config = to_plain(config)
        if not isinstance(config, Mapping) or "name" not in config:
            raise RewardError(f"reward.rewards.{key} must be a reward config with a 'name'; got {config!r}")
        check_config_fields(config, get("reward", config["name"]).config_fields, f"route {key!r} (reward "
                                                                                 f"{config['name']!r})")
        return build_reward(dict(config), device=self.device)

    def check_prompts(self, prompts: Sequence[str]) -> None:
        """Every row routed (a value with no reward and no default is one line now), each checked by its reward."""
        values = self._routed(list(prompts))
        for key, reward in [*self.routes.items(), *([("default", self.default)] if self.default else [])]:
            reward.check_prompts([prompt for prompt, value in zip(prompts, values) if value == key])

    def score(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        values = self._routed(prompts)
        scores = torch.zeros(len(responses), dtype=torch.float32)
        components = {}
        for key, reward in [*self.routes.items(), *([("default", self.default)] if self.default else [])]:
            rows = [i for i, value in enumerate(values) if value == key]
            part = torch.full((len(responses),), float("nan"))
            if rows:
                routed = reward([prompts[i] for i in rows], [responses[i] for i in rows]).scores.to("cpu", torch.float32)
                scores[rows] = routed
                part[rows] = routed
            components[key] = part
        return RewardOutput(scores=scores, components=components)

    def _routed(self, prompts: list[str]) -> list[str]:
        """Each prompt's route: its ``by`` column's value, or ``default``; a row with neither is one line."""
        values = []
        for index, prompt in enumerate(prompts):
            columns = getattr(prompt, "columns", {})
            if self.by not in columns:
                raise RewardError(f"reward 'route': prompt {index} has no {self.by!r} column (reward.by); its columns: "
                                  f"{', '.join(sorted(columns)) or 'none'}", sample=index)
            value = str(columns[self.by])
            if value not in self.routes and self.default is None:
                raise RewardError(f"reward 'route': {self.by}={value!r} of prompt {index} has no reward; routed: "
                                  f"{', '.join(self.routes)} (add it to reward.rewards or set reward.default)",
                                  sample=index)
            values.append(value if value in self.routes else "default")
        return values
