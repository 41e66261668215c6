"""The Optuna loop behind ``hydra/sweeper=optuna``: search space from Hydra overrides, ask → launch → tell.

Kept apart from :mod:`.optuna_sweeper` because it imports Optuna, and Hydra imports every plugin module at start.
"""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep
from hydra.core.plugins import Plugins
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from rlhf_lab.config.overrides import override_text
from rlhf_lab.config.validate_sweep import DIRECTIONS, SEARCH_ATTR, search_signature, study_conflict

log = logging.getLogger(__name__)

RESULTS_FILE = "optimization_results.yaml"


class SearchSpaceError(ValueError):
    """A search-space entry Optuna cannot sample (a glob, an empty range)."""


def flatten_params(params: Any, prefix: str = "") -> dict[str, Any]:
    """``{"trainer": {"lr": "interval(...)"}, "kl.coef": ...}`` -> dotted keys (the command line nests dotted keys)."""
    if params is None:
        return {}
    if isinstance(params, DictConfig):
        params = OmegaConf.to_container(params, resolve=False)
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_params(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def distribution(override: Override) -> BaseDistribution:
    """The Optuna distribution of one sweep override (see :mod:`.optuna_sweeper` for the grammar)."""
    value = override.value()
    key = override.get_key_element()
    if override.is_interval_sweep():
        assert isinstance(value, IntervalSweep)
        log_scale = "log" in value.tags
        if "int" in value.tags:
            return IntDistribution(math.ceil(value.start), math.floor(value.end), log=log_scale)
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if override.is_range_sweep():
        assert isinstance(value, RangeSweep)
        choices = list(override.sweep_iterator())
        if not choices:
            raise SearchSpaceError(f"{key}: the range {override.get_value_element_as_str()} is empty")
        integers = all(isinstance(c, int) and not isinstance(c, bool) for c in choices)
        if integers and not value.shuffle and (value.step or 1) > 0:
            return IntDistribution(min(choices), max(choices), step=int(value.step or 1))
        return CategoricalDistribution(choices)
    if override.is_choice_sweep():
        return CategoricalDistribution(list(override.sweep_iterator()))
    raise SearchSpaceError(f"{key}={override.get_value_element_as_str()}: only choice, range and interval sweeps "
                           "can be searched")


def search_space(lines: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, str]]:
    """Override lines (``key=value``) -> (distributions by key, fixed values by key); later lines win."""
    space: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(lines):
        key = override.get_key_element()
        space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed[key] = override.get_value_element_as_str()
    return space, fixed


