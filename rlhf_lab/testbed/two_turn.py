"""The exact multi-turn testbed: the exact task with two model turns and an environment message between them.

A trajectory is ``<bos> y1 e(y1) y2``: two model turns of L = ``trainer.max_new_tokens`` symbols each and between
them E = ``env.env_tokens`` symbols the environment writes, a deterministic function of the first turn
(e_k = (Σ y1 + k) mod V). The reward R(y1, y2) is a seeded table over all V^(2L) pairs of turns
(:func:`~rlhf_lab.testbed.task.reward_table`), given at the second turn. Since e is fixed by y1, the policy's
trajectory probability is π(y1)·π(y2 | y1, e(y1)), a product over model tokens only, and all V^(2L) trajectories
can be enumerated: π* ∝ π_ref·exp(R/β) and J* = β·log Z are exact (:mod:`rlhf_lab.testbed.metrics`), as on the
one-turn task. A run that trains only on model tokens closes the gap; one that puts the environment's tokens in
the loss (``env.loss_on_env_tokens=true``) optimises something else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlhf_lab.envs.base import Environment, EnvState, Message, StepResult
from rlhf_lab.registry import register
from rlhf_lab.testbed.task import PROMPT, all_responses, parse_response, reward_table, symbols, table_index


def env_symbols(first_turn: Tensor, symbol_count: int, count: int) -> Tensor:
    """The environment's message after a first turn: e_k = (Σ y1 + k) mod V, [..., L] -> [..., E]."""
    offsets = torch.arange(count, device=first_turn.device)
    return (first_turn.sum(-1, keepdim=True) + offsets) % symbol_count


@register("env", "exact_two_turn")
class ExactTwoTurn(Environment):
    """See the module's text. Config fields: symbols (V), turn_length (L), env_tokens (E), and the reward table's
    seed, peaks, peak_reward, noise."""

    name = "exact_two_turn"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.symbol_count = int(self.option("symbols", 4))
        self.length = int(self.option("turn_length", 2))
        self.env_tokens = int(self.option("env_tokens", 1))
        self.table = reward_table(self.symbol_count, 2 * self.length, int(self.option("seed", 0)),
                                  int(self.option("peaks", 3)), float(self.option("peak_reward", 1.0)),
                                  float(self.option("noise", 0.3)))

    def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        return [{"role": "user", "content": PROMPT}]

    def step(self, assistant_message: str, state: EnvState) -> StepResult:
        turn = parse_response(assistant_message, self.symbol_count, self.length)
        if state.turn == 1:
            state.data["first"] = turn
            names = symbols(self.symbol_count)
            message = env_symbols(torch.tensor(turn), self.symbol_count, self.env_tokens)
            return StepResult([{"role": "user", "content": " ".join(names[i] for i in message.tolist())}], 0.0, False)
        both = torch.tensor(state.data["first"] + turn)
        return StepResult(None, float(self.table[table_index(both, self.symbol_count)]), True)

    def enumerate(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every trajectory: (its symbols after the prompt [N, 2L + E], the positions of the model's tokens among
        them [2L], the reward of each [N] float64), N = V^(2L) in reward-table order."""
        turns = all_responses(self.symbol_count, 2 * self.length)
        first, second = turns[:, : self.length], turns[:, self.length :]
        sequences = torch.cat([first, env_symbols(first, self.symbol_count, self.env_tokens), second], dim=1)
        positions = torch.cat([torch.arange(self.length),
                               torch.arange(self.length + self.env_tokens, 2 * self.length + self.env_tokens)])
        return sequences, positions, self.table
