"""``compose(overrides)``: the config a job gets, composed with Hydra's compose API and validated.

The CLI (before Hydra starts), ``rlhf-lab bench``, the tests and the golden-record script all call this
one function, so a typo in a key, an unknown option or an out-of-range value fails the same way
everywhere: a one-line :class:`~rlhf_lab.errors.ConfigError` naming the key and what it accepts.
The Hydra tree is ``CONF_DIR`` (:mod:`.conf_dir`): ``conf/`` in a checkout, ``rlhf_lab/conf`` in an installed wheel.
A command line that picks a launcher, a sweeper or a search (``hydra/launcher=ray``, ``+hparams_search=NAME``,
``experiment=NAME``) also has Hydra's own config composed and checked (:mod:`.validate_sweep`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from typing import Any

from omegaconf import DictConfig

import rlhf_lab.config.schema_offline  # noqa: F401  (the offline stages' schemas join OPTION_SCHEMAS)
from rlhf_lab.app.plugins import load_plugins, plugins_in_overrides
from rlhf_lab.config.claims import check_claims
from rlhf_lab.config.conf_dir import CONF_DIR
from rlhf_lab.config.objective import check_objective
from rlhf_lab.config.overrides import normalize_overrides
from rlhf_lab.config.schema import register_configs
from rlhf_lab.config.suggest import did_you_mean
from rlhf_lab.config.sweep_arms import identical_arms
from rlhf_lab.config.sweep_jobs import (  # noqa: F401  (GROUPS, group_options: compose's names too)
    GROUPS,
    check_jobs,
    check_search_paths,
    expand_jobs,
    group_options,
    jobs_run_here,
    search_paths,
    searchpath_override,
    sweeper_params,
)
from rlhf_lab.config.validate import validate
from rlhf_lab.config.validate_keys import field_types, schema_at, type_name, unknown_key_message
from rlhf_lab.config.validate_sweep import (
    check_plugin_targets,
    check_plugins,
    check_search_space,
    check_study,
    plugin_error,
    sweep_values,
)
from rlhf_lab.errors import ConfigError

HYDRA_PREFIXES = ("hydra.", "hydra/", "+hydra", "++hydra")
# Overrides that can change the launcher or the sweeper: composing Hydra's own config checks them.
SWEEP_SETTINGS = (*HYDRA_PREFIXES, "experiment=", "+experiment=", "hparams_search=", "+hparams_search=")


def _split_sweep(override: str, value: str) -> list[str]:
    """The values of a sweep (``a,b,c``, ``choice(...)``, ``range(...)``; an ``interval``'s lower bound), parsed
    by Hydra's override grammar; a plain value as typed."""
    values = sweep_values(override)
    if values is not None:
        return values
    if any(ch in value for ch in "[](){}'\"") or "," not in value:
        return [value]
    return [v.strip() for v in value.split(",")]


def check_deletion(override: str) -> None:
    """``~section`` of a section every run reads (``~trainer``, ``~eval``) is one line naming it; Hydra would report a
    key of it as missing later."""
    from dataclasses import fields

    from rlhf_lab.config.schema import Config

    key = override.partition("=")[0]
    name = key.removeprefix("~")
    sections = [field.name for field in fields(Config) if field.name not in GROUPS]
    if key.startswith("~") and "." not in name and name in sections:
        raise ConfigError(f"{override} removes {name} from the config, and every run reads it; remove or set one of "
                          f"its keys instead (~{name}.KEY, {name}.KEY=VALUE)")


def check_overrides(overrides: list[str]) -> list[str]:
    """Reject unknown group options with the valid list; return the first job's overrides (sweeps -> first)."""
    first_job = []
    paths = search_paths(overrides)
    for override in overrides:
        check_deletion(override)
        if "=" not in override:
            first_job.append(override)
            continue
        key, value = override.split("=", 1)
        group = key.lstrip("+~")
        if key.startswith(HYDRA_PREFIXES):
            if key.startswith(("hydra.", "+hydra.", "++hydra.")) and sweep_values(override) is not None:
                raise ConfigError(f"{override} is a sweep over Hydra's own config; quote the value for Hydra, "
                                  f"in the shell: \"{key}='{value}'\"")
            first_job.append(override)
            continue
        if group in GROUPS and value.startswith("[") and value.endswith("]"):  # logger=[wandb,csv]: all of them
            valid = group_options(group, paths)
            for choice in (part.strip() for part in value[1:-1].split(",") if part.strip()):
                if choice not in valid:
                    raise ConfigError(f"{group}={choice!r} is not an option; {did_you_mean(choice, valid)}"
                                      f"choose from: {', '.join(valid)}")
            first_job.append(override)
            continue
        choices = _split_sweep(override, value)
        if group in GROUPS:
            valid = group_options(group, paths)
            for choice in choices:
                if choice not in valid:
                    raise ConfigError(f"{group}={choice!r} is not an option; {did_you_mean(choice, valid)}"
                                      f"choose from: {', '.join(valid)}")
        first_job.append(f"{key}={choices[0]}")
    return first_job


def _hydra_compose(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides),
                                 return_hydra_config=return_hydra_config)
    finally:
        GlobalHydra.instance().clear()


