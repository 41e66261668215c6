"""User code a config names: ``module:function`` specs of ``python`` rewards, imported now.

This imports user code named in the config (by design: a ``python`` reward runs it anyway), so a typo in
a module or function name fails before any model loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf_lab.errors import ConfigError


def check_function(key: str, spec: Any) -> None:
    """Import a ``module:function`` spec; a ConfigError naming ``key`` if it cannot be loaded."""
    from rlhf_lab.rewards.python_function import load_function

    try:
        load_function(spec)
    except ValueError as error:
        raise ConfigError(f"{key}={spec!r}: {str(error).split(': ', 1)[-1]}") from None


def check_code(cfg: Any) -> None:
    reward = cfg.reward
    if "function" in reward:
        function = reward.function
        if not function or ":" not in function:
            raise ConfigError(f"reward.function={function!r} must be 'module:function'")
        check_function("reward.function", function)
    for index, component in enumerate(reward.get("components") or []):
        if isinstance(component, Mapping) and component.get("name") == "python":
            check_function(f"reward.components[{index}].function", component.get("function"))
    for value, routed in (reward.get("rewards") or {}).items():  # reward=route
        if isinstance(routed, Mapping) and routed.get("name") == "python":
            check_function(f"reward.rewards.{value}.function", routed.get("function"))
