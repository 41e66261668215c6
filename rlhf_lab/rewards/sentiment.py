"""`sentiment`: VADER's compound sentiment score of each response, offline (the lexicon ships with it)."""

from __future__ import annotations

from typing import Any

import torch

from rlhf_lab.errors import RewardError
from rlhf_lab.registry import register
from rlhf_lab.rewards.base import ConfigLike, Reward, RewardOutput

TARGETS = ("positive", "negative")


@register("reward", "sentiment")
class SentimentReward(Reward):
    """VADER compound score of the response text, in [−1, 1] (Hutto & Gilbert, 2014).

    Config fields:
        target: ``positive`` (default) rewards positive text; ``negative`` flips the sign.

    The prompt is not scored. VADER is a rule-based lexicon model: fast, deterministic, CPU only.
    """

    name = "sentiment"
    config_fields = ("target",)

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.target = self.option("target", "positive")
        if self.target not in TARGETS:
            raise RewardError(f"unknown sentiment target {self.target!r}; valid targets: {', '.join(TARGETS)}")
        self.sign = 1.0 if self.target == "positive" else -1.0
        self.analyzer: Any = SentimentIntensityAnalyzer()

    def score(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        compound = [self.analyzer.polarity_scores(response)["compound"] for response in responses]
        return RewardOutput(scores=self.sign * torch.tensor(compound, dtype=torch.float32))
