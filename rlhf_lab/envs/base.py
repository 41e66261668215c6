"""The environment protocol (kind ``env``, ``env=NAME``): what a rollout talks to between the model's turns.

A text environment is a class registered with ``@register("env", NAME)``, built as ``EnvClass(cfg)`` (``cfg`` is
``cfg.env``) and used once per episode::

    messages = env.reset(task, seed)                      # the conversation the model answers first
    result = env.step(assistant_message, state)           # after each model turn
    # result: StepResult(messages, reward, done, info), or the tuple (messages, reward, done, info)

``task`` is the data row the episode starts from (``{"prompt": text, ...}``); ``seed`` is the prompt group's own
seed, so the samples of a group start from the same conversation and a rerun from the same one. ``step`` gets the
assistant message as text and the episode's :class:`EnvState` (the task, the turn, the conversation so far, and a
``data`` dict the environment keeps its own state in); it returns the messages that follow (user, tool, ...; None
or ``done=True`` ends the episode), this turn's reward and ``info`` (numbers are summed into the step's metrics).

``single_turn`` (the default) is no environment at all: one prompt, one response, the configured ``reward=``
scores it, every existing config runs as it did. Environments reward themselves (a verifier, a game, a judge) and
may hold tools (:mod:`rlhf_lab.envs.tools`). The runner (:mod:`rlhf_lab.envs.episodes`) calls ``reset`` and
``step`` in a thread pool with a timeout per call (``env.step_timeout``), so a slow tool does not stall the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlhf_lab.registry import register

Message = dict[str, Any]  # {"role": ..., "content": ...} (and tool calls, as the chat template takes them)


@dataclass
class EnvState:
    """One episode as the environment sees it."""

    task: dict[str, Any]
    seed: int
    turn: int = 0  # model turns taken (1 in the first ``step``)
    messages: list[Message] = field(default_factory=list)  # the conversation so far, as produced
    data: dict[str, Any] = field(default_factory=dict)  # the environment's own per-episode state


@dataclass
class StepResult:
    """What a step returns: the messages that follow (None: no more), this turn's reward, whether the episode is
    over, and numbers to log (summed over the batch's episodes under ``env/``)."""

    messages: list[Message] | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


class Environment:
    """Base class: keeps ``cfg`` (``cfg.env``); subclasses implement :meth:`reset` and :meth:`step`.

    ``tools`` are Python functions the model may call (the chat template gets their JSON schemas, see
    :mod:`rlhf_lab.envs.tools`); ``single_turn`` marks the default, which the trainer runs without the episode
    runner.
    """

    name: ClassVar[str] = "env"
    single_turn: ClassVar[bool] = False
    tools: ClassVar[tuple[Callable[..., Any], ...]] = ()

    def __init__(self, cfg: Mapping[str, Any] | Any) -> None:
        self.cfg = cfg

    def option(self, key: str, default: Any = None) -> Any:
        """``cfg[key]``, or ``default`` when the key is absent or null."""
        value = self.cfg.get(key, default) if hasattr(self.cfg, "get") else default
        return default if value is None else value

    def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        raise NotImplementedError

    def step(self, assistant_message: str, state: EnvState) -> StepResult | tuple[Any, ...]:
        raise NotImplementedError

    def describe(self) -> str:
        """How error messages name this environment."""
        return f"env={self.name}"


@register("env", "single_turn")
class SingleTurn(Environment):
    """One prompt, one response, scored by ``reward=`` (the trainer's own path; this class states the protocol's
    view of it: the prompt as a user message, and the episode over after the first turn)."""

    name = "single_turn"
    single_turn = True

    def reset(self, task: dict[str, Any], seed: int) -> list[Message]:
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, assistant_message: str, state: EnvState) -> StepResult:
        return StepResult(None, 0.0, True)


def as_step_result(value: Any) -> StepResult:
    """A step's return value as a :class:`StepResult`; ValueError naming what is wrong with it."""
    if isinstance(value, tuple):
        if len(value) != 4:
            raise ValueError(f"step returned a tuple of {len(value)}; expected (messages, reward, done, info)")
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise ValueError(f"step returned {type(value).__name__}; expected StepResult or (messages, reward, done, info)")
    check_messages(value.messages, "step", allow_none=True)
    if isinstance(value.reward, bool) or not isinstance(value.reward, int | float):
        raise ValueError(f"step's reward is {value.reward!r}; expected a number")
    if not math.isfinite(value.reward):  # NaN would skip the update in silence
        raise ValueError(f"step's reward is {value.reward!r}; expected a finite number")
    if not isinstance(value.done, bool):
        raise ValueError(f"step's done is {value.done!r}; expected True or False")
    if not isinstance(value.info, Mapping) or not all(isinstance(v, int | float) for v in value.info.values()):
        raise ValueError(f"step's info is {value.info!r}; expected a dict of numbers")
    value.reward = float(value.reward)
    return value


def check_messages(messages: Any, where: str, allow_none: bool = False) -> None:
    """ValueError unless ``messages`` is a list of dicts with a string ``role`` and a string ``content``."""
    if messages is None and allow_none:
        return
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"{where} returned messages {messages!r}; expected a list of {{'role': ..., 'content': ...}}")
    for message in messages:
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise ValueError(f"{where} returned the message {message!r}; each needs a string 'role' and 'content'")
