"""Every job of a sweep, expanded and checked before the first one starts; short job folder names.

- :func:`expand_jobs`: the jobs Hydra's basic sweeper will launch, from the experiment's ``hydra.sweeper.params``
  and the command line, expanded with Hydra's own override parser (``a,b``, ``range``, ``choice``, ``glob``),
  in the sweeper's order. ``interval`` needs a sweeper that samples (``hydra/sweeper=optuna``): one line.
- :func:`check_jobs`: compose and validate each job; the first bad one fails with one line naming the job
  (number and overrides) and the bad value. :func:`jobs_run_here`: whether they run on this machine.
- :func:`search_paths` / :func:`config_loader` / :func:`options`: config groups as Hydra sees them with the
  user's ``hydra.searchpath=[...]`` (or ``--config-dir``), so a plug-in's options are listed in errors.
- :func:`expand_globs`: ``kl=glob(*)`` on the command line becomes the list of the group's options (schemas,
  ``*_schema``, are not options), so the sweep runs exactly the jobs checked here.

Job folders are named by :mod:`rlhf_lab.app.job_folders` (number + a short, bounded label).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf_lab.config.conf_dir import CONF_DIR
from rlhf_lab.errors import ConfigError

LABEL_CHARS = 40  # job folder = "<num>_<label>": at most ~50 characters whatever the sweep
HYDRA_KEYS = ("hydra.", "hydra/", "+hydra", "++hydra", "~hydra")
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# Launchers whose jobs run on this machine (in this process, or in its local worker processes): its memory is theirs.
LOCAL_LAUNCHERS = ("hydra._internal.core_plugins.basic_launcher.BasicLauncher",
                   "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher")


# ------------------------------------------------------------------------------------------ search path


def _split_list(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return [part.strip().strip("'\"") for part in text.split(",") if part.strip()]


def search_paths(overrides: list[str]) -> tuple[str, ...]:
    """Config folders the user adds: ``hydra.searchpath=[pkg://my_pkg.conf, file://DIR]`` (``--config-dir DIR``
    is turned into that override by the CLI)."""
    found: list[str] = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "hydra.searchpath":
            found += _split_list(value)
    return tuple(dict.fromkeys(found))


def with_config_dirs(overrides: list[str], config_dirs: list[str]) -> list[str]:
    """``--config-dir DIR`` as Hydra applies it, for composing before Hydra starts: one ``hydra.searchpath``
    override holding the user's entries and the folders."""
    if not config_dirs:
        return list(overrides)
    paths = (*search_paths(overrides), *(f"file://{Path(d).expanduser().resolve()}" for d in config_dirs))
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+") != "hydra.searchpath"]
    return kept + searchpath_override(tuple(dict.fromkeys(paths)))


def searchpath_override(paths: tuple[str, ...]) -> list[str]:
    """The override that gives a compose the same search path as the run."""
    return [f"hydra.searchpath=[{','.join(paths)}]"] if paths else []


@functools.cache
def config_loader(conf_dir: str, paths: tuple[str, ...] = ()) -> Any:
    """Hydra's config loader over rlhf_lab's tree, the installed search-path plug-ins and ``paths``."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    search_path = create_config_search_path(conf_dir)
    for index, path in enumerate(paths):
        search_path.append(f"user-{index}", path if "://" in path else f"file://{Path(path).resolve()}")
    return ConfigLoaderImpl(config_search_path=search_path)


def is_schema(name: str) -> bool:
    """Whether a config name is a structured-config schema stored in the ConfigStore (``grpo_schema``, the root
    ``schema``): what the options' YAML files build on, never an option a user picks."""
    return name == "schema" or name.endswith("_schema")


def options(conf_dir: str | Path, group: str, paths: tuple[str, ...] = ()) -> list[str]:
    """The options of ``group`` (YAML files in every search-path folder; stored ``*_schema`` nodes excluded)."""
    from hydra.core.object_type import ObjectType

    if not paths:
        folder = Path(conf_dir) / group
        return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
    found = config_loader(str(conf_dir), paths).get_group_options(group, results_filter=ObjectType.CONFIG)
    return sorted(name for name in set(found) if not is_schema(name))


def check_search_paths(conf_dir: str | Path, paths: tuple[str, ...]) -> None:
    """Each added search-path entry exists: a folder, or an importable package with a config folder."""
    import importlib.util

    for path in paths:
        scheme, _, rest = path.partition("://") if "://" in path else ("file", "", path)
        if scheme == "pkg":
            module = rest.replace("/", ".")
            try:
                spec = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                spec = None
            if spec is None:
                raise ConfigError(f"hydra.searchpath: package {module!r} ({path}) is not importable; install the "
                                  "plug-in or add its folder to PYTHONPATH")
        elif scheme == "file" and not Path(rest).expanduser().is_dir():
            raise ConfigError(f"hydra.searchpath: {path!r} is not a folder")


