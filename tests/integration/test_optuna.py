"""Optuna hyperparameter search: ``+hparams_search=NAME`` (hydra_plugins/rlhf_lab_optuna around Optuna's TPE).

A 3-trial search of ``trainer.lr`` and ``kl.coef`` on the tiny model runs as users run it (``python -m rlhf_lab``
in a subprocess, W&B offline), then a second invocation with the same SQLite storage adds 2 trials to the same
study. Checked: the study file, the trials' objective equals what each run's summary.json gives (the KL-budget
variant, so every trial's value differs), the best trial is the best of them all, the report shows it, and each
job is one W&B run in one group per sweep. Fast tests cover the search-space grammar and the bad inputs.
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf
from test_sweeps import read_offline_run, wandb_test_env

from rlhf_lab.app.cli import main as cli_main
from rlhf_lab.config.objective import objective
from tests.limits import HANG_GUARD_S

TINY = ["model=tiny", "trainer.steps=1", "trainer.prompts_per_step=2", "algorithm.group_size=2",
        "trainer.max_new_tokens=4", "trainer.eval_prompts=2", "trainer.progress_bar=false", "trainer.num_threads=1"]
# eval/reward/mean - 10 * max(0, eval/kl/exact - 0): the KL term makes every trial's value differ.
SEARCH = ["+hparams_search=lr_kl", *TINY, "kl_budget=0", "logger=wandb", "logger.mode=offline"]
STUDY = "default_lr_kl"  # ${experiment_name}_lr_kl


@dataclass
class Search:
    folder: Path
    output: str

    @property
    def results(self) -> dict[str, Any]:
        return yaml.safe_load((self.folder / "optimization_results.yaml").read_text())

    def jobs(self) -> list[Path]:
        return sorted((p for p in self.folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def run_search(base: Path, name: str, n_trials: int) -> Search:
    folder = base / name
    command = [sys.executable, "-m", "rlhf_lab", *SEARCH, f"hydra.sweeper.n_trials={n_trials}",
               f"hydra.sweeper.storage=sqlite:///{base / 'study.db'}", f"hydra.sweep.dir={folder}"]
    result = subprocess.run(command, cwd=base, env=wandb_test_env(base), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Search(folder, result.stdout + result.stderr)


@functools.cache
def searches(base: Path) -> tuple[Search, Search]:
    """The first invocation (3 trials) and the resumed one (2 more), once per session."""
    return run_search(base, "first", 3), run_search(base, "resumed", 2)


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[Search, Search]:
    return searches(tmp_path_factory.getbasetemp())


def job_objective(job: Path) -> float:
    """The objective recomputed from what the run wrote: its summary.json and resolved config."""
    summary = yaml.safe_load((job / "summary.json").read_text())  # JSON is YAML
    return objective(summary, OmegaConf.load(job / ".hydra" / "config.yaml"))


def test_search_writes_the_study_and_returns_each_runs_objective(both: tuple[Search, Search]) -> None:
    first, _ = both
    assert (first.folder.parent / "study.db").is_file()
    results = first.results
    assert (results["study_name"], results["direction"], results["n_trials"], results["n_complete"]) == (
        STUDY, "maximize", 3, 3)
    jobs = first.jobs()
    assert [job.name for job in jobs] == ["0", "1", "2"]  # one folder per trial, named by its number
    for trial, job in zip(results["trials"], jobs):
        assert trial["state"] == "COMPLETE" and Path(trial["job_dir"]) == job
        assert trial["value"] == job_objective(job)
        overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml")
        assert f"trainer.lr={trial['params']['trainer.lr']!r}" in overrides
        assert f"kl.coef={trial['params']['kl.coef']!r}" in overrides
        config = OmegaConf.load(job / ".hydra" / "config.yaml")
        assert math.isclose(config.trainer.lr, trial["params"]["trainer.lr"], rel_tol=1e-12)
        assert 1e-6 <= config.trainer.lr <= 1e-4 and 1e-3 <= config.kl.coef <= 1.0  # the lr_kl search space
    values = [trial["value"] for trial in results["trials"]]
    assert len(set(values)) == 3
    assert results["best_value"] == max(values) and results["best_params"] == results["trials"][
        values.index(max(values))]["params"]
    assert f"Best trial {results['best_trial']}: value {results['best_value']}" in first.output


def test_second_invocation_resumes_the_study(both: tuple[Search, Search]) -> None:
    import optuna

    first, resumed = both
    results = resumed.results
    assert (results["n_trials"], results["n_complete"]) == (5, 5)
    assert [job.name for job in resumed.jobs()] == ["3", "4"]  # trial numbers go on in the new sweep folder
    assert [t["params"] for t in results["trials"][:3]] == [t["params"] for t in first.results["trials"]]
    new = [t["params"] for t in results["trials"][3:]]
    assert all(params not in [t["params"] for t in first.results["trials"]] for params in new)  # reseeded sampler
    every_job = first.jobs() + resumed.jobs()
    objectives = {int(job.name): job_objective(job) for job in every_job}
    assert {t["number"]: t["value"] for t in results["trials"]} == objectives
    assert results["best_value"] == max(objectives.values())
    assert Path(results["best_job_dir"]).name == str(max(objectives, key=objectives.get))
    storage = f"sqlite:///{first.folder.parent / 'study.db'}"
    study = optuna.load_study(study_name=STUDY, storage=storage)
    assert len(study.trials) == 5 and study.best_value == results["best_value"]


def test_each_trial_is_one_wandb_run_in_one_group_per_sweep(both: tuple[Search, Search]) -> None:
    for search in both:
        for job in search.jobs():
            run = read_offline_run(job / "wandb")
            params = next(t for t in search.results["trials"] if t["number"] == int(job.name))["params"]
            assert run["group"] == f"default-{search.folder.name}"
            # Named and tagged by the searched keys only (the fixed overrides are the same in every job), floats in
            # 6 significant digits.
            tags = [f"kl.coef={params['kl.coef']:.6g}", f"trainer.lr={params['trainer.lr']:.6g}"]
            assert (run["name"], run["tags"]) == (",".join(tags), tags)
            assert run["summary"]["eval/reward/mean"] == yaml.safe_load((job / "summary.json").read_text())[
                "eval/reward/mean"]


def test_report_shows_the_best_trial(both: tuple[Search, Search], capsys) -> None:
    _, resumed = both
    cli_main(["report", str(resumed.folder)])
    printed = capsys.readouterr().out
    results = resumed.results
    assert f"**Best trial {results['best_trial']}: value {results['best_value']:.6g}**" in printed
    markdown = (resumed.folder / "report.md").read_text()
    assert "## Optuna search" in markdown and f"{results['n_complete']} of 5 trials complete" in markdown
    assert (resumed.folder / "report.csv").is_file()


# ------------------------------------------------------------------------------------------ grammar, bad input


def test_search_space_grammar() -> None:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from hydra_plugins.rlhf_lab_optuna._search import flatten_params, search_space
    from rlhf_lab.config.overrides import override_text

    space, fixed = search_space([
        "a=interval(0.1, 0.5)", "b=tag(log, interval(1e-5, 1e-3))", "c=tag(int, interval(1, 8))",
        "d=range(1, 5)", "e=choice(k3, kl)", "f=k3,kl", "g=range(0.5, 2.0, 0.5)", "h=7", "+i=x",
    ])
    assert space == {
        "a": FloatDistribution(0.1, 0.5), "b": FloatDistribution(1e-5, 1e-3, log=True),
        "c": IntDistribution(1, 8), "d": IntDistribution(1, 4),  # Hydra's range excludes its stop
        "e": CategoricalDistribution(["k3", "kl"]), "f": CategoricalDistribution(["k3", "kl"]),
        "g": CategoricalDistribution([0.5, 1.0, 1.5]),  # float steps: the listed values
    }
    assert fixed == {"h": "7", "+i": "x"}
    assert flatten_params({"trainer.lr": "x", "kl": {"coef": "y"}}) == {"trainer.lr": "x", "kl.coef": "y"}
    assert [override_text(v) for v in (None, True, 1e-5, 3, "k3", "a b")] == ["null", "true", "1e-05", "3", "k3",
                                                                            "'a b'"]


def test_plugin_is_discovered() -> None:
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    assert "hydra_plugins.rlhf_lab_optuna.optuna_sweeper.OptunaSweeper" in {
        f"{cls.__module__}.{cls.__name__}" for cls in Plugins.instance().discover(Sweeper)}


def test_the_wheel_ships_the_plugin(tmp_path: Path) -> None:
    """Hydra finds plugins in the ``hydra_plugins`` namespace package: a wheel of the project must carry it."""
    import shutil
    import zipfile

    root = Path(__file__).resolve().parents[2]
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(root / name, source / name)
    for package in ("rlhf_lab", "conf", "hydra_plugins"):
        shutil.copytree(root / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, text=True, timeout=HANG_GUARD_S)
    (wheel,) = (tmp_path / "dist").glob("rlhf_lab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"hydra_plugins/rlhf_lab_optuna/optuna_sweeper.py", "hydra_plugins/rlhf_lab_optuna/_search.py",
            "rlhf_lab/conf/hydra/sweeper/optuna.yaml", "rlhf_lab/conf/hparams_search/lr_kl.yaml",
            "rlhf_lab/conf/hparams_search/kl_budget.yaml"} <= names
    assert "hydra_plugins/__init__.py" not in names  # a namespace package, shared with the other Hydra plugins


BAD = {
    "unknown key": (["+hydra.sweeper.params.trainer.lrr='interval(1e-5,1e-3)'"],
                    "search space (hydra.sweeper.params): unknown key 'trainer.lrr'; did you mean 'trainer.lr'? valid keys of trainer: steps, lr, "),
    "unknown section": (["+hydra.sweeper.params.trainr.lr='interval(1e-5,1e-3)'"],
                        "search space (hydra.sweeper.params): unknown key 'trainr'; did you mean 'trainer'? valid keys: algorithm, "),
    "unknown option": (["+hydra.sweeper.params.kl='choice(k3,k9)'"],
                       "search space (hydra.sweeper.params): kl='k9' is not an option; choose from: abs, full"),
    "key of another option": (["algorithm=ppo", "algorithm.mini_batch_size=0", "+hydra.sweeper.params.algorithm.weight_by='choice(advantage,reward)'"],
                              "search space (hydra.sweeper.params): unknown key 'algorithm.weight_by' for "
                              "algorithm=ppo; valid keys: name, "),
    "wrong type": (["+hydra.sweeper.params.trainer.steps='interval(0.5,2.5)'"],
                   "search space (hydra.sweeper.params): trainer.steps=0.5 has the wrong type; expected int"),
    "unknown key as a sweep override": (["trainer.lrr=tag(log,interval(1e-5,1e-3))"],
                                        "unknown key 'trainer.lrr'; did you mean 'trainer.lr'? valid keys of trainer: steps, lr, "),
    "unquoted sweep of hydra's config": (["hydra.sweeper.params.trainer.lr=interval(1e-5,1e-3)"],
                                         "hydra.sweeper.params.trainer.lr=interval(1e-5,1e-3) is a sweep over Hydra's "
                                         "own config; quote the value for Hydra"),
    "no objective": (["optimized_metric=null"], "hydra/sweeper=optuna needs the objective each trial returns"),
    "no trials": (["hydra.sweeper.n_trials=0"], "hydra.sweeper.n_trials=0 is out of range; must be an integer ≥ 1"),
    "no jobs": (["hydra.sweeper.n_jobs=0"], "hydra.sweeper.n_jobs=0 is out of range; must be an integer ≥ 1"),
    "sideways": (["hydra.sweeper.direction=sideways"],
                 "hydra.sweeper.direction='sideways' is not valid; choose from: maximize, minimize"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_search_space_is_a_one_line_config_error(case: str) -> None:
    from rlhf_lab.config.compose import compose
    from rlhf_lab.errors import ConfigError

    overrides, expected = BAD[case]
    with pytest.raises(ConfigError) as error:
        compose(["+hparams_search=lr_kl", *TINY, *overrides])
    assert str(error.value).startswith(expected) and "\n" not in str(error.value), str(error.value)
    with pytest.raises(ConfigError, match="hparams_search='nope' is not an option; choose from: kl_budget, lr_kl"):
        compose(["+hparams_search=nope"])


def test_cli_rejects_a_search_key_the_schema_lacks_before_any_job(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", "+hparams_search=lr_kl", *TINY,
                             "+hydra.sweeper.params.trainer.lrr='interval(1e-5,1e-3)'"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: " + BAD["unknown key"][1]) and result.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # no sweep folder, no study: nothing started


def test_objective_and_its_keys() -> None:
    from rlhf_lab.config.compose import compose
    from rlhf_lab.errors import ConfigError

    summary = {"eval/reward/mean": 0.5, "eval/kl/exact": 0.08, "steps": 3}
    cfg = compose(["optimized_metric=eval/reward/mean"])
    assert objective(summary, cfg) == 0.5
    cfg = compose(["optimized_metric=eval/reward/mean", "kl_budget=0.05"])  # 0.5 - 10 * (0.08 - 0.05)
    assert math.isclose(objective(summary, cfg), 0.2)
    cfg = compose(["optimized_metric=eval/reward/mean", "kl_budget=0.1", "kl_budget_penalty=3"])  # inside budget
    assert objective(summary, cfg) == 0.5
    with pytest.raises(ConfigError, match=r"optimized_metric: 'eval/nope' is not in this run's summary.json; "
                                          r"numeric keys: eval/kl/exact, eval/reward/mean, steps"):
        objective(summary, compose(["optimized_metric=eval/nope"]))
    for overrides, message in (
        (["kl_budget=0.1"], "kl_budget=0.1 needs optimized_metric"),
        (["optimized_metric=eval/reward/mean", "kl_budget=-1"], "kl_budget=-1.0 must be >= 0"),
        (["optimized_metric=eval/reward/mean", "kl_budget_penalty=-2"], "kl_budget_penalty=-2.0 must be"),
    ):
        with pytest.raises(ConfigError, match=message):
            compose(overrides)


def test_a_search_with_other_settings_does_not_join_the_study(both: tuple[Search, Search]) -> None:
    """The study records the search that made it (its searched keys, fixed settings, direction): the same command
    resumes it (above), a search with another fixed setting is refused before any trial, in one line."""
    import optuna

    first, _ = both
    base = first.folder.parent
    command = [sys.executable, "-m", "rlhf_lab", *SEARCH, "trainer.max_new_tokens=5", "hydra.sweeper.n_trials=1",
               f"hydra.sweeper.storage=sqlite:///{base / 'study.db'}", f"hydra.sweep.dir={base / 'other'}"]
    command.remove("trainer.max_new_tokens=4")
    result = subprocess.run(command, cwd=base, env=wandb_test_env(base), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == (f"error: hydra.sweeper.study_name='{STUDY}' holds a search with other fixed settings "
                             "(['trainer.max_new_tokens=4'] there, ['trainer.max_new_tokens=5'] here); give this "
                             "search its own hydra.sweeper.study_name or hydra.sweeper.storage\n")
    assert not (base / "other").exists()
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{base / 'study.db'}")
    assert len(study.trials) == 5 and study.user_attrs["rlhf_lab_search"]["space"] == ["kl.coef", "trainer.lr"]
