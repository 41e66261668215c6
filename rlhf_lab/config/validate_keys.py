"""Every key of a composed config belongs to the schema of the node holding it.

The schema of a node is its own structured type (``OmegaConf.get_type``), so ``cfg.reward`` is checked
against the chosen option's dataclass (``SentimentRewardConfig`` for ``reward=sentiment``), not the union
of every option. Composition already rejects ``trainer.stepz=3``; this also catches keys appended with
Hydra's ``+`` (``+reward.min_words=3``), which would otherwise be carried along and silently ignored.
The same messages describe keys that failed composition (:mod:`rlhf_lab.config.compose`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_lab.config.schema import Config
from rlhf_lab.config.suggest import did_you_mean
from rlhf_lab.errors import ConfigError

OPTION_GROUPS = ("algorithm", "kl", "reward", "model", "data", "logger", "hardware", "generation", "env")  # top-level nodes chosen as GROUP=NAME


def schema_of(node: Any, fallback: type | None = None) -> type | None:
    """The dataclass a config node was built from, else ``fallback`` (e.g. the field's declared type)."""
    kind = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if kind is not None and dataclasses.is_dataclass(kind):
        return kind
    return fallback if fallback is not None and dataclasses.is_dataclass(fallback) else None


def field_types(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def unknown_key_message(cfg: Any, full_key: str, schema: type) -> str:
    """``unknown key 'reward.min_words' for reward=sentiment; valid keys: ...`` (group options), or
    ``unknown key 'trainer.stepz'; valid keys of trainer: ...`` elsewhere."""
    parent, _, last = full_key.rpartition(".")
    fields = list(field_types(schema))
    valid = ", ".join(fields)
    guess = did_you_mean(last, fields)
    if guess:  # the whole key, as it is typed
        guess = did_you_mean(full_key, [f"{parent}.{name}" if parent else name for name in fields])
    if parent in OPTION_GROUPS and isinstance(cfg, DictConfig) and isinstance(cfg.get(parent), DictConfig):
        option = cfg[parent].get("name")
        return f"unknown key {full_key!r} for {parent}={option}; {guess}valid keys: {valid}"
    where = f" of {parent}" if parent else ""
    return f"unknown key {full_key!r}; {guess}valid keys{where}: {valid}"


def type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def schema_at(cfg: Any, parent: str) -> type | None:
    """The schema of the node at dotted ``parent`` ("" = the root) of ``cfg``, or None if there is none."""
    node, schema = cfg, schema_of(cfg, Config)
    for part in parent.split(".") if parent else []:
        declared = field_types(schema).get(part) if schema is not None else None
        node = node.get(part) if isinstance(node, DictConfig) else None
        schema = schema_of(node, declared)
        if schema is None:
            return None
    return schema


def check_known_keys(cfg: Any) -> None:
    """Raise ConfigError for the first key not in its node's schema, recursively through nested schemas."""
    _check_node(cfg, cfg, schema_of(cfg, Config), "")


def _check_node(root: Any, node: Any, schema: type | None, prefix: str) -> None:
    if schema is None:
        return
    hints = field_types(schema)
    for key in node:
        full_key = f"{prefix}{key}"
        if full_key == "hydra":  # present when composed with return_hydra_config; Hydra checks its own
            continue
        if key not in hints:
            raise ConfigError(unknown_key_message(root, full_key, schema))
        if OmegaConf.is_missing(node, key):
            continue
        child = node.get(key)
        if isinstance(child, DictConfig):
            _check_node(root, child, schema_of(child, hints[key]), f"{full_key}.")