# ------------------------------------------------------------------------------------------ expansion


def _parser(conf_dir: str, paths: tuple[str, ...]) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create(config_loader=config_loader(conf_dir, paths))


def parse_overrides(lines: list[str], conf_dir: str, paths: tuple[str, ...]) -> list[Any]:
    from hydra.errors import HydraException

    try:
        return _parser(conf_dir, paths).parse_overrides(lines)
    except HydraException as error:
        raise ConfigError(" ".join(str(error).split())) from None


def expand_globs(overrides: list[str], conf_dir: str | Path, paths: tuple[str, ...] = ()) -> list[str]:
    """``group=glob(...)`` -> ``group=a,b,c`` (the group's options that match, schemas excluded)."""
    out = []
    for override in overrides:
        key, _, value = override.partition("=")
        if not value.strip().startswith("glob(") or key.startswith(HYDRA_KEYS):
            out.append(override)
            continue
        (parsed,) = parse_overrides([override], str(conf_dir), paths)
        group = parsed.key_or_group
        valid = set(options(conf_dir, group, paths)) if paths else set(options(conf_dir, group))
        matched = [name for name in parsed.sweep_string_iterator() if name in valid]
        if not matched:
            raise ConfigError(f"{override} matches no option of {group}; choose from: {', '.join(sorted(valid))}")
        out.append(f"{key}={','.join(matched)}")
    return out


def is_interval(override: str) -> bool:
    return "interval(" in override.partition("=")[2]


def expand_jobs(params: dict[str, Any], task_overrides: list[str], conf_dir: str | Path,
                paths: tuple[str, ...] = ()) -> list[list[str]]:
    """The jobs Hydra's basic sweeper launches: ``params`` (``hydra.sweeper.params``) then the command line's
    task overrides (a key on both: the command line's values, in the params' position), crossed."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    lines = [f"{key}={value}" for key, value in (params or {}).items()] + list(task_overrides)
    for line in lines:
        if is_interval(line):
            raise ConfigError(f"{line}: interval() is sampled by a search sweeper, not enumerated; use "
                              "hydra/sweeper=optuna (e.g. +hparams_search=lr_kl), or list the values: a,b,c")
    parsed = parse_overrides(lines, str(conf_dir), paths)
    (jobs,) = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for job in jobs]


def sweeper_params(hydra_cfg: Any) -> dict[str, Any] | None:
    """``hydra.sweeper.params`` of the basic sweeper as flat ``key -> text``; None for another sweeper."""
    if hydra_cfg is None:
        return {}
    target = str(OmegaConf.select(hydra_cfg, "hydra.sweeper._target_", default="") or "")
    if target and target != BASIC_SWEEPER:
        return None
    params = OmegaConf.select(hydra_cfg, "hydra.sweeper.params")
    if params is None:
        return {}
    return {str(key): str(value) for key, value in OmegaConf.to_container(params, resolve=False).items()}


def jobs_run_here(hydra_cfg: Any) -> bool:
    """Whether a sweep's jobs run on this machine (Hydra's basic launcher, in this process; joblib's, in its local
    workers), so that its memory is theirs; not Ray's or SLURM's. ``hydra_cfg``: Hydra's own composed config, None
    where the command line picks no launcher."""
    if hydra_cfg is None:
        return True
    target = OmegaConf.select(hydra_cfg, "hydra.launcher._target_", default="")
    return not target or target in LOCAL_LAUNCHERS


def describe_job(number: int, total: int, job: list[str]) -> str:
    return f"sweep job {number} of {total} ({' '.join(job)})"


def check_jobs(jobs: list[list[str]], compose_job: Callable[[list[str]], Any],
               extra: list[str] = ()) -> list[tuple[list[str], Any]]:
    """Compose and validate every job (``compose_job(overrides)``); one line naming the first bad job. Returns each
    distinct job with its config."""
    seen: set[tuple[str, ...]] = set()
    composed = []
    for number, job in enumerate(jobs):
        key = tuple(job)
        if key in seen:
            continue
        seen.add(key)
        try:
            composed.append((job, compose_job([*job, *extra])))
        except ConfigError as error:
            if len(jobs) == 1:
                raise
            raise ConfigError(f"{describe_job(number, len(jobs), job)}: {error}") from None
    return composed


GROUPS = ("algorithm", "kl", "reward", "model", "data", "logger", "hardware", "generation", "env", "experiment",
          "hparams_search")


def group_options(group: str, paths: tuple[str, ...] = ()) -> list[str]:
    """The YAML options of a config group (its schemas, ``*_schema`` in the ConfigStore, are not options), with
    those of the user's search path (``hydra.searchpath=[pkg://my_pkg.conf]``, ``--config-dir``)."""
    return options(CONF_DIR, group, paths)
