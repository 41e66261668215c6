"""``eval.*`` (rlhf_lab/training/evaluation.py): sampling values in range, extra rewards that are reward options."""

from __future__ import annotations

from typing import Any

from rlhf_lab.config.conf_dir import CONF_DIR
from rlhf_lab.config.sweep_jobs import options
from rlhf_lab.errors import ConfigError


def check_eval(cfg: Any, search_paths: tuple[str, ...] = ()) -> None:
    node = cfg.get("eval")
    if node is None:
        return
    if node.samples_per_prompt < 1:
        raise ConfigError(f"eval.samples_per_prompt={node.samples_per_prompt} is out of range; must be >= 1")
    if node.prompts is not None and node.prompts < 0:
        raise ConfigError(f"eval.prompts={node.prompts} is out of range; must be >= 0 (null: trainer.eval_prompts)")
    if node.temperature is not None and not node.temperature > 0:
        raise ConfigError(f"eval.temperature={node.temperature} is out of range; must be > 0 (or eval.greedy=true)")
    if node.top_p is not None and not 0 < node.top_p <= 1:
        raise ConfigError(f"eval.top_p={node.top_p} is out of range; must be in (0, 1]")
    valid = options(CONF_DIR, "reward", search_paths)
    for key, names in (("eval.rewards", list(node.rewards)), ("eval.win_rate_reward", [node.win_rate_reward])):
        for name in names:
            if name is not None and name not in valid:
                raise ConfigError(f"{key}: {name!r} is not a reward option; choose from: {', '.join(valid)}")
