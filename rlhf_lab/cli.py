"""Command line: ``rlhf-lab [hydra overrides]`` trains; ``rlhf-lab report|bench ...`` are sub-commands.

Before Hydra runs, the command line is composed once and validated (:func:`rlhf_lab.config.compose`), so a
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

from rlhf_lab.errors import UserError

SUBCOMMANDS = ("report", "bench")


def _is_user_flag(arg: str) -> bool:
    return arg.startswith("-")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        _run_subcommand(argv[0], argv[1:])
        return
    from rlhf_lab.config.compose import compose, normalize_overrides  # loads every part: not for sub-commands

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
    argv = normalize_overrides(argv)  # `+experiment=NAME` selects the experiment as `experiment=NAME` does
    if "" not in sys.path and os.getcwd() not in sys.path:
        # `python -m rlhf_lab` can import a reward module from the working folder; the console script too
        # (appended, so a file there never shadows an installed package).
        sys.path.append(os.getcwd())
    informational = {"--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--resolve", "--version"}
    if not informational.intersection(argv):
        try:
            cfg = compose(overrides)
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
    from rlhf_lab.training.checkpoint import run_folder_of

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

    from rlhf_lab.config import CONF_DIR, register_configs

    register_configs()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def run(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        from rlhf_lab.config import validate
        from rlhf_lab.config.objective import objective
        from rlhf_lab.errors import TrainingStopped, UserError
        from rlhf_lab.training import run as train

        # Mistakes in the user's config, data, reward or checkpoint found once the run started: one line, no
        # traceback, exit status 2 (as for config errors); RLHF_LAB_TRACEBACK=1 shows the traceback (e.g. to
        # debug a reward function). Anything else is a bug and keeps its traceback.
        run_dir = run_folder(cfg) or Path(HydraConfig.get().runtime.output_dir)
        try:
            validate(cfg)  # every job of a sweep; only the first was checked before Hydra started
            summary = train(cfg, run_dir)
            # A hyperparameter search (hydra/sweeper=optuna) gets one number: the summary's optimized_metric.
            return objective(summary, cfg) if cfg.get("optimized_metric") else summary
        except UserError as error:
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
        from rlhf_lab.tools.report import main as report_main

        report_main(args)
    elif name == "bench":
        from rlhf_lab.tools.bench import main as bench_main

        bench_main(args)
