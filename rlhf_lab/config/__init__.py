"""Configuration: structured schemas per option (:mod:`.schema`), validation (:mod:`.validate` and the
``validate_*`` modules it calls) and composition (:mod:`.compose`, the one entry every caller uses).

The names below are imported on first use, so importing a light part (``rlhf_lab.config.sweep_jobs`` for ``rlhf-lab
--help``) does not import validation, which loads every registered part (torch, transformers). ``compose`` and
``validate`` are functions here, though modules of those names exist: the package keeps the functions bound when the
modules are imported (:class:`_Package`)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__all__ = ["CONF_DIR", "Config", "ConfigError", "compose", "register_configs", "validate"]
_WHERE = {"CONF_DIR": "rlhf_lab.config.conf_dir", "Config": "rlhf_lab.config.schema",
          "register_configs": "rlhf_lab.config.schema", "compose": "rlhf_lab.config.compose",
          "validate": "rlhf_lab.config.validate", "ConfigError": "rlhf_lab.errors",
          "OfflineAlgorithmConfig": "rlhf_lab.config.schema_offline"}
_FUNCTIONS = ("compose", "validate")  # names of both a module and the function the package means by them


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name == "register_configs":
        importlib.import_module("rlhf_lab.config.schema_offline")  # the offline stages' schemas join the store
    return getattr(importlib.import_module(_WHERE[name]), name)


class _Package(types.ModuleType):
    """The import system binds each imported submodule as an attribute of its package; for ``compose`` and
    ``validate`` the package keeps meaning the functions (resolved by ``__getattr__``), as its eager imports did."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
