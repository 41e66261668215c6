"""Plug-ins: a user's package that registers its own parts (data, reward, algorithm pieces, KL estimator, tracker).

A plug-in is any importable module whose import runs ``@register(kind, name)`` (and, for an option with its own
fields, stores its schema in Hydra's ConfigStore). Two ways to load it, both before any config is validated:

- an entry point in the group ``rlhf_lab.plugins`` (``[project.entry-points."rlhf_lab.plugins"]`` in the plug-in's
  ``pyproject.toml``: ``my_pkg = "my_pkg"``), loaded by every run once the package is installed;
- the config key ``plugins: [my_pkg]`` (``plugins=[my_pkg]`` on the command line, or in an experiment file).

Its config options (``reward/my_reward.yaml``, ``kl/my_kl.yaml``) are found through Hydra's search path:
``hydra.searchpath=[pkg://my_pkg.conf]`` or ``--config-dir DIR``. A plug-in that fails to import stops the run
with one line naming it and its error.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlhf_lab.errors import ConfigError

ENTRY_POINT_GROUP = "rlhf_lab.plugins"
_loaded: dict[str, Any] = {}
_entry_points_loaded = False


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def load_entry_points() -> list[str]:
    """Import every installed ``rlhf_lab.plugins`` entry point (once per process); returns their names."""
    global _entry_points_loaded
    found = installed_entry_points()
    if _entry_points_loaded:
        return [point.name for point in found]
    _entry_points_loaded = True
    for point in found:
        key = f"entry point {point.name} = {point.value}"
        if key in _loaded:
            continue
        try:
            _loaded[key] = point.load()
        except (Exception, SystemExit) as error:  # a plug-in that raises or calls sys.exit while importing
            raise ConfigError(f"plug-in entry point {point.name!r} ({ENTRY_POINT_GROUP}: {point.value}) failed to "
                              f"import: {_first_line(error)}") from None
    return [point.name for point in found]


def installed_entry_points() -> list[Any]:
    """The ``rlhf_lab.plugins`` entry points of installed distributions: those on ``sys.path`` except the working
    folder (which ``python -m`` and the console script put there to import a reward module from it), so a
    ``*.dist-info`` lying in the folder a run starts from cannot inject a plug-in into it."""
    from importlib.metadata import distributions

    here = Path.cwd().resolve()
    paths = [entry for entry in sys.path if Path(entry or ".").resolve() != here]
    found, seen = [], set()
    for distribution in distributions(path=paths):
        for point in distribution.entry_points.select(group=ENTRY_POINT_GROUP):
            if (point.name, point.value) not in seen:
                seen.add((point.name, point.value))
                found.append(point)
    return found


def load_plugins(names: Iterable[str] = ()) -> None:
    """Import the entry points and the modules ``names`` (the ``plugins`` key); one line on a failure."""
    load_entry_points()
    for name in names:
        name = str(name).strip()
        if not name or name in _loaded:
            continue
        try:
            _loaded[name] = importlib.import_module(name)
        except (Exception, SystemExit) as error:
            raise ConfigError(f"plugins: {name!r} failed to import ({_first_line(error)}); install it or add its "
                              "folder to PYTHONPATH") from None


def plugins_in_overrides(overrides: Iterable[str]) -> list[str]:
    """``plugins=[a,b]`` / ``+plugins=[a]`` / ``plugins=a`` on the command line -> ``["a", "b"]``."""
    names: list[str] = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == "plugins" and value:
            value = value.strip()
            if value.startswith("[") and value.endswith("]"):
                value = value[1:-1]
            names += [part.strip().strip("'\"") for part in value.split(",") if part.strip()]
    return names


def loaded() -> list[str]:
    """What has been loaded in this process (entry points and modules), for messages and tests."""
    return sorted(_loaded)
