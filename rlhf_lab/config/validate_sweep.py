"""Sweep checks before Hydra starts: the launcher and sweeper plugins, and an Optuna search space.

- ``hydra/launcher=ray`` (or any launcher/sweeper option) whose plugin or engine is not installed: one line naming
  what to install (``ray`` is an optional extra: ``pip install -r requirements-ray.txt``); an option that no
  installed plugin provides: one line listing the options there are.
- ``hydra/sweeper=optuna`` (``+hparams_search=NAME``): every key of the search space (``hydra.sweeper.params``)
  is a key of the config the jobs get (``trainer.lrr`` names the valid keys of ``trainer``), a group key's
  choices are options of that group, and the job composes with each key's first value; the run has an
  ``optimized_metric`` to return.

:func:`rlhf_lab.config.compose.compose` calls these, so the CLI fails with exit status 2 before any job starts.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_lab.config.overrides import override_text
from rlhf_lab.config.validate_keys import schema_at, unknown_key_message
from rlhf_lab.errors import ConfigError

PLUGIN_KINDS = ("launcher", "sweeper")
OPTUNA_SWEEPER = "hydra_plugins.rlhf_lab_optuna.optuna_sweeper.OptunaSweeper"


@dataclass(frozen=True)
class Plugin:
    packages: str  # what is missing, for the message
    modules: tuple[str, ...]  # importable when installed (the Hydra plugin and the engine it drives)
    install: str  # how to install it


RAY = Plugin("hydra-ray-launcher and ray", ("hydra_plugins.hydra_ray_launcher", "ray"),
             "install the optional `ray` extra: pip install -r requirements-ray.txt (or: make install-ray)")
PLUGINS: dict[tuple[str, str], Plugin] = {
    ("launcher", "ray"): RAY,
    ("launcher", "ray_aws"): RAY,
    ("launcher", "ray_cluster"): RAY,  # conf/hydra/launcher/ray_cluster.yaml
    ("launcher", "joblib"): Plugin("hydra-joblib-launcher", ("hydra_plugins.hydra_joblib_launcher", "joblib"),
                                   "install it: pip install -r requirements.txt"),
    ("launcher", "submitit_local"): Plugin("hydra-submitit-launcher",
                                           ("hydra_plugins.hydra_submitit_launcher", "submitit"),
                                           "install it: pip install -r requirements.txt"),
    ("launcher", "rq"): Plugin("hydra-rq-launcher", ("hydra_plugins.hydra_rq_launcher", "rq"),
                               "install it: pip install hydra-rq-launcher"),
    ("sweeper", "optuna"): Plugin("optuna", ("hydra_plugins.rlhf_lab_optuna", "optuna"),
                                  "install it: pip install -r requirements.txt"),
    ("sweeper", "ax"): Plugin("hydra-ax-sweeper", ("hydra_plugins.hydra_ax_sweeper",), "install it: pip install hydra-ax-sweeper"),
    ("sweeper", "nevergrad"): Plugin("hydra-nevergrad-sweeper", ("hydra_plugins.hydra_nevergrad_sweeper",),
                                     "install it: pip install hydra-nevergrad-sweeper"),
}
PLUGINS[("launcher", "submitit_slurm")] = PLUGINS[("launcher", "submitit_local")]
PLUGINS[("launcher", "slurm")] = PLUGINS[("launcher", "submitit_local")]  # conf/hydra/launcher/slurm.yaml
PLUGINS[("launcher", "joblib_local")] = PLUGINS[("launcher", "joblib")]
_BY_PACKAGE: dict[str, tuple[str, str]] = {}  # hydra_plugins.<package> -> the first option that names it
for _choice, _plugin in PLUGINS.items():
    _BY_PACKAGE.setdefault(_plugin.modules[0].split(".")[1], _choice)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _missing(kind: str, name: str) -> str | None:
    plugin = PLUGINS.get((kind, name))
    if plugin is None or all(_installed(module) for module in plugin.modules):
        return None
    verb = "are" if " and " in plugin.packages else "is"
    return f"hydra/{kind}={name} needs {plugin.packages}, which {verb} not installed; {plugin.install}"


def plugin_options(kind: str, conf_dir: Path) -> list[str]:
    """Options of ``hydra/<kind>``: rlhf_lab's files and the installed plugins' configs (Hydra's ConfigStore)."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports the installed hydra_plugins, which register their configs
    stored = ConfigStore.instance().repo.get("hydra", {}).get(kind, {})
    names = {Path(name).stem for name in stored if name.endswith(".yaml")} | {"basic"}
    names |= {path.stem for path in (conf_dir / "hydra" / kind).glob("*.yaml")}
    return sorted(names - {"rlhf_lab_optuna"})


def plugin_selections(overrides: list[str]) -> list[tuple[str, str]]:
    """``hydra/launcher=ray`` -> ``("launcher", "ray")`` for every launcher/sweeper choice on the command line."""
    chosen = []
    for override in overrides:
        key, _, value = override.partition("=")
        kind = key.lstrip("+~").removeprefix("hydra/")
        if key.lstrip("+~").startswith("hydra/") and kind in PLUGIN_KINDS and value:
            chosen.append((kind, value.strip()))
    return chosen


def check_plugins(overrides: list[str], conf_dir: Path) -> None:
    """A launcher/sweeper chosen on the command line is installed and exists (before anything composes it)."""
    for kind, name in plugin_selections(overrides):
        message = _missing(kind, name)
        if message:
            raise ConfigError(message)
        options = plugin_options(kind, conf_dir)
        if name not in options:
            raise ConfigError(f"hydra/{kind}={name!r} is not an option; choose from: {', '.join(options)}")


def plugin_error(error: Exception, conf_dir: Path) -> ConfigError | None:
    """A launcher/sweeper that an experiment or hparams_search file selects but Hydra cannot find, as one line."""
    match = re.search(r"Could not (?:find|load) 'hydra/(launcher|sweeper)/([\w.\-]+)'", str(error))
    if match is None:
        return None
    kind, name = match.groups()
    message = _missing(kind, name)
    if message is None:
        options = plugin_options(kind, conf_dir)
        message = f"hydra/{kind}={name!r} is not an option; choose from: {', '.join(options)}"
    return ConfigError(message)


def check_plugin_targets(hydra_cfg: Any) -> None:
    """The composed launcher and sweeper can be imported with the engine they drive (``ray`` for the Ray one)."""
    for kind in PLUGIN_KINDS:
        target = str(OmegaConf.select(hydra_cfg, f"hydra.{kind}._target_", default="") or "")
        parts = target.split(".")
        if len(parts) > 1 and parts[0] == "hydra_plugins" and parts[1] in _BY_PACKAGE:
            message = _missing(*_BY_PACKAGE[parts[1]])
            if message:
                raise ConfigError(message)


# ------------------------------------------------------------------------------------------ search space


def check_interval(key: str, start: float, end: float) -> None:
    """An ``interval(low, high)`` whose low end is above its high end is one line (a sampler would raise)."""
    if start > end:
        raise ConfigError(f"{key}=interval({override_text(start)}, {override_text(end)}): the low end is more than "
                          f"the high end; write interval({override_text(end)}, {override_text(start)})")


def sweep_values(override: str) -> list[str] | None:
    """The values of a sweep override as override text (``a,b`` / ``choice`` / ``range``: all of them;
    ``interval``: its lower bound), or None when it is not a sweep or cannot be parsed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_override(override)
    except Exception:
        return None
    if not parsed.is_sweep_override():
        return None
    if parsed.is_interval_sweep():
        sweep = parsed.value()
        check_interval(parsed.key_or_group, sweep.start, sweep.end)
        start = math.ceil(sweep.start) if "int" in sweep.tags else sweep.start
        return [override_text(start)]
    if parsed.is_discrete_sweep():
        return [override_text(value) for value in parsed.sweep_iterator()]
    return None


def _flatten(params: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(params, DictConfig):
        params = OmegaConf.to_container(params, resolve=False)
    flat: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _unknown_key(job_cfg: Any, key: str) -> str | None:
    """The message for the first part of dotted ``key`` that the job's config lacks, else None."""
    node: Any = job_cfg
    parts = key.split(".")
    for index, part in enumerate(parts):
        if isinstance(node, DictConfig) and part in node:
            node = node[part]
            continue
        full_key = ".".join(parts[: index + 1])
        parent = ".".join(parts[:index])
        schema = schema_at(job_cfg, parent)
        if schema is not None:
            return unknown_key_message(job_cfg, full_key, schema)
        valid = ", ".join(str(k) for k in node) if isinstance(node, DictConfig) else ""
        return f"unknown key {full_key!r}" + (f"; valid keys of {parent}: {valid}" if valid else "")
    return None


def check_search_space(hydra_cfg: Any, job_cfg: Any, groups: dict[str, list[str]],
                       compose_job: Callable[[list[str]], Any], job_overrides: list[str]) -> None:
    """The Optuna search space names keys the jobs' config has, with values they accept (see the module doc).

    ``groups``: config group -> its options; ``compose_job(overrides)`` composes and validates one job.
    """
    if str(OmegaConf.select(hydra_cfg, "hydra.sweeper._target_", default="")) != OPTUNA_SWEEPER:
        return
    if job_cfg.get("optimized_metric") is None:
        raise ConfigError("hydra/sweeper=optuna needs the objective each trial returns: set optimized_metric to a "
                          "summary.json key, e.g. optimized_metric=eval/reward/mean")
    check_search_settings(hydra_cfg)
    params = _flatten(OmegaConf.select(hydra_cfg, "hydra.sweeper.params"))
    where = "search space (hydra.sweeper.params)"
    first_values = []
    for raw_key, value in params.items():
        key = raw_key.lstrip("+~")
        line = f"{raw_key}={value}"
        values = sweep_values(line) or [override_text(value) if not isinstance(value, str) else value]
        if key in groups:
            for choice in values:
                if choice not in groups[key]:
                    raise ConfigError(f"{where}: {key}={choice!r} is not an option; choose from: "
                                      f"{', '.join(groups[key])}")
        elif not raw_key.startswith("+"):
            message = _unknown_key(job_cfg, key)
            if message:
                raise ConfigError(f"{where}: {message}")
        first_values.append(f"{raw_key}={values[0]}")
    if first_values:
        searched = {key.lstrip("+~") for key in params}
        kept = [o for o in job_overrides if o.split("=", 1)[0].lstrip("+~") not in searched]
        try:
            compose_job([*kept, *first_values])
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None


DIRECTIONS = ("maximize", "minimize")


def check_search_settings(hydra_cfg: Any) -> None:
    """The search's own settings: ``hydra.sweeper.direction`` one of :data:`DIRECTIONS`, ``n_trials`` and ``n_jobs``
    whole numbers ≥ 1 (0 trials would run nothing and report no best trial)."""
    direction = OmegaConf.select(hydra_cfg, "hydra.sweeper.direction")
    if direction not in DIRECTIONS:
        raise ConfigError(f"hydra.sweeper.direction={direction!r} is not valid; choose from: {', '.join(DIRECTIONS)}")
    for key in ("n_trials", "n_jobs"):
        value = OmegaConf.select(hydra_cfg, f"hydra.sweeper.{key}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"hydra.sweeper.{key}={value!r} is out of range; must be an integer ≥ 1")


SEARCH_ATTR = "rlhf_lab_search"  # the study's user attribute holding the search that made it


def search_signature(params: dict[str, Any], task_overrides: list[str], direction: str) -> dict[str, Any]:
    """What makes an Optuna search the same search: the keys it searches (``hydra.sweeper.params`` and the
    command line's sweep overrides), the settings every trial shares (the command line's other overrides) and the
    direction. Hydra's own settings (trial counts, folders) are not part of it, so a study resumes with more
    trials; a search with other fixed settings is another search."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    space = {key.lstrip("+~") for key in params}
    fixed = []
    for line in task_overrides:
        if line.lstrip("+~").startswith(("hydra.", "hydra/")) or "=" not in line:
            continue
        override = parser.parse_override(line)
        key = override.get_key_element().lstrip("+~")
        if override.is_sweep_override():
            space.add(key)
        elif key not in space:
            fixed.append(f"{key}={override.get_value_element_as_str()}")
    return {"space": sorted(space), "fixed": sorted(fixed), "direction": str(direction)}


def study_conflict(stored: dict[str, Any] | None, current: dict[str, Any], study: str) -> str | None:
    """One line saying how an existing study's search differs from this one, or None when it is the same."""
    if stored is None or stored == current:
        return None
    for part, label in (("direction", "direction"), ("space", "searched keys"), ("fixed", "fixed settings")):
        if stored.get(part) != current[part]:
            old, new = stored.get(part), current[part]
            if part == "fixed":
                old, new = sorted(set(old) - set(new)) or "none", sorted(set(new) - set(old)) or "none"
            return (f"hydra.sweeper.study_name={study!r} holds a search with other {label} ({old} there, {new} here); "
                    "give this search its own hydra.sweeper.study_name or hydra.sweeper.storage")
    return None


def check_study(hydra_cfg: Any, task_overrides: list[str]) -> None:
    """An Optuna storage that already holds the study under this name must hold this search (see
    :func:`search_signature`): a different search would join it and report the other's best trial."""
    if hydra_cfg is None or str(OmegaConf.select(hydra_cfg, "hydra.sweeper._target_", default="")) != OPTUNA_SWEEPER:
        return
    storage, name = OmegaConf.select(hydra_cfg, "hydra.sweeper.storage"), OmegaConf.select(hydra_cfg,
                                                                                         "hydra.sweeper.study_name")
    if not storage or not name:
        return
    if str(storage).startswith("sqlite:///") and not Path(str(storage)[len("sqlite:///"):]).expanduser().is_file():
        return
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=str(name), storage=str(storage))
    except KeyError:  # no study of that name there yet
        return
    current = search_signature(_flatten(OmegaConf.select(hydra_cfg, "hydra.sweeper.params")), task_overrides,
                               str(OmegaConf.select(hydra_cfg, "hydra.sweeper.direction")))
    conflict = study_conflict(study.user_attrs.get(SEARCH_ATTR), current, str(name))
    if conflict:
        raise ConfigError(conflict)