def compose(overrides: list[str], pending_paths: Collection[str] = (), study: bool = True,
            announce: Callable[[int], None] | None = None,
            check_job: Callable[[DictConfig], None] | None = None) -> DictConfig:
    """Compose the config a job would get (a sweep's first values) and validate it.

    ``pending_paths``: folders the config names that an earlier stage writes (``rlhf-lab pipeline`` checks every
    stage before the first runs); they are not checked for existence. ``study=False``: an Optuna search's stored
    study is not opened (a command that only reads the search space: ``rlhf-lab wandb sweep``). ``announce(jobs)``:
    called once the first job checked out, before the sweep's other jobs are (they can take minutes).
    ``check_job(cfg)``: called on each job's config of a sweep whose jobs run in this process (``rlhf-lab`` passes
    :func:`rlhf_lab.training.sweep_memory.held_state_check`), its ``ConfigError`` naming the job. Raises
    :class:`ConfigError` (a ``UserError``), one line, on any mistake.
    """
    overrides = normalize_overrides(list(overrides))
    paths = search_paths(overrides)
    check_search_paths(CONF_DIR, paths)
    load_plugins(plugins_in_overrides(overrides))  # entry points and plugins=[...]: their parts and schemas
    check_plugins(overrides, CONF_DIR)  # hydra/launcher=ray without ray: what to install, before Hydra needs it
    first_job = check_overrides(overrides)
    job_overrides = [o for o in first_job if not o.startswith(HYDRA_PREFIXES)] + searchpath_override(paths)
    cfg = _compose_job(job_overrides, pending_paths)
    hydra_cfg = None
    if any(o.startswith(SWEEP_SETTINGS) for o in overrides):
        hydra_cfg = check_sweep(first_job, job_overrides, cfg)
        if study:
            check_study(hydra_cfg, [o for o in overrides if not o.startswith(HYDRA_PREFIXES)])
    params = sweeper_params(hydra_cfg)
    if params is not None:  # the basic sweeper: every job it would launch, composed and validated now
        task = [o for o in overrides if "=" in o and not o.startswith(HYDRA_PREFIXES)]
        jobs = expand_jobs(params, task, CONF_DIR, paths)
        if params and cfg.get("claims"):  # the claims' arms (the experiment's grid) and seeds (these jobs)
            check_claims(cfg.claims, expand_jobs(params, [], CONF_DIR, paths), cfg, jobs)
        if len(jobs) > 1:
            if announce is not None:
                announce(len(jobs))
            check = check_job if check_job is not None and jobs_run_here(hydra_cfg) else None
            composed = check_jobs(jobs, lambda job: _compose_job(check_overrides(job), check=check),
                                  searchpath_override(paths))
            for line in identical_arms(composed):  # arms the comparison cannot tell apart (config/sweep_arms.py)
                warnings.warn(line, stacklevel=2)
    return cfg


def _compose_job(job_overrides: list[str], pending_paths: Collection[str] = (),
                 check: Callable[[DictConfig], None] | None = None) -> DictConfig:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = _hydra_compose(job_overrides)
        validate(cfg, pending_paths)
        check_objective(cfg)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(one_line(error, job_overrides)) from None
    if check is not None:
        check(cfg)
    return cfg


def check_sweep(first_job: list[str], job_overrides: list[str], cfg: DictConfig) -> DictConfig:
    """Compose Hydra's own config too (launcher, sweeper, search space) and check what the sweep would run;
    returns it."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        hydra_cfg = _hydra_compose(first_job, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as error:
        raise (plugin_error(error, CONF_DIR) or ConfigError(one_line(error, first_job))) from None
    check_plugin_targets(hydra_cfg)
    groups = {group: group_options(group, search_paths(first_job)) for group in GROUPS}
    check_search_space(hydra_cfg, cfg, groups, _compose_job, job_overrides)
    return hydra_cfg


def one_line(error: Exception, overrides: list[str] = ()) -> str:
    """Hydra/OmegaConf messages span lines; say in one which key is wrong and what it accepts."""
    from hydra.errors import OverrideParseException

    if isinstance(error, OverrideParseException):  # a character Hydra's override grammar does not take unquoted
        key, _, value = error.override.partition("=")
        from hydra.core.override_parser.overrides_parser import OverridesParser

        try:  # Hydra's parser alone names the character (the composed error shows a caret on another line)
            OverridesParser.create().parse_override(error.override)
            reason = "a character it does not take unquoted"
        except Exception as parse_error:
            reason = str(parse_error).splitlines()[0]
        return (f"{error.override!r} is not an override Hydra's grammar reads ({reason}); quote the value, in the "
                f"shell: \"{key}='{value}'\"")
    cause = error.__cause__ if error.__cause__ is not None else error
    full_key = getattr(cause, "full_key", None)
    message = _key_message(cause, full_key, list(overrides)) if full_key else None
    if message is not None:
        return message
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    keep = [line for line in lines if not line.startswith(("full_key:", "object_type=", "reference_type="))]
    message = "; ".join(keep[:3])
    if "Key '" in message and "not in" in message:
        message = message.replace("Could not override", "unknown key in override")
    return message


def _key_message(cause: Exception, full_key: str, overrides: list[str]) -> str | None:
    """An unknown key or a wrong type, described against the schema of the option the job selected.

    The option schemas come from composing only the group selections (``algorithm=ppo``,
    ``experiment=smoke``); without them (that fails too), the root schema's declared types.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    selections = [o for o in overrides if "=" in o and o.split("=", 1)[0].lstrip("+~") in GROUPS]
    try:
        base: Any = _hydra_compose(selections)
    except (HydraException, OmegaConfBaseException):
        base = None
    parent, _, last = full_key.rpartition(".")
    schema = schema_at(base, parent)
    if schema is None:
        return None
    hints = field_types(schema)
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and last not in hints:
        return unknown_key_message(base, full_key, schema)
    if isinstance(cause, ValidationError) and last in hints:
        return f"{full_key}={cause.value!r} has the wrong type; expected {type_name(hints[last])}"
    return None
