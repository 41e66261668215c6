"""Sweeps through the launchers beyond one process, as far as this machine allows.

- ``hydra/launcher=submitit_local``: hydra-submitit-launcher's local executor (submitit's SLURM code path minus
  sbatch: each job a process started by submitit) runs the smoke sweep.
- ``hydra/launcher=ray_cluster``: hydra-ray-launcher (the optional ``ray`` extra) runs the smoke sweep as Ray tasks
  on a local Ray instance this test starts and stops; skipped, with the install command, without the extra.
- A launcher whose package is not installed stops the CLI at start with one line naming what to install.

Each sweep job must have its files, one W&B offline run in one group per sweep, and ``rlhf-lab report`` must work
on the sweep folder. The SLURM launcher's submission is checked without a cluster in test_sweeps.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_sweeps import (
    SMOKE_JOBS,
    Sweep,
    assert_complete_metrics,
    read_metrics,
    read_offline_run,
    swept,
    wandb_test_env,
)

from rlhf_lab.app.cli import main as cli_main
from tests.limits import HANG_GUARD_S


def run_smoke_sweep(base: Path, name: str, *launcher: str) -> Sweep:
    folder = base / name
    command = [sys.executable, "-m", "rlhf_lab", "experiment=smoke", *launcher, "logger=wandb", "logger.mode=offline",
               f"hydra.sweep.dir={folder}"]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=base, env=wandb_test_env(base), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return Sweep(folder, time.perf_counter() - start, result.stdout + result.stderr)


def check_sweep(sweep: Sweep, capsys: pytest.CaptureFixture[str]) -> None:
    """Every job's folder complete, one W&B run per job in the sweep's group, and the report on the folder."""
    jobs = sweep.jobs()
    assert [swept(job) for job in jobs] == SMOKE_JOBS
    for job in jobs:
        for name in (".hydra/config.yaml", "metrics.jsonl", "samples.jsonl", "summary.json"):
            assert (job / name).is_file(), f"{job}/{name} missing"
        assert_complete_metrics(read_metrics(job))
        run = read_offline_run(job / "wandb")
        assert run["group"] == f"smoke-{sweep.folder.name}"
        assert run["name"] == swept(job)
        assert run["folder"].parent == job / "wandb"
    capsys.readouterr()
    cli_main(["report", str(sweep.folder)])
    printed = capsys.readouterr().out
    for job in SMOKE_JOBS:
        assert f"| {job} | 1 |" in printed
    for name in ("report.md", "report.csv", "reward_vs_step.png"):
        assert (sweep.folder / name).is_file()


@pytest.mark.slow  # 4 processes each importing torch on 2 cores: about a minute
def test_submitit_local_runs_the_smoke_sweep(tmp_path: Path, capsys) -> None:
    sweep = run_smoke_sweep(tmp_path, "submitit", "hydra/launcher=submitit_local")
    print(f"submitit_local smoke sweep: {sweep.wall_s:.1f} s")
    assert "Submitit 'local' sweep output dir" in sweep.output
    check_sweep(sweep, capsys)
    # submitit's own files: one folder per job with its log and pickled result (written by submitit here).
    logs = sorted((sweep.folder / ".submitit").glob("*/*_0_log.out"))
    assert len(logs) == len(SMOKE_JOBS)


@pytest.mark.slow  # starts Ray (about 6 s) and 4 Ray workers: 40-60 s here
@pytest.mark.extra("ray")
def test_ray_launcher_runs_the_smoke_sweep_on_a_local_ray_instance(tmp_path: Path, monkeypatch, capsys) -> None:
    import ray
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a local test instance: no token written under ~/.ray
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        address = context.address_info["address"]
        sweep = run_smoke_sweep(tmp_path, "ray", "hydra/launcher=ray_cluster", f"hydra.launcher.ray.init.address={address}")
    finally:
        ray.shutdown()
    print(f"ray smoke sweep: {sweep.wall_s:.1f} s")
    assert f"Connecting to existing Ray cluster at address: {address}" in sweep.output
    assert "Ray Launcher is launching 4 jobs" in sweep.output
    check_sweep(sweep, capsys)


@pytest.mark.extra("ray")
def test_ray_launcher_configs_compose() -> None:
    from test_sweeps import _compose

    local = _compose("hydra/launcher=ray").hydra.launcher
    assert local._target_ == "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
    cluster = _compose("hydra/launcher=ray_cluster").hydra.launcher
    assert cluster._target_ == local._target_
    assert cluster.ray.init == {"address": "auto", "object_store_memory": None}
    assert cluster.ray.remote == {"num_cpus": 1}


# ------------------------------------------------------------------------------------------ bad input

HIDE_RAY = textwrap.dedent(
    """
    # Makes ray and hydra-ray-launcher look uninstalled in this interpreter (a test of the missing-extra message).
    import sys

    class _Hidden:
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith(("ray.", "hydra_plugins.hydra_ray_launcher")):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Hidden())
    """
)


@pytest.mark.parametrize("launcher", ["ray", "ray_cluster"])
def test_a_launcher_that_is_not_installed_names_the_extra(launcher: str, tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_RAY)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", "experiment=smoke", f"hydra/launcher={launcher}"],
                            cwd=work, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr == (
        f"error: hydra/launcher={launcher} needs hydra-ray-launcher and ray, which are not installed; install the "
        "optional `ray` extra: pip install -r requirements-ray.txt (or: make install-ray)\n"
    )
    assert list(work.iterdir()) == []  # no sweep folder: no job started


def test_missing_plugin_messages(monkeypatch) -> None:
    """The same checks in-process: a missing engine, an unknown launcher, one selected inside a config file."""
    from hydra.errors import MissingConfigException

    from rlhf_lab.config import validate_sweep
    from rlhf_lab.config.compose import CONF_DIR, compose
    from rlhf_lab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"hydra/launcher='rayy' is not an option; choose from: basic, joblib, "
                                          r"joblib_local, .*slurm, submitit_local, submitit_slurm"):
        compose(["experiment=smoke", "hydra/launcher=rayy"])
    with pytest.raises(ConfigError, match=r"hydra/sweeper='optunaa' is not an option; choose from: basic, optuna"):
        compose(["hydra/sweeper=optunaa"])
    monkeypatch.setattr(validate_sweep, "_installed", lambda module: module != "submitit")
    with pytest.raises(ConfigError, match=r"^hydra/launcher=submitit_local needs hydra-submitit-launcher, which is "
                                          r"not installed; install it: pip install -r requirements.txt$"):
        compose(["experiment=smoke", "hydra/launcher=submitit_local"])
    monkeypatch.setattr(validate_sweep, "_installed", lambda module: module != "optuna")
    with pytest.raises(ConfigError, match=r"^hydra/sweeper=optuna needs optuna, which is not installed"):
        compose(["+hparams_search=lr_kl"])  # selected by the hparams_search file, found on the composed config
    error = MissingConfigException("In 'hparams_search/x': Could not find 'hydra/launcher/ray'", "hydra/launcher/ray")
    monkeypatch.setattr(validate_sweep, "_installed", lambda module: module != "ray")
    assert str(validate_sweep.plugin_error(error, CONF_DIR)).startswith("hydra/launcher=ray needs hydra-ray-launcher")
