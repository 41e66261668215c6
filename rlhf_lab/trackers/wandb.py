"""Weights & Biases tracker (``logger=wandb``), registered as logger ``wandb``.

Mode (``logger.mode``): ``auto`` is online when an API key is configured (``WANDB_API_KEY``, an identity
token file, or a netrc entry for the W&B host — checked by reading, never by prompting), otherwise offline
(sync later with ``wandb sync``); ``online``, ``offline`` and ``disabled`` force one. W&B never prompts.

Names, so the dashboard can group and filter:

- multirun job: ``group`` = experiment name + the sweep folder's name (the same for every job of one sweep,
  whichever launcher runs it), run ``name`` = the job's swept overrides (``algorithm=grpo,kl=k3,seed=1``),
  one tag per swept value (``algorithm=grpo``, ``kl=k3``, ``seed=1``);
- single run: ``group`` = experiment name (without one: the algorithm and KL options, ``grpo-k3``; under
  ``wandb agent``: ``sweep-<id>``), ``name`` = its overrides (or its run folder's name), one tag per config
  group chosen on the command line;
- ``job_type`` = the stage: ``train`` (RL), ``sft``, ``dpo``, ``reward_model``, ``eval`` (``rlhf-lab eval``, in
  the evaluated run's group, with the run's W&B id in its config under ``evaluates``), or ``logger.job_type``.

W&B's step is the trainer's step (``run.log(..., step=step)``), so a resumed run's history continues where the
checkpoint left it. The summary adds ``<metric>/min`` and ``<metric>/max`` over the whole run (from
``metrics.jsonl``, so a resume does not restart them) for the metrics sweeps rank by (:data:`RANKED`).

The logged config is the resolved Hydra config plus flat copies of the keys sweeps vary
(``algorithm_name``, ``kl_name``, ``kl_placement``, ...) so runs group by them in the W&B UI.

W&B is optional: if it is not importable, ``wandb.init`` raises or a later call raises (a full disk), the
run goes on with local logging only and warns once (:class:`WandbUnavailableWarning`). ``metrics.jsonl``,
``samples.jsonl`` and ``summary.json`` are written by the trainer whatever happens here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_lab.registry import register
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.console import say
from rlhf_lab.trackers.base import Tracker
from rlhf_lab.trackers.jsonl import read_jsonl
from rlhf_lab.trackers.wandb_run import (  # noqa: F401  (MODES, has_api_key: read from here too)
    MODES,
    _git_settings,
    dashboard_config,
    has_api_key,
    job_type,
    remember_run,
    resolve_mode,
    run_id,
    run_identity,
    short_name,
)

SAMPLE_COLUMNS = ("step", "prompt", "response", "reward")
RANKED = ("exact/gap", "eval/reward/mean", "reward/mean", "eval/kl/exact")  # summary gets their min and max


class WandbUnavailableWarning(RuntimeWarning):
    """W&B could not be used; the run continues with local logging only."""


def extremes(metrics_file: Path, keys: tuple[str, ...] = RANKED) -> dict[str, float]:
    """``<key>/min`` and ``<key>/max`` of each of ``keys`` over a metrics.jsonl (the run's every logged step)."""
    seen: dict[str, list[float]] = {}
    if metrics_file.is_file():
        for line in read_jsonl(metrics_file):
            for key in keys if isinstance(line, dict) else ():
                value = line.get(key)
                if isinstance(value, (int, float)) and value == value:  # NaN never ranks
                    seen.setdefault(key, []).append(float(value))
    return {f"{key}/{which}": fn(values) for key, values in seen.items() for which, fn in (("min", min), ("max", max))}


@register("logger", "wandb")
class WandbTracker(Tracker):
    """Logs to a W&B run whose files live in ``<run_dir>/wandb/``; see the module docstring."""

    def __init__(self, logger_cfg: Any, config: dict[str, Any], run_dir: Path, resuming: bool = False) -> None:
        super().__init__(logger_cfg, config, run_dir)
        self.run_dir = Path(run_dir)
        self.run: Any = None
        self._tables: dict[str, Any] = {}
        self._pending_eval: tuple[int, list[dict[str, Any]]] | None = None
        # Only rank 0 of a torchrun job has a W&B run (torchrun sets RANK before torch.distributed starts).
        main_process = distributed.is_main_process() and os.environ.get("RANK", "0") == "0"
        self.mode = resolve_mode(str(logger_cfg.mode)) if main_process else "disabled"
        self._warned = False
        self._pending_samples: tuple[int, list[dict[str, Any]]] | None = None
        if self.mode == "disabled":
            return
        try:
            import wandb
        except ImportError as error:
            self._give_up("import", error)
            return
        self._wandb = wandb
        notes: list[str] = []
        if self.mode == "online" and not has_api_key():
            notes.append("logger.mode=online but no W&B API key is configured (WANDB_API_KEY or netrc)")
            self.mode = "offline"
        experiment_name = str(config.get("experiment_name", "default"))
        identity = run_identity(experiment_name, self.run_dir)
        evaluated = config.get("evaluates") or {}  # rlhf-lab eval: the training run's W&B identity
        env_tags = [t.strip() for t in os.environ.get("WANDB_TAGS", "").split(",") if t.strip()]
        tags = [*identity.tags, *(str(t) for t in (logger_cfg.tags or [])), *env_tags]
        name = f"eval {evaluated['name']} @ step {evaluated['step']}" if evaluated.get("name") else identity.name
        init_kwargs = {
            "project": (logger_cfg.project or os.environ.get("WANDB_PROJECT") or evaluated.get("project")
                        or "rlhf_lab"),
            "entity": logger_cfg.entity or evaluated.get("entity"),
            "group": logger_cfg.group or os.environ.get("WANDB_RUN_GROUP") or evaluated.get("group") or identity.group,
            "name": short_name(logger_cfg.run_name or name),
            "id": run_id(self.run_dir, resuming),
            "resume": "allow",  # a resumed run (trainer.resume) continues the same W&B run
            "tags": [tag[:64] for tag in dict.fromkeys(tags)],  # W&B caps tags at 64 characters
            "job_type": job_type(logger_cfg.get("job_type"), config),
            "config": dashboard_config(config, self.run_dir, identity),
            "dir": str(self.run_dir),
            "reinit": "finish_previous",
        }
        remember_run(self.run_dir, init_kwargs)
        self.run = self._init(init_kwargs, notes)
        if self.run is None:
            return
        if notes:  # online was asked for but the run is offline: say so once
            self._warn("; ".join(notes) + f"; logging offline (sync later: wandb sync {self.run.settings.sync_dir})")
        self._guarded("define_metric", self._define_metrics)
        if (self.run_dir / ".hydra").is_dir():  # the resolved config and overrides, with the run's files
            self._guarded("save", self._save_hydra_files)

    def _save_hydra_files(self) -> None:
        """Copies of ``.hydra/``'s files in the W&B run's own files folder, uploaded now. Saved from there, W&B links
        nothing into its folder (so it prints no "Symlinked N files" line); a planted link is not followed."""
        files = Path(self.run.dir)
        copies = files / ".hydra"
        copies.mkdir(parents=True, exist_ok=True)
        for item in sorted((self.run_dir / ".hydra").iterdir()):
            if item.is_file() and not item.is_symlink():
                shutil.copyfile(item, copies / item.name)
        self.run.save(str(copies / "*"), base_path=str(files), policy="now")

    def _init(self, init_kwargs: dict[str, Any], notes: list[str]) -> Any:
        """``wandb.init``; an online run that cannot start (no network, server down) falls back to offline."""
        wandb = self._wandb
        error: Exception | None = None
        for mode in ("online", "offline") if self.mode == "online" else (self.mode,):
            try:
                # silent: no banners or prompts; console off: no stdout capture (safe under every launcher).
                settings = wandb.Settings(silent=True, console="off", **_git_settings(Path.cwd().resolve()))
                run = wandb.init(mode=mode, settings=settings, **init_kwargs)
            except Exception as init_error:
                error = init_error
                if mode == "online":
                    notes.append(f"W&B online init failed ({type(init_error).__name__}: {init_error})")
                continue
            self.mode = mode
            return run
        assert error is not None
        self._give_up("init", error)
        return None

    def _define_metrics(self) -> None:
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    # ------------------------------------------------------------------ failures
    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(message, WandbUnavailableWarning, stacklevel=3)

    def _give_up(self, what: str, error: BaseException) -> None:
        """Warn once, close the W&B run if any, and continue with local logging only."""
        self._warn(
            f"W&B {what} failed ({type(error).__name__}: {error}); the run continues with local logging only "
            f"(metrics.jsonl, samples.jsonl, summary.json in {self.run_dir})"
        )
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception):  # already warned; a second failure adds nothing
                run.finish(exit_code=1)

    def _guarded(self, what: str, call: Callable[[], Any]) -> None:
        if self.run is None:
            return
        try:
            call()
        except Exception as error:
            self._give_up(what, error)

    # ------------------------------------------------------------------ Tracker interface
    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is None:
            return
        payload = {**metrics, "step": step}
        if self._pending_samples is not None and self._pending_samples[0] == step:
            payload["samples"] = self._samples_table(self._pending_samples[1])
            self._pending_samples = None
        if self._pending_eval is not None and self._pending_eval[0] == step:
            payload["eval_samples"] = self._samples_table(self._pending_eval[1], "eval_samples")
            self._pending_eval = None
        self._flush_samples()  # samples of an earlier step that got no metrics line
        self._guarded("log", lambda: self.run.log(payload, step=step))

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """Queue the rows; they go out with this step's metrics, as one table row per sample."""
        if self.run is None:
            return
        self._flush_samples()
        self._pending_samples = (step, list(rows))

    def _flush_samples(self) -> None:
        if self._pending_samples is None:
            return
        step, rows = self._pending_samples
        self._pending_samples = None
        self._guarded("log", lambda: self.run.log({"samples": self._samples_table(rows), "step": step}, step=step))

    def _samples_table(self, rows: list[dict[str, Any]], name: str = "samples") -> Any:
        """One table per name for the whole run, logged incrementally (each log adds the new rows); columns:
        step, prompt, response, reward, then what the first rows carry (advantage, reward components)."""
        wandb = self._wandb
        if name not in self._tables:
            extra = [key for key in dict.fromkeys(k for row in rows for k in row) if key not in SAMPLE_COLUMNS]
            columns = [*SAMPLE_COLUMNS, *extra]
            try:
                self._tables[name] = (wandb.Table(columns=columns, log_mode="INCREMENTAL"), columns)
            except TypeError:  # a W&B without incremental tables: one table per logged step
                self._tables[name] = (None, columns)
        table, columns = self._tables[name]
        table = table if table is not None else wandb.Table(columns=columns)
        for row in rows:
            table.add_data(*(row.get(column) for column in columns))
        return table

    def log_eval_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """An evaluation's samples, in their own table (``eval_samples``) beside the training samples; they go
        out with the evaluation's metrics line (one W&B step per metrics.jsonl line)."""
        if self.run is None or not rows:
            return
        self._flush_samples()
        self._pending_eval = (step, list(rows))

    def _flush_eval(self) -> None:
        if self._pending_eval is None:
            return
        step, rows = self._pending_eval
        self._pending_eval = None
        self._guarded("log", lambda: self.run.log({"eval_samples": self._samples_table(rows, "eval_samples"),
                                                   "step": step}, step=step))

    def _log_model(self) -> None:
        """The last checkpoint as a W&B model artifact (``logger.log_model=true``)."""
        folders = sorted((self.run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
        if not folders:
            return
        artifact = self._wandb.Artifact(f"model-{self.run.id}", type="model",
                                        metadata={"step": int(folders[-1].name.split("_")[1])})
        artifact.add_dir(str(folders[-1]))
        self.run.log_artifact(artifact, aliases=["latest", folders[-1].name])

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        self._flush_samples()
        self._flush_eval()
        run = self.run
        if self.logger_cfg.get("log_model"):
            self._guarded("artifact", self._log_model)
        self._guarded("summary", lambda: run.summary.update({**summary, **extremes(self.run_dir / "metrics.jsonl")}))
        if self.run is None:
            return
        folder, offline = run.settings.sync_dir, run.settings._offline
        self.run = None
        try:
            run.finish()
        except Exception as error:
            self._give_up("finish", error)
            return
        say(f"wandb: run files in {folder}", __name__)
        if offline:
            say(f"wandb: offline run; upload it with: wandb sync {folder}", __name__)
        else:
            say(f"wandb: {run.url}", __name__)
