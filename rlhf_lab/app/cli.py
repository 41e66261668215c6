"""Command line: ``rlhf-lab [hydra overrides]`` trains; ``rlhf-lab report|bench|launch ...`` are sub-commands.

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
import signal
import sys
from pathlib import Path
from typing import Any

import rlhf_lab.app.job_folders  # noqa: F401  (the job-folder label resolver, needed in every job process too)
from rlhf_lab.app.help_text import program_in_shell, resume_command  # noqa: F401  (the CLI's names)
from rlhf_lab.errors import UserError

SUBCOMMANDS = ("report", "bench", "export", "eval", "pipeline", "serve", "wandb", "plan", "launch")


def _is_user_flag(arg: str) -> bool:
    return arg.startswith("-")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        print(version_line())
        return
    if argv and argv[0] in SUBCOMMANDS:
        _run_subcommand(argv[0], argv[1:])
        return
    _refuse_rerun(argv)
    from rlhf_lab.config.overrides import normalize_overrides

    flags_with_values = {"--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--experimental-rerun",
                         "--shell-completion", "-sc", "--cfg", "-c", "--package", "-p"}
    overrides, skip, config_dirs = [], False, []
    for index, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in flags_with_values:
            skip = True
            if arg in ("--config-dir", "-cd") and index + 1 < len(argv):
                config_dirs.append(argv[index + 1])
            continue
        if arg.startswith(("--config-dir=", "-cd=")):
            config_dirs.append(arg.split("=", 1)[1])
        elif not _is_user_flag(arg):
            overrides.append(arg)
    argv = normalize_overrides(argv)  # `+experiment=NAME` selects the experiment as `experiment=NAME` does
    if "" not in sys.path and os.getcwd() not in sys.path:
        # `python -m rlhf_lab` can import a reward module from the working folder; the console script too
        # (appended, so a file there never shadows an installed package).
        sys.path.append(os.getcwd())
    informational = {"--help", "-h", "--hydra-help", "--info", "-i", "--version", "--shell-completion", "-sc"}
    printing = {"--cfg", "-c", "--resolve"}  # print the config: checked first, as a run's is, but no run folder
    if not informational.intersection(argv):
        # loads every part: not for sub-commands nor --help
        from rlhf_lab.config.compose import CONF_DIR, compose
        from rlhf_lab.config.sweep_jobs import expand_globs, search_paths, with_config_dirs

        try:
            check_command_line(overrides)  # `=5`, a key given twice
            overrides = with_config_dirs(overrides, config_dirs)  # --config-dir DIR: on the search path, as Hydra does
            argv = expand_globs(argv, CONF_DIR, search_paths(overrides))  # kl=glob(*): the options, no schemas
            overrides = expand_globs(overrides, CONF_DIR, search_paths(overrides))
            from rlhf_lab.training.sweep_memory import held_state_check

            # A sweep's jobs are each composed and validated, and refused where their held memory cannot fit.
            checks = {} if printing.intersection(argv) else {"announce": announce_checks, "check_job": held_state_check()}
            cfg = compose(overrides, **checks)
            new_folder = None if printing.intersection(argv) else _claim_run_folder(cfg, argv, overrides)
        except UserError as error:
            from rlhf_lab.runtime.rank_output import report_error

            report_error(f"error: {error}")  # once per run: rank 0's (every rank composed the same command line)
            sys.exit(2)
        if not printing.intersection(argv):
            say_experiment_time(cfg, overrides)
            argv += new_folder or _run_dir_override(cfg, argv, overrides)
            argv += _rank_zero_writes_hydra_files(overrides)
    os.environ.setdefault("HF_HUB_OFFLINE", "0")
    if {"--shell-completion", "-sc"}.intersection(argv):
        from rlhf_lab.app.completion import hide_schemas

        hide_schemas()
    sys.argv = [sys.argv[0], *argv]
    _hydra_entry()


# Overrides that leave an experiment's measured time as it is: which experiment, how jobs launch, where logs go.
SAME_WORK = ("experiment=", "hydra/launcher=", "hydra.launcher.", "hydra.sweep.", "hydra.run.", "logger",
             "trainer.output_dir=", "trainer.progress_bar=", "trainer.save=")


def say_experiment_time(cfg: Any, overrides: list[str] = ()) -> None:
    """An experiment states what it costs when launched (``experiment_time``: measured, in its YAML), and that the
    time was measured for the experiment as written when the command line changes its work (fewer seeds, another
    model, more steps)."""
    from rlhf_lab.training.run_lock import is_rank_zero

    if not cfg.get("experiment_time") or not is_rank_zero():
        return
    changed = [o for o in overrides if not o.lstrip("+~").startswith(SAME_WORK)]
    note = (f", measured for the experiment as written; this launch changes {' '.join(changed)}, so its time differs"
            if changed else "")
    print(f"experiment={cfg.get('experiment_name')}: {cfg.get('experiment_time')}{note}", file=sys.stderr,
          flush=True)


def _refuse_rerun(argv: list[str]) -> None:
    """Hydra's ``--experimental-rerun FILE`` unpickles FILE; rlhf_lab never unpickles, so it is refused
    (argparse also takes any prefix of the flag, e.g. ``--exp``)."""
    flag = "--experimental-rerun"
    for arg in argv:
        name = arg.split("=", 1)[0]
        if len(name) >= 3 and flag.startswith(name):
            print(f"error: {name} is not supported (it would unpickle a file); re-run a job with the overrides "
                  "in its .hydra/overrides.yaml", file=sys.stderr)
            sys.exit(2)


def check_command_line(overrides: list[str]) -> None:
    """An override without a key (``=5``), or a key given twice (Hydra would silently keep the last)."""
    from rlhf_lab.errors import ConfigError

    seen: dict[str, str] = {}
    for override in overrides:
        key = override.split("=", 1)[0] if "=" in override else None
        if key is not None and not key.lstrip("+~"):
            raise ConfigError(f"{override!r} has no key; write KEY=VALUE (e.g. trainer.steps=5)")
        name = (key or override).lstrip("+~")
        if name in seen:
            raise ConfigError(f"{name} is given twice ({seen[name]} and {override}); give it once")
        seen[name] = override


def _claim_run_folder(cfg: Any, argv: list[str], overrides: list[str]) -> list[str]:
    """A folder the run names is checked (writable), locked and its resume checked before Hydra writes into it.

    A single run in Hydra's default folder (``outputs/<experiment_name>/<time>``) gets that folder created here,
    with ``_1``, ``_2``, ... appended when a run started in the same second took it, so two runs never share
    one; returned as the ``hydra.run.dir`` override that puts Hydra's files there too.
    """
    from rlhf_lab.training.resume_contract import claim_run_folder
    from rlhf_lab.training.run_lock import is_rank_zero, new_run_folder

    sweep = is_sweep(argv, overrides)
    hydra_settings = any(o.lstrip("+~").startswith("hydra") for o in overrides) or any(
        a.startswith(("-cn", "-cp", "-cd", "--config")) for a in argv)  # they may place the run elsewhere
    folder, extra = run_folder(cfg), []
    if folder is None and not sweep and not hydra_settings and is_rank_zero():
        folder = new_run_folder(Path("outputs") / str(cfg.experiment_name))
        extra = [f"hydra.run.dir='{folder}'"] if "'" not in str(folder) and "\\" not in str(folder) else []
        if not extra:
            return []
    claim_run_folder(cfg, folder, single_run=not sweep)
    return extra


def is_sweep(argv: list[str], overrides: list[str]) -> bool:
    """Whether the command line may launch a sweep (``-m``, an experiment or search, Hydra's mode or sweeper)."""
    return bool({"-m", "--multirun"}.intersection(argv)) or any(
        o.lstrip("+").startswith(("experiment=", "hparams_search=", "hydra.mode=", "hydra/sweeper=")) for o in overrides)


def announce_checks(jobs: int) -> None:
    """Before a sweep's jobs are checked (minutes for a large grid): what the wait is."""
    print(f"checking the sweep's {jobs} jobs before the first starts (each composed and validated)", file=sys.stderr,
          flush=True)


def _rank_zero_writes_hydra_files(overrides: list[str]) -> list[str]:
    """``hydra.output_subdir=null`` on a non-zero rank: only rank 0 writes the run folder's ``.hydra/`` (a second
    launch into a folder in use, refused by rank 0's lock, must not rewrite the record of the run that holds it)."""
    from rlhf_lab.training.run_lock import is_rank_zero

    if is_rank_zero() or any(o.lstrip("+~").startswith("hydra.output_subdir=") for o in overrides):
        return []
    return ["hydra.output_subdir=null"]


def version_line() -> str:
    """``rlhf-lab 0.1.0 (hydra-core 1.3.8, torch 2.13.0)``: the package's version and the two it is built on."""
    from importlib.metadata import PackageNotFoundError, version

    from rlhf_lab import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"rlhf-lab {__version__} (hydra-core {installed('hydra-core')}, torch {installed('torch')})"


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


def _hydra_entry() -> None:
    import hydra

    from rlhf_lab.app.cli_help import register_help
    from rlhf_lab.config import CONF_DIR, register_configs

    register_configs()
    register_help()  # the option lists `rlhf-lab --help` shows

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def run(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig

        from rlhf_lab.config import validate
        from rlhf_lab.config.objective import objective
        from rlhf_lab.errors import TrainingStopped, UserError
        from rlhf_lab.runtime.rank_output import report_error, report_stop
        from rlhf_lab.training import run as train

        # Mistakes in the user's config, data, reward or checkpoint found once the run started: one line, no
        # traceback, exit status 2 (as for config errors); RLHF_LAB_TRACEBACK=1 shows the traceback (e.g. to
        # debug a reward function). Anything else is a bug and keeps its traceback.
        run_dir = run_folder(cfg) or Path(HydraConfig.get().runtime.output_dir)
        sweep = sweep_job(cfg, run_dir)  # a job of a sweep: its folder, or why it does not run (sweep_watch.py)
        if isinstance(sweep, tuple):
            return sweep[0]
        try:
            validate(cfg)  # every job of a sweep; only the first was checked before Hydra started
            summary = train(cfg, run_dir)
            if sweep is not None:
                from rlhf_lab.app.sweep_watch import progress_line

                line = progress_line(HydraConfig.get(), sweep)
                if line:
                    print(line, file=sys.stderr, flush=True)
            # A hyperparameter search (hydra/sweeper=optuna) gets one number: the summary's optimized_metric.
            return objective(summary, cfg) if cfg.get("optimized_metric") else summary
        except UserError as error:
            if os.environ.get("RLHF_LAB_TRACEBACK", "") not in ("", "0"):
                raise
            report_error(f"error: {error}")  # once per run, not once per rank
            sys.exit(2)
        except TrainingStopped as stop:
            task = list(HydraConfig.get().overrides.task)  # every rank stopped after the same step: rank 0 says so
            report_stop(f"{stop}\nto resume, run: {resume_command(task, stop.resume_overrides)}")
            if sweep is None or stop.exit_code <= 128:  # a single run, or a job that stopped for its own reasons
                sys.exit(stop.exit_code)
            from rlhf_lab.app.sweep_watch import write_stop_mark

            write_stop_mark(sweep, signal_name(stop.exit_code - 128))  # no further job starts; the sweep says the rest
            return None
        except KeyboardInterrupt:
            print("interrupted without writing a checkpoint; resume from the last one with "
                  f"trainer.resume=auto trainer.output_dir={run_dir.resolve()}", file=sys.stderr, flush=True)
            if sweep is None:
                sys.exit(130)
            return None

    run()


def sweep_job(cfg: Any, run_dir: Path) -> Path | tuple[Any] | None:
    """In a sweep (Hydra's multirun): the sweep's folder, or ``(result,)`` for a job that does not run — the sweep
    was stopped before it started, or (``trainer.resume=auto``) it finished before (``rlhf_lab/app/sweep_watch.py``).
    None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN:
        return None
    from rlhf_lab.app.sweep_watch import finished_summary, leave_terminal_group, stopped_before_start

    leave_terminal_group()  # a worker process: a terminal's Ctrl-C reaches this job through the sweep, once
    folder = Path(str(hydra.sweep.dir)).expanduser().resolve()
    reason = stopped_before_start(folder)
    if reason is not None:
        print(f"not started: the sweep was stopped by {reason} ({run_dir})", file=sys.stderr, flush=True)
        return (None,)
    done = finished_summary(run_dir, int(cfg.trainer.steps)) if cfg.trainer.resume == "auto" else None
    if done is not None:
        print(f"already finished: {run_dir} (its summary.json has all {cfg.trainer.steps} steps)", file=sys.stderr,
              flush=True)
        if cfg.get("optimized_metric"):
            from rlhf_lab.config.objective import objective

            return (objective(done, cfg),)
        return (done,)
    return folder


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _run_subcommand(name: str, args: list[str]) -> None:
    if name == "report":
        from rlhf_lab.tools.report import main as report_main

        report_main(args)
    elif name == "bench":
        from rlhf_lab.app.bench_command import main as bench_main

        bench_main(args)
    elif name == "export":
        from rlhf_lab.tools.export import main as export_main

        export_main(args)
    elif name == "eval":
        from rlhf_lab.tools.evaluate import main as evaluate_main

        evaluate_main(args)
    elif name == "pipeline":
        from rlhf_lab.tools.pipeline import main as pipeline_main

        pipeline_main(args)
    elif name == "serve":
        from rlhf_lab.tools.serve import main as serve_main

        serve_main(args)
    elif name == "wandb":
        from rlhf_lab.tools.wandb_cli import main as wandb_main

        wandb_main(args)
    elif name == "plan":
        from rlhf_lab.tools.plan import main as plan_main

        plan_main(args)
    elif name == "launch":
        from rlhf_lab.app.launch import main as launch_main

        launch_main(args)
