"""Command line: ``rlhf-lab [hydra overrides]`` trains; ``rlhf-lab report|bench ...`` are sub-commands.

Before Hydra runs, the command line is composed once with Hydra's compose API and validated, so a
typo in a key, an unknown option or an out-of-range value stops the run at once with a one-line
message (exit status 2) instead of a traceback after the model has loaded.

Exit status: 0 done; 2 a user error (config, data, reward, checkpoint), one line on stderr; 3 stopped after
``trainer.max_consecutive_skips`` non-finite updates; 128 + N stopped by signal N (130 Ctrl-C, 143
SIGTERM) after finishing the step and writing a checkpoint. A stopped run prints the command that
continues it. A run with ``trainer.output_dir`` (or resumed from a path inside an earlier run folder) keeps
everything, Hydra's ``.hydra/`` included, in that one folder, so ``trainer.resume=auto`` finds its
checkpoints again.
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


def _schema_field(full_key: str) -> tuple[Any, str] | None:
    """(dataclass holding ``full_key``'s parent, last key) in the structured schema, or None if not in it."""
    import dataclasses
    import typing

    from rlhf_lab.config import Config

    node: Any = Config
    *parents, last = full_key.split(".")
    for part in parents:
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return None
        node = hints[part]
    return node, last


def _one_line(error: Exception) -> str:
    """Hydra/OmegaConf messages span lines; say in one which key is wrong and what it accepts."""
    import typing

    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = error.__cause__ if error.__cause__ is not None else error
    full_key = getattr(cause, "full_key", None)
    found = _schema_field(full_key) if full_key else None
    if found is not None:
        node, last = found
        hints = typing.get_type_hints(node)
        parent = full_key.rpartition(".")[0]
        if isinstance(cause, ConfigAttributeError | ConfigKeyError) and last not in hints:
            where = f" of {parent}" if parent else ""
            return f"unknown key {full_key!r}; valid keys{where}: {', '.join(hints)}"
        if isinstance(cause, ValidationError) and last in hints:
            expected = hints[last]
            expected = expected.__name__ if isinstance(expected, type) else str(expected).replace("typing.", "")
            return f"{full_key}={cause.value!r} has the wrong type; expected {expected}"
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
    if "" not in sys.path and os.getcwd() not in sys.path:
        # `python -m rlhf_lab` can import a reward module from the working folder; the console script too
        # (appended, so a file there never shadows an installed package).
        sys.path.append(os.getcwd())
    informational = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--version"}
    if not informational.intersection(argv):
        try:
            cfg = compose_and_validate(overrides)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        argv += _run_dir_override(cfg, argv, overrides)
    os.environ.setdefault("HF_HUB_OFFLINE", "0")
    sys.argv = [sys.argv[0], *argv]
    _hydra_entry()


def run_folder(cfg: Any) -> Path | None:
    """The run folder a config names itself: ``trainer.output_dir``, else the run a resume path belongs to.

    So ``trainer.resume=outputs/X/2025-01-01_12-00-00`` (or its ``checkpoints/step_N``) continues that run
    in its own folder, appending to its metrics, without also giving ``trainer.output_dir``.
    """
    from rlhf_lab.checkpoint import run_folder_of

    if cfg.trainer.output_dir:
        return Path(cfg.trainer.output_dir)
    if cfg.trainer.resume and cfg.trainer.resume != "auto":
        return run_folder_of(cfg.trainer.resume)
    return None


def _run_dir_override(cfg: Any, argv: list[str], overrides: list[str]) -> list[str]:
    """``hydra.run.dir=<run folder>`` for a single run with its own folder, so Hydra's files land there too."""
    folder = run_folder(cfg)
    multirun = {"-m", "--multirun"}.intersection(argv)
    if folder is None or multirun or any(o.startswith(("hydra.run.dir=", "+hydra.run.dir=")) for o in overrides):
        return []
    path = str(folder.expanduser().resolve())
    if "'" in path or "\\" in path:
        return []  # not expressible as a quoted Hydra value; Hydra keeps its own folder for its files
    return [f"hydra.run.dir='{path}'"]


def resume_command(task_overrides: list[str], resume_overrides: tuple[str, ...]) -> str:
    """The command line that continues a stopped run: its overrides, with resume and folder replaced."""
    import shlex

    replaced = ("trainer.resume=", "trainer.output_dir=", "+trainer.resume=", "+trainer.output_dir=")
    kept = [o for o in task_overrides if not o.startswith(replaced)]
    program = "rlhf-lab" if Path(sys.argv[0]).name == "rlhf-lab" else "python -m rlhf_lab"
    return " ".join([program, *map(shlex.quote, [*kept, *resume_overrides])])


def _hydra_entry() -> None:
    import hydra

    from rlhf_lab.config import register_configs

    register_configs()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def run(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        from rlhf_lab.checkpoint import CheckpointError
        from rlhf_lab.config import ConfigError, validate
        from rlhf_lab.data import DataError
        from rlhf_lab.registry import RegistryError
        from rlhf_lab.rewards.base import RewardError
        from rlhf_lab.trainer import Trainer, TrainingStopped

        # Mistakes in the user's data, reward or checkpoint found once the run started: one line, no
        # traceback, exit status 2 (as for config errors); RLHF_LAB_TRACEBACK=1 shows the traceback (e.g. to
        # debug a reward function). Anything else is a bug and keeps its traceback.
        user_errors = (ConfigError, DataError, RewardError, CheckpointError, RegistryError)
        run_dir = run_folder(cfg) or Path(HydraConfig.get().runtime.output_dir)
        try:
            validate(cfg)  # every job of a sweep; only the first was checked before Hydra started
            return Trainer(cfg, run_dir).train()
        except user_errors as error:
            if os.environ.get("RLHF_LAB_TRACEBACK", "") not in ("", "0"):
                raise
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        except TrainingStopped as stop:
            task = list(HydraConfig.get().overrides.task)
            print(f"{stop}\nto resume, run: {resume_command(task, stop.resume_overrides)}", file=sys.stderr,
                  flush=True)
            sys.exit(stop.exit_code)
        except KeyboardInterrupt:
            print("interrupted without writing a checkpoint; resume from the last one with "
                  f"trainer.resume=auto trainer.output_dir={run_dir.resolve()}", file=sys.stderr, flush=True)
            sys.exit(130)

    run()


def _run_subcommand(name: str, args: list[str]) -> None:
    if name == "report":
        from rlhf_lab.report import main as report_main

        report_main(args)
    elif name == "bench":
        from rlhf_lab.bench import main as bench_main

        bench_main(args)
