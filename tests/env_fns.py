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
