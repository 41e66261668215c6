"""Named components by kind.

Every swappable part (algorithm, KL estimator, reward, ...) registers itself next to its definition::

    @register("kl", "k3")
    def k3(logprobs, ref_logprobs, logits=None, ref_logits=None): ...

and the trainer looks it up by the name in the config: ``get("kl", cfg.kl.name)``. The trainer never
branches on a name, so adding an estimator or an algorithm is one new definition plus one config file.

This module is a leaf: it imports nothing of the package but its error type. ``rlhf_lab.components``
imports the built-in parts so that their decorators run; entry points import it once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhf_lab.errors import RegistryError

_REGISTRY: dict[str, dict[str, Any]] = {}


def register(kind: str, name: str) -> Callable[[Any], Any]:
    """Decorator: register ``obj`` under ``kind``/``name`` and return it unchanged."""

    def decorator(obj: Any) -> Any:
        table = _REGISTRY.setdefault(kind, {})
        if name in table and table[name] is not obj:
            raise ValueError(f"{kind} {name!r} is already registered by {table[name]!r}")
        table[name] = obj
        return obj

    return decorator


def get(kind: str, name: str) -> Any:
    """Return the component registered as ``kind``/``name``; unknown names list the valid ones."""
    if kind not in _REGISTRY:
        raise RegistryError(f"unknown component kind {kind!r}; valid kinds: {', '.join(sorted(_REGISTRY))}")
    table = _REGISTRY[kind]
    if name not in table:
        raise RegistryError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(table))}")
    return table[name]


def names(kind: str) -> list[str]:
    """Sorted names registered under ``kind`` (empty if none)."""
    return sorted(_REGISTRY.get(kind, {}))