class OptunaSearch:
    def __init__(self, sampler: Any, direction: str, storage: str | None, study_name: str | None, n_trials: int,
                 n_jobs: int, max_failure_rate: float, params: Any) -> None:
        if str(direction) not in DIRECTIONS:
            raise ValueError(f"hydra.sweeper.direction={direction!r}; choose from: {', '.join(DIRECTIONS)}")
        if int(n_trials) < 1 or int(n_jobs) < 1 or not 0.0 <= float(max_failure_rate) <= 1.0:
            raise ValueError("hydra.sweeper: n_trials and n_jobs must be >= 1, max_failure_rate in [0, 1]")
        self.sampler_cfg = sampler
        self.direction = str(direction)
        self.storage = storage
        self.study_name = study_name
        self.n_trials = int(n_trials)
        self.n_jobs = int(n_jobs)
        self.max_failure_rate = float(max_failure_rate)
        self.params = flatten_params(params)
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def make_sampler(self, trials_so_far: int) -> optuna.samplers.BaseSampler:
        """The configured sampler; with a seed, ``seed + trials_so_far`` (a resumed study samples new points)."""
        settings = self.sampler_cfg
        if isinstance(settings, DictConfig):
            settings = OmegaConf.to_container(settings, resolve=True)
        if not settings:
            return optuna.samplers.TPESampler()
        if not isinstance(settings, dict):
            return settings  # an already-built sampler
        settings = dict(settings)
        if settings.get("seed") is not None:
            settings["seed"] = int(settings["seed"]) + trials_so_far
        return instantiate(settings)

    def _save_master_config(self, sweep_dir: Path) -> None:
        """``multirun.yaml`` as Hydra's basic sweeper writes it (with the search space flattened), so each job's
        W&B run can tell the searched keys apart (rlhf_lab.trackers.wandb.run_identity)."""
        master = copy.deepcopy(self.config)
        OmegaConf.set_readonly(master, False)
        with open_dict(master):
            master.hydra.sweeper.params = {key: str(value) for key, value in self.params.items()}
        OmegaConf.save(master, sweep_dir / "multirun.yaml")

    def sweep(self, arguments: list[str]) -> dict[str, Any]:
        assert self.config is not None and self.launcher is not None
        lines = [f"{key}={value}" for key, value in self.params.items()] + list(arguments)
        space, fixed = search_space(lines)
        if not space:
            raise SearchSpaceError("hydra/sweeper=optuna: the search space is empty; set hydra.sweeper.params or "
                                   "give sweep overrides such as 'trainer.lr=tag(log,interval(1e-5,1e-3))'")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        self._save_master_config(sweep_dir)
        if self.storage and str(self.storage).startswith("sqlite:///"):  # SQLite creates the file, not its folder
            Path(str(self.storage)[len("sqlite:///"):]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(study_name=self.study_name, storage=self.storage, direction=self.direction,
                                    load_if_exists=True)
        signature = search_signature(self.params, list(arguments), self.direction)
        conflict = study_conflict(study.user_attrs.get(SEARCH_ATTR), signature, study.study_name)
        if conflict:  # the command line checks it before Hydra starts; the Python API gets it here
            raise SearchSpaceError(conflict)
        study.set_user_attr(SEARCH_ATTR, signature)
        study.sampler = self.make_sampler(len(study.trials))
        log.info(f"Optuna study {study.study_name!r} ({len(study.trials)} trials so far), storage {self.storage}, "
                 f"sampler {type(study.sampler).__name__}, direction {self.direction}")
        log.info("Search space: " + ", ".join(f"{key}: {dist}" for key, dist in space.items()))
        fixed_lines = [f"{key}={value}" for key, value in fixed.items()]
        to_go = self.n_trials
        while to_go > 0:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, to_go))]
            overrides = [
                tuple([*(f"{key}={override_text(trial.params[key])}" for key in space), *fixed_lines])
                for trial in trials
            ]
            returns = self.launcher.launch(overrides, initial_job_idx=trials[0].number)
            failures = 0
            for trial, job_overrides, result in zip(trials, overrides, returns):
                trial.set_user_attr("overrides", list(job_overrides))
                job_dir = OmegaConf.select(result.hydra_cfg, "hydra.runtime.output_dir") if result.hydra_cfg else None
                if job_dir:
                    trial.set_user_attr("job_dir", str(job_dir))
                try:
                    value = float(result.return_value)  # re-raises the job's exception if it failed
                    if not math.isfinite(value):
                        raise ValueError(f"objective is {value}")
                except Exception as error:  # noqa: BLE001 - any failure of the job fails its trial
                    failures += 1
                    study.tell(trial, state=TrialState.FAIL)
                    log.warning(f"trial {trial.number} failed: {type(error).__name__}: {error}")
                    continue
                study.tell(trial, value)
            if failures / len(trials) > self.max_failure_rate:
                for result in returns:
                    _ = result.return_value  # re-raise the first failure with its traceback
                raise RuntimeError(f"{failures} of {len(trials)} trials failed (max_failure_rate="
                                   f"{self.max_failure_rate})")
            to_go -= len(trials)
        return self._report(study, sweep_dir)

    def _report(self, study: optuna.Study, sweep_dir: Path) -> dict[str, Any]:
        done = [t for t in study.trials if t.state == TrialState.COMPLETE]
        results: dict[str, Any] = {
            "name": "optuna",
            "study_name": study.study_name,
            "storage": self.storage,
            "direction": self.direction,
            "n_trials": len(study.trials),
            "n_complete": len(done),
        }
        if done:
            best = study.best_trial
            results.update(best_trial=best.number, best_params=dict(best.params), best_value=best.value,
                           best_job_dir=best.user_attrs.get("job_dir"))
            log.info(f"Best trial {best.number}: value {best.value} with {best.params}")
        else:
            log.warning("no trial completed")
        results["trials"] = [
            {"number": t.number, "state": t.state.name, "value": t.value, "params": dict(t.params),
             "job_dir": t.user_attrs.get("job_dir")}
            for t in study.trials
        ]
        OmegaConf.save(OmegaConf.create(results), sweep_dir / RESULTS_FILE)
        log.info(f"Best parameters and every trial: {sweep_dir / RESULTS_FILE}")
        return results
