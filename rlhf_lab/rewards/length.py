"""`length`: a rule reward for response length (in words) and, optionally, terminal punctuation."""

from __future__ import annotations

import torch

from rlhf_lab.errors import RewardError
from rlhf_lab.registry import register
from rlhf_lab.rewards.base import ConfigLike, Reward, RewardOutput

TERMINAL_PUNCTUATION = (".", "!", "?")
CLOSING_CHARACTERS = "\"')]»”’"


def length_score(word_count: int, min_words: int, max_words: int, slope_words: float) -> float:
    """1 inside [min_words, max_words]; 1 − distance/slope_words outside, floored at −1."""
    distance = max(min_words - word_count, 0, word_count - max_words)
    return max(1.0 - distance / slope_words, -1.0)


def ends_with_terminal_punctuation(text: str) -> bool:
    """True when the text ends with . ! or ? (closing quotes/brackets and whitespace after it allowed)."""
    return text.rstrip().rstrip(CLOSING_CHARACTERS).endswith(TERMINAL_PUNCTUATION)


@register("reward", "length")
class LengthReward(Reward):
    """Length and format rule: score = length term + format term.

    Length term, with n = number of whitespace-separated words in the response:
    1.0 for n in [min_words, max_words]; otherwise 1 − d / slope_words where d is the distance in words
    to the nearest bound, floored at −1.

    Format term (only when ``require_terminal_punctuation``): +format_weight when the response ends
    with . ! or ? (closing quotes/brackets after it allowed), −format_weight otherwise.

    Config fields:
        min_words: lower bound (default 10).  max_words: upper bound (default 60).
        slope_words: words outside the bounds per unit of reward lost (default 20).
        require_terminal_punctuation: add the format term (default False).
        format_weight: size of the format bonus/penalty (default 0.5).
    """

    name = "length"
    config_fields = ("min_words", "max_words", "slope_words", "require_terminal_punctuation", "format_weight")

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        self.min_words = int(self.option("min_words", 10))
        self.max_words = int(self.option("max_words", 60))
        self.slope_words = float(self.option("slope_words", 20))
        self.require_terminal_punctuation = bool(self.option("require_terminal_punctuation", False))
        self.format_weight = float(self.option("format_weight", 0.5))
        if not 0 <= self.min_words <= self.max_words:
            raise RewardError(
                f"length reward needs 0 <= min_words <= max_words; got {self.min_words}, {self.max_words}"
            )
        if not self.slope_words > 0:
            raise RewardError(f"length reward needs slope_words > 0; got {self.slope_words}")

    def score(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        scores = []
        for response in responses:
            value = length_score(len(response.split()), self.min_words, self.max_words, self.slope_words)
            if self.require_terminal_punctuation:
                sign = 1.0 if ends_with_terminal_punctuation(response) else -1.0
                value += sign * self.format_weight
            scores.append(value)
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32))
