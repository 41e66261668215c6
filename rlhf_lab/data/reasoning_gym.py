"""``data=reasoning_gym``: procedural tasks with verifiable answers from the ``reasoning-gym`` package.

``data.task=NAME`` (any of reasoning-gym's registered tasks) is generated offline from ``data.task_seed``:
``data.size`` training and ``data.eval_size`` held-out examples (the held-out ones from the next seed). Each prompt
is a conversation, reasoning-gym's own system prompt (answer in ``<answer>...</answer>``, ``data.system_prompt``)
and the question; its row carries the ``question``, ``answer`` and ``metadata`` columns that ``reward=reasoning_gym``
scores with the task's own verifier. reasoning-gym is an optional extra: ``make install-reasoning``.
"""

from __future__ import annotations

from typing import Any

from rlhf_lab.data.rows import Prompt, make_prompt
from rlhf_lab.errors import ConfigError, DataError

INSTALL = "pip install -r requirements-reasoning.txt (or make install-reasoning)"


def reasoning_gym_module() -> Any:
    """The ``reasoning_gym`` package, or a one-line ConfigError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"data=reasoning_gym / reward=reasoning_gym need reasoning-gym, which is not installed: "
                          f"{INSTALL}") from None
    return reasoning_gym


def reasoning_gym_prompts(data_cfg: Any) -> tuple[list[Prompt], list[Prompt]]:
    """The train and eval prompts of ``data.task`` (see the module's text)."""
    gym = reasoning_gym_module()
    tasks = sorted(gym.factory.DATASETS)
    if data_cfg.task not in tasks:
        raise DataError(f"data.task={data_cfg.task!r} is not a reasoning-gym task; tasks: {', '.join(tasks)}")
    system = gym.utils.SYSTEM_PROMPTS["default"] if data_cfg.system_prompt else None

    def prompts(size: int, seed: int) -> list[Prompt]:
        rows = []
        for entry in gym.create_dataset(data_cfg.task, size=size, seed=seed):
            messages = [{"role": "user", "content": entry["question"]}]
            if system:
                messages.insert(0, {"role": "system", "content": system})
            columns = {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}
            rows.append(make_prompt(messages, columns))
        return rows

    evaluation = prompts(data_cfg.eval_size, data_cfg.task_seed + 1) if data_cfg.eval_size else []
    return prompts(data_cfg.size, data_cfg.task_seed), evaluation
