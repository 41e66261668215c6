"""What a W&B run is called and where it goes: the mode (online only with an API key, never a prompt), the run's
group, name, tags, job type and id, and the flat config keys the dashboard groups by (:mod:`rlhf_lab.trackers.wandb`).

A run folder remembers its W&B run in ``wandb_run.json`` (id, project, group, name): a resumed run continues it
and ``rlhf-lab eval RUN`` links its evaluation to it. Under ``wandb agent`` (a W&B sweep) the agent's run id is
the run's id.
"""

from __future__ import annotations

import contextlib
import json
import netrc
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rlhf_lab.app.job_folders import read_swept_keys

DEFAULT_BASE_URL = "https://api.wandb.ai"


MODES = ("auto", "online", "offline", "disabled")
STAGE_JOB_TYPES = ("sft", "dpo", "reward_model")  # algorithm names that are their own stage on the dashboard
RUN_FILE = "wandb_run.json"


def _netrc_path(environ: Mapping[str, str]) -> Path:
    """The netrc file W&B reads: ``$NETRC``, else ``~/.netrc`` (``~/_netrc`` if only that exists)."""
    if environ.get("NETRC"):
        return Path(environ["NETRC"]).expanduser()
    unix, windows = Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()
    return windows if windows.exists() and not unix.exists() else unix


def has_api_key(environ: Mapping[str, str] | None = None) -> bool:
    """Whether W&B credentials are configured: env var, identity token file or netrc entry for the host."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).hostname
    try:
        entry = netrc.netrc(str(_netrc_path(environ))).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def resolve_mode(requested: str, environ: Mapping[str, str] | None = None) -> str:
    """``logger.mode`` -> the W&B mode to use: online | offline | disabled.

    ``auto`` follows ``WANDB_MODE=offline|disabled`` when set, else is online with an API key and
    offline without one. A forced mode is returned as is (online without a key is handled by the tracker).
    """
    if requested not in MODES:
        raise ValueError(f"logger.mode={requested!r} is not valid; choose from: {', '.join(MODES)}")
    if requested != "auto":
        return requested
    environ = os.environ if environ is None else environ
    env_mode = environ.get("WANDB_MODE", "").strip().lower()
    if env_mode in ("offline", "dryrun"):
        return "offline"
    if env_mode == "disabled" or environ.get("WANDB_DISABLED", "").strip().lower() in ("true", "1"):
        return "disabled"
    return "online" if has_api_key(environ) else "offline"


@dataclass
class RunIdentity:
    """How a run appears on the dashboard."""

    group: str
    name: str
    tags: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)  # the job's task overrides, as typed
    sweep_dir: str | None = None
    choices: dict[str, str] = field(default_factory=dict)  # config group -> option (algorithm -> rloo)


def _hydra_config() -> Any | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get() if HydraConfig.initialized() else None
    except Exception:  # Hydra missing or not running this job
        return None


def run_identity(experiment_name: str, run_dir: Path, hydra_cfg: Any | None = None) -> RunIdentity:
    """Group, name and tags for this run from Hydra's runtime config (see the module docstring)."""
    hydra_cfg = _hydra_config() if hydra_cfg is None else hydra_cfg
    if hydra_cfg is None:  # constructed outside a Hydra app (tests, notebooks)
        return RunIdentity(group=experiment_name, name=Path(run_dir).name)

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    overrides = [str(line) for line in hydra_cfg.overrides.task]
    excluded = set(hydra_cfg.job.config.override_dirname.exclude_keys)
    parsed = [o for o in OverridesParser.create().parse_overrides(overrides) if o.key_or_group not in excluded]
    override_dirname = str(hydra_cfg.job.override_dirname)
    choices = {
        str(group): str(option)
        for group, option in hydra_cfg.runtime.choices.items()
        if option is not None and not str(group).startswith("hydra/") and group != "schema"
    }
    if hydra_cfg.mode != RunMode.MULTIRUN:
        tags = sorted(tag(o) for o in parsed if o.key_or_group in choices)  # the options chosen, not every setting
        name = override_dirname or Path(run_dir).name
        return RunIdentity(single_run_group(experiment_name, choices), name, tags, overrides, choices=choices)

    try:
        sweep_dir = Path(str(hydra_cfg.sweep.dir))
    except Exception:  # an interpolation that cannot resolve here: the job folder's parent is the sweep
        sweep_dir = Path(str(hydra_cfg.runtime.output_dir)).parent
    swept = read_swept_keys(str(sweep_dir))
    lines = sorted(tag(o) for o in parsed if swept is None or o.key_or_group in swept)
    name = ",".join(lines) or override_dirname or f"job{hydra_cfg.job.num}"
    group = f"{experiment_name}-{sweep_dir.name}"
    return RunIdentity(group, name, lines, overrides, str(sweep_dir.resolve()), choices)


