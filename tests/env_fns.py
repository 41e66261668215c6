"""Environments for tests, loaded as a plug-in module (``plugins=[tests.env_fns]``)."""

import threading

from rlhf_lab.envs.base import Environment, StepResult
from rlhf_lab.registry import register


@register("env", "fails_after")
class FailsAfter(Environment):
    """One turn scored 1, until ``fail_after`` steps have been taken: then every step raises."""

    name = "fails_after"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls, self.lock = 0, threading.Lock()

    def reset(self, task, seed):
        return [{"role": "user", "content": task["prompt"]}]

    def step(self, assistant_message, state):
        with self.lock:
            self.calls += 1
            calls = self.calls
        if calls > 4:  # 2 prompts x 2 samples: the first training step's episodes pass
            raise ConnectionError("scoreboard unreachable")
        return StepResult(None, 1.0, True)


class _OneTurn(Environment):
    """Opens with the prompt; each test environment below answers the first turn in its own wrong way."""

    def reset(self, task, seed):
        return [{"role": "user", "content": task["prompt"]}]


@register("env", "nan_reward")
class NanReward(_OneTurn):
    name = "nan_reward"

    def step(self, assistant_message, state):
        return StepResult(None, float("nan"), True)


@register("env", "exits")
class Exits(_OneTurn):
    name = "exits"

    def step(self, assistant_message, state):
        import sys

        sys.exit(3)


@register("env", "hangs_once")
class HangsOnce(_OneTurn):
    """The first step never returns; every later one answers at once (``env.on_error=drop`` keeps the run going)."""

    name = "hangs_once"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls, self.lock, self.forever = 0, threading.Lock(), threading.Event()

    def step(self, assistant_message, state):
        with self.lock:
            self.calls += 1
            first = self.calls == 1
        if first:
            self.forever.wait()
        return StepResult(None, 1.0, True)


@register("env", "huge_reply")
class HugeReply(_OneTurn):
    """Answers the first turn with 20 MB of text."""

    name = "huge_reply"

    def step(self, assistant_message, state):
        if state.turn == 1:
            return StepResult([{"role": "user", "content": "lorem ipsum " * 1_700_000}], 0.0, False)
        return StepResult(None, 1.0, True)


def undocumented(expression: str) -> str:
    return expression


@register("env", "undocumented_tool")
class UndocumentedTool(_OneTurn):
    name = "undocumented_tool"
    tools = (undocumented,)

    def step(self, assistant_message, state):
        return StepResult(None, 1.0, True)


@register("env", "unencodable_reset")
class UnencodableReset(_OneTurn):
    """Opens with a lone surrogate: a Python str, but not text a tokenizer can encode."""

    name = "unencodable_reset"

    def reset(self, task, seed):
        return [{"role": "user", "content": "half a character: \ud800"}]

    def step(self, assistant_message, state):
        return StepResult(None, 1.0, True)
