"""`composite`: a weighted sum of other registered rewards, each component kept for logging."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from rlhf_lab.errors import RewardError
from rlhf_lab.registry import get, register
from rlhf_lab.rewards.base import (
    ConfigLike,
    Reward,
    RewardOutput,
    build_reward,
    check_config_fields,
    to_plain,
)

COMPONENT_FIELDS = ("weight", "key")


@register("reward", "composite")
class CompositeReward(Reward):
    """scores = Σ_i weight_i · component_i(prompts, responses).

    Config fields:
        components: non-empty list of mappings, each ``{name: <registered reward>, weight: float
            (default 1.0), key: <log name, default = name>, ...that reward's own fields}``.

    ``components`` of the output maps each key to its *unweighted* scores (logged as ``reward/<key>``).
    Keys must be unique: use ``key`` to tell two components of the same reward apart. A field that the
    component's reward does not read raises RewardError (a typo would otherwise be silently ignored).
    """

    name = "composite"
    config_fields = ("components",)

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        component_cfgs = self.option("components", [])
        if not component_cfgs:
            raise RewardError("reward 'composite' needs a non-empty list of components (reward.components)")
        self.parts: list[tuple[str, float, Reward]] = []
        for index, component_cfg in enumerate(component_cfgs):
            component_cfg = to_plain(component_cfg)
            if not isinstance(component_cfg, Mapping) or "name" not in component_cfg:
                raise RewardError(
                    f"composite component {index} must be a mapping with a 'name'; got {component_cfg!r}"
                )
            key = str(component_cfg.get("key") or component_cfg["name"])
            if key in [existing for existing, _, _ in self.parts]:
                raise RewardError(
                    f"duplicate composite component key {key!r}; give each component a unique 'key'"
                )
            raw_weight = component_cfg.get("weight", 1.0)
            try:
                weight = float(raw_weight)
            except (TypeError, ValueError):
                weight = math.nan
            if isinstance(raw_weight, bool) or not math.isfinite(weight):
                raise RewardError(f"composite component {key!r}: weight {raw_weight!r} is not a finite number")
            reward_cfg = {k: v for k, v in component_cfg.items() if k not in COMPONENT_FIELDS}
            reward_class = get("reward", reward_cfg["name"])
            check_config_fields(
                reward_cfg,
                reward_class.config_fields,
                f"composite component {key!r} (reward {reward_cfg['name']!r})",
            )
            self.parts.append((key, weight, build_reward(reward_cfg, device=self.device)))

    def check_prompts(self, prompts: Sequence[str]) -> None:
        for _, _, reward in self.parts:
            reward.check_prompts(prompts)

    def score(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        total = torch.zeros(len(responses), dtype=torch.float32)
        components = {}
        for key, weight, reward in self.parts:
            scores = reward(prompts, responses).scores.to("cpu", torch.float32)
            components[key] = scores
            total = total + weight * scores
        return RewardOutput(scores=total, components=components)
