"""Structured configs of the environment group (``env=NAME``, rlhf_lab/envs/): how a rollout's episodes run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EnvConfig:
    """``env=single_turn`` (the default: one prompt, one response, ``reward=`` scores it) and what every
    multi-turn environment reads (rlhf_lab/envs/episodes.py)."""

    name: str = "single_turn"  # registered kind `env`
    max_turns: int = 1  # model turns per episode
    max_tokens: int = 512  # a trajectory's budget after the prompt: model and environment tokens together
    stop: list[str] = field(default_factory=list)  # per-turn stop strings (empty: generation.stop)
    step_timeout: float = 30.0  # seconds one reset/step call may take
    workers: int = 8  # threads the environment's calls run in
    on_error: str = "error"  # error | drop: an environment that fails stops the run, or its sample leaves the batch
    loss_on_env_tokens: bool = False  # the deliberate wrong mask (environment tokens in the loss): ablation only


@dataclass
class GuessNumberEnvConfig(EnvConfig):
    """``env=guess_number``: the model guesses a seeded secret number; the environment answers higher/lower."""

    name: str = "guess_number"
    max_turns: int = 4
    max_tokens: int = 256
    low: int = 1
    high: int = 16
    turn_discount: float = 0.8  # a correct guess at turn k scores turn_discount^(k-1)


@dataclass
class CalculatorEnvConfig(EnvConfig):
    """``env=calculator``: seeded arithmetic problems with a calculator tool; a correct final answer scores 1."""

    name: str = "calculator"
    max_turns: int = 3
    max_tokens: int = 384
    operands: int = 3  # numbers per problem
    max_operand: int = 99
    operators: str = "+-*"  # drawn from


@dataclass
class ExactTwoTurnEnvConfig(EnvConfig):
    """``env=exact_two_turn`` (rlhf_lab/testbed/two_turn.py): the exact task with two model turns and a
    deterministic environment message between them; every trajectory is enumerable."""

    name: str = "exact_two_turn"
    max_turns: int = 2
    max_tokens: int = 16
    env_tokens: int = 3  # symbols in the environment's message, each a function of the first turn
    turn_length: int = 2  # symbols per model turn (= trainer.max_new_tokens)
    symbols: int = 4  # V (= model.exact.symbols)
    seed: int = 0  # the reward table over all V^(2·turn_length) pairs of turns
    peaks: int = 3
    peak_reward: float = 1.0
    noise: float = 0.3


@dataclass
class VerifiersEnvConfig(EnvConfig):
    """``env=verifiers`` (rlhf_lab/envs/verifiers_env.py): a ``verifiers`` environment's own rollouts against the
    policy served in-process; its rubric rewards them."""

    name: str = "verifiers"
    id: str | None = None  # an installed verifiers environment, module:attribute, or a name given to provide()
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of its load_environment


ENV_SCHEMAS: dict[str, type] = {"verifiers_schema": VerifiersEnvConfig, "env_schema": EnvConfig, "guess_number_schema": GuessNumberEnvConfig,
                                "calculator_schema": CalculatorEnvConfig, "exact_two_turn_schema": ExactTwoTurnEnvConfig}
