"""Command line: ``rlhf-lab [hydra overrides]`` trains; ``rlhf-lab report|bench ...`` are sub-commands.

Before Hydra runs, the command line is composed once with Hydra's compose API and validated, so a
typo in a key, an unknown option or an out-of-range value stops the run at once with a one-line
message (exit status 2) instead of a traceback after the model has loaded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
GROUPS = ("algorithm", "kl", "reward", "model", "data", "logger", "experiment")
SUBCOMMANDS = ("report", "bench")


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


def _split_sweep(value: str) -> list[str]:
    """The choices of a simple sweep value ``a,b,c`` (brackets and function syntax are left to Hydra)."""
    if any(ch in value for ch in "[](){}"):
        return [value]
    return [v.strip() for v in value.split(",")]


def group_options(group: str) -> list[str]:
    folder = CONF_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def check_overrides(overrides: list[str]) -> list[str]:
    """Reject unknown group options with the valid list; return the first job's overrides (sweeps -> first)."""
    first_job = []
    for override in overrides:
        if "=" not in override:
            first_job.append(override)
            continue
        key, value = override.split("=", 1)
        group = key.lstrip("+~")
        choices = _split_sweep(value)
        if group in GROUPS:
            valid = group_options(group)
            for choice in choices:
                if choice not in valid:
                    raise UserError(f"{group}={choice!r} is not an option; choose from: {', '.join(valid)}")
        first_job.append(f"{key}={choices[0]}")
    return first_job


def compose_and_validate(overrides: list[str]) -> Any:
    """Compose the config a job would get and validate it; UserError (one line) on any mistake."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rlhf_lab.config import ConfigError, register_configs, validate

    register_configs()
    job_overrides = [o for o in check_overrides(overrides) if not o.startswith(("hydra.", "hydra/", "+hydra"))]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=job_overrides)
        validate(cfg)
    except ConfigError as error:
        raise UserError(str(error)) from None
    except (HydraException, OmegaConfBaseException) as error:
        raise UserError(_one_line(error)) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def _one_line(error: Exception) -> str:
    """Hydra/OmegaConf messages span lines; keep the informative ones joined into one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    keep = [line for line in lines if not line.startswith(("full_key:", "object_type=", "reference_type="))]
    message = "; ".join(keep[:3])
    if "Key '" in message and "not in" in message:
        message = message.replace("Could not override", "unknown key in override")
    return message


def _is_user_flag(arg: str) -> bool:
    return arg.startswith("-")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        _run_subcommand(argv[0], argv[1:])
        return
    flags_with_values = {"--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--experimental-rerun"}
    overrides, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in flags_with_values:
            skip = True
            continue
        if not _is_user_flag(arg):
            overrides.append(arg)
    informational = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--version"}
    if not informational.intersection(argv):
        try:
            compose_and_validate(overrides)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
    os.environ.setdefault("HF_HUB_OFFLINE", "0")
    sys.argv = [sys.argv[0], *argv]
    _hydra_entry()


def _hydra_entry() -> None:
    import hydra

    from rlhf_lab.config import register_configs

    register_configs()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def run(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        from rlhf_lab.trainer import Trainer, TrainingStopped

        run_dir = Path(cfg.trainer.output_dir or HydraConfig.get().runtime.output_dir)
        try:
            return Trainer(cfg, run_dir).train()
        except TrainingStopped:
            sys.exit(3)

    run()


def _run_subcommand(name: str, args: list[str]) -> None:
    if name == "report":
        from rlhf_lab.report import main as report_main

        report_main(args)
    elif name == "bench":
        from rlhf_lab.bench import main as bench_main

        bench_main(args)
