"""`exact_table`: the exact task's reward, a seeded table over all V^T responses (rlhf_lab/testbed/)."""

from __future__ import annotations

import torch

from rlhf_lab.registry import register
from rlhf_lab.rewards.base import ConfigLike, Reward, RewardOutput
from rlhf_lab.testbed.task import parse_response, reward_table, table_index


@register("reward", "exact_table")
class ExactTableReward(Reward):
    """R(y) looked up in :func:`rlhf_lab.testbed.task.reward_table`: ``noise``·u(y), u ~ U[0, 1) for every
    response, plus peak_reward·(1 − k/peaks) for the k-th of ``peaks`` seeded high-reward responses; with
    ``modes`` = M ≥ 2 the first M score exactly peak_reward (equally rewarded optimal modes).

    Config fields: symbols (V), length (T), seed, peaks, peak_reward, noise, modes, stop (the last symbol ends a
    response: 1 to T symbols, scored as its canonical row). A response that is not T of the V symbols (with stop: 1
    to T) is an error (the task's model cannot produce one).
    """

    name = "exact_table"
    config_fields = ("symbols", "length", "seed", "peaks", "peak_reward", "noise", "modes", "stop")

    def __init__(self, cfg: ConfigLike, device: str | torch.device = "cpu") -> None:
        super().__init__(cfg, device)
        self.symbols = int(self.option("symbols", 4))
        self.length = int(self.option("length", 4))
        self.stop = bool(self.option("stop", False))
        self.table = reward_table(self.symbols, self.length, int(self.option("seed", 0)),
                                  int(self.option("peaks", 3)), float(self.option("peak_reward", 1.0)),
                                  float(self.option("noise", 0.3)), int(self.option("modes", 0)), self.stop)

    def score(self, prompts: list[str], responses: list[str]) -> RewardOutput:
        indices = torch.tensor([parse_response(text, self.symbols, self.length, self.stop) for text in responses],
                               dtype=torch.long).reshape(len(responses), self.length)
        return RewardOutput(scores=self.table[table_index(indices, self.symbols)].float())
