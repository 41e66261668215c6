"""Checks of the environment group (``env=NAME``): its values, and the settings a multi-turn episode cannot honour."""

from __future__ import annotations

from typing import Any

from rlhf_lab.config.validate_values import at_least, choice
from rlhf_lab.envs.episodes import ON_ERROR
from rlhf_lab.errors import ConfigError
from rlhf_lab.registry import get, names


def check_env(cfg: Any) -> None:
    """``env.*`` values, and what a multi-turn environment rules out (one line naming both settings)."""
    env = cfg.get("env")
    if env is None:
        return
    choice("env", env.name, names("env"))
    choice("env.on_error", env.on_error, ON_ERROR)
    at_least("env.max_turns", env.max_turns, 1)
    at_least("env.max_tokens", env.max_tokens, 1)
    at_least("env.step_timeout", env.step_timeout, 0, strict=True)
    at_least("env.workers", env.workers, 1)
    check_builtin_options(env)
    check_config = getattr(get("env", env.name), "check_config", None)  # an environment's own compose-time checks
    if check_config is not None:
        check_config(env)
    if get("env", env.name).single_turn:
        return
    algorithm, where = cfg.algorithm, f"env={env.name} plays multi-turn episodes"
    if getattr(get("algorithm", algorithm.name), "offline", False):
        raise ConfigError(f"{where}; algorithm={algorithm.name} learns from a dataset: use env=single_turn")
    advantage = algorithm.get("advantage")
    if advantage and getattr(get("advantage", advantage), "needs_greedy_baseline", False):
        raise ConfigError(f"{where}, and algorithm.advantage={advantage} needs a greedy response per prompt scored by "
                          "reward=: use another advantage (grpo, rloo, ...) or env=single_turn")
    if algorithm.get("overlong_window"):
        raise ConfigError(f"{where}, and algorithm.overlong_window={algorithm.overlong_window} shapes a single "
                          "response's length: use algorithm.mask_truncated=true (episodes cut by env.max_turns or "
                          "env.max_tokens are marked truncated), or env=single_turn")
    if algorithm.get("reward_clip") is not None or algorithm.get("normalize_scores"):
        raise ConfigError(f"{where} with per-turn rewards; algorithm.reward_clip / normalize_scores shape one score "
                          "per sample: set algorithm.reward_clip=null algorithm.normalize_scores=false")
    if cfg.generation.get("max_staleness", 0):
        raise ConfigError(f"{where}, each turn sampled after the environment answers the last; generation."
                          "max_staleness>0 samples a batch ahead in one go: use generation.max_staleness=0")
    if env.name == "exact_two_turn":
        check_exact_two_turn(cfg)


CALCULATOR_OPERATORS = "+-*/%"  # one character each, as the problem writes them


def check_builtin_options(env: Any) -> None:
    """The built-in environments' own options, before the run (each names its key)."""
    if env.name == "guess_number" and env.low > env.high:
        raise ConfigError(f"env.low={env.low} is more than env.high={env.high}; the secret is drawn from "
                          "[env.low, env.high]")
    if env.name == "calculator":
        at_least("env.operands", env.operands, 1)
        at_least("env.max_operand", env.max_operand, 1)
        operators = str(env.operators)
        wrong = [item for item in operators if item not in CALCULATOR_OPERATORS]
        if not operators or wrong:
            problem = f"has {wrong[0]!r}, not an operator" if wrong else "names no operator"
            raise ConfigError(f"env.operators={operators!r} {problem}; choose characters from "
                              f"{CALCULATOR_OPERATORS!r}")


def check_exact_two_turn(cfg: Any) -> None:
    """The testbed's shapes must match the exact task's model and the turn length."""
    env = cfg.env
    if cfg.model.name != "exact":
        raise ConfigError(f"env=exact_two_turn needs model=exact, not model={cfg.model.name} (experiment=exact_two_turn)")
    if env.turn_length != cfg.trainer.max_new_tokens:
        raise ConfigError(f"env.turn_length={env.turn_length} must equal trainer.max_new_tokens="
                          f"{cfg.trainer.max_new_tokens} (each model turn is that many symbols)")
    needed = 2 * env.turn_length + env.env_tokens
    if env.max_tokens < needed:
        raise ConfigError(f"env.max_tokens={env.max_tokens} cannot hold two turns of {env.turn_length} symbols and "
                          f"{env.env_tokens} environment symbols: at least {needed}")
    if env.max_turns != 2:
        raise ConfigError(f"env.max_turns={env.max_turns}: env=exact_two_turn has exactly 2 model turns")