def tag(override: Any) -> str:
    """``key=value`` of a parsed Hydra override as the dashboard shows it: no ``+``/``~``/``++`` prefix, floats
    in at most 6 significant digits (a swept ``0.30000000000000004`` is ``0.3``)."""
    value = override.value()
    text = f"{value:.6g}" if isinstance(value, float) else override.get_value_element_as_str()
    return f"{override.key_or_group}={text}"


def single_run_group(experiment_name: str, choices: Mapping[str, str],
                     environ: Mapping[str, str] | None = None) -> str:
    """A single run's group: its experiment; under ``wandb agent`` the sweep; else its algorithm and KL options
    (``grpo-k3``), so seeds and reruns of one arm group together."""
    environ = os.environ if environ is None else environ
    if experiment_name != "default":
        return experiment_name
    if environ.get("WANDB_SWEEP_ID"):
        return f"sweep-{environ['WANDB_SWEEP_ID']}"
    arm = [choices[group] for group in ("algorithm", "kl") if choices.get(group)]
    return "-".join(arm) or experiment_name


def job_type(requested: str | None, config: Mapping[str, Any]) -> str:
    """``logger.job_type``, else the stage: ``eval`` for ``rlhf-lab eval``, ``sft``/``dpo``/``reward_model`` for
    the offline algorithms, ``train`` for RL."""
    if requested:
        return str(requested)
    if config.get("evaluates"):
        return "eval"
    algorithm = config.get("algorithm")
    name = algorithm.get("name") if isinstance(algorithm, Mapping) else None
    return str(name) if name in STAGE_JOB_TYPES else "train"


def dashboard_config(config: dict[str, Any], run_dir: Path, identity: RunIdentity) -> dict[str, Any]:
    """The resolved config plus flat keys the W&B UI can group runs by.

    ``<group>_name`` is the option chosen on the command line (``algorithm=rloo`` gives ``rloo`` even though
    that option's ``algorithm.name`` is ``reinforce``), else the config's ``name``.
    """

    def pick(section: str, key: str) -> Any:
        value = config.get(section)
        return value.get(key) if isinstance(value, dict) else None

    def option(group: str) -> Any:
        return identity.choices.get(group) or pick(group, "name")

    flat = {
        "algorithm_name": option("algorithm"),
        "kl_name": option("kl"),
        "kl_placement": pick("kl", "placement"),
        "kl_coef": pick("kl", "coef"),
        "reward_name": option("reward"),
        "model_name": option("model"),
        "experiment": identity.choices.get("experiment"),
        "run_dir": str(Path(run_dir).resolve()),
        "overrides": identity.overrides,
    }
    return {**config, **flat}


def short_name(name: str, limit: int = 128) -> str:
    """A run name of at most ``limit`` characters (a long override list ends in a hash of the whole)."""
    if len(name) <= limit:
        return name
    import hashlib

    return f"{name[: limit - 9]}~{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def run_id(run_dir: Path, resuming: bool, environ: Mapping[str, str] | None = None) -> str:
    """This run folder's W&B run id: the agent's under ``wandb agent`` (``WANDB_SWEEP_ID`` and ``WANDB_RUN_ID``
    set), the stored one when the run resumes from its checkpoint, else a new one."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_SWEEP_ID") and environ.get("WANDB_RUN_ID"):
        return environ["WANDB_RUN_ID"]
    stored = stored_run(run_dir)
    if resuming and stored.get("id"):
        return str(stored["id"])
    return secrets.token_hex(4)


def stored_run(run_dir: Path) -> dict[str, Any]:
    """What ``<run folder>/wandb_run.json`` says about the folder's W&B run ({} when nothing readable)."""
    with contextlib.suppress(ValueError, OSError):
        stored = json.loads((Path(run_dir) / RUN_FILE).read_text())
        return stored if isinstance(stored, dict) else {}
    return {}


def remember_run(run_dir: Path, init_kwargs: Mapping[str, Any]) -> None:
    """Keep the run's id, project, group and name beside ``checkpoints/`` (read by resume and ``rlhf-lab eval``)."""
    keys = ("id", "project", "entity", "group", "name", "job_type")
    path = Path(run_dir) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({key: init_kwargs.get(key) for key in keys}))


def _git_settings(start: Path) -> dict[str, Any]:
    """Point W&B at the code's git checkout (the run folder may be outside it), or turn git lookup off."""
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return {"git_root": str(folder)}
    return {"disable_git": True}
