"""Every job of a sweep is checked before any starts; Hydra's sweep functions; short job folders.

Checks compose in-process (rlhf_lab.config.compose); one small multirun goes through the CLI (model=tiny, one step).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_lab.config.compose import CONF_DIR, compose
from rlhf_lab.config.sweep_jobs import expand_globs, expand_jobs
from rlhf_lab.errors import ConfigError
from tests.limits import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


def test_a_bad_value_in_a_later_job_stops_the_sweep_naming_that_job() -> None:
    with pytest.raises(ConfigError) as caught:
        compose(["model=tiny", "trainer.lr=1e-4,-1,2e-4"])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("sweep job 1 of 3 (model=tiny trainer.lr=-1):"), message
    assert "trainer.lr=-1" in message and "> 0" in message


def test_the_experiment_files_sweeper_params_are_checked(tmp_path: Path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "bad_sweep.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny\nhydra:\n  mode: MULTIRUN\n  sweeper:\n"
        "    params:\n      kl: k3,nope\n      seed: 0,1\n"
    )
    expected = r"sweep job 2 of 4 \(kl=nope seed=0 experiment=bad_sweep\): kl='nope' is not an option; did you mean 'none'\? choose from: abs"
    with pytest.raises(ConfigError, match=expected):
        compose([f"hydra.searchpath=[file://{tmp_path}]", "experiment=bad_sweep"])


def test_sweep_functions_expand_as_hydras_basic_sweeper_does() -> None:
    jobs = expand_jobs({"kl": "k3,kl"}, ["seed=range(0,2)", "kl=choice(k3,abs)"], CONF_DIR)
    assert jobs == [["kl=k3", "seed=0"], ["kl=k3", "seed=1"], ["kl=abs", "seed=0"], ["kl=abs", "seed=1"]]
    assert expand_globs(["kl=glob(k3*)", "seed=1"], CONF_DIR) == ["kl=k3,k3_plus", "seed=1"]  # no kl_schema


def test_interval_needs_a_search_sweeper() -> None:
    with pytest.raises(ConfigError, match=r"interval\(\) is sampled by a search sweeper.*hydra/sweeper=optuna"):
        compose(["model=tiny", "trainer.lr=interval(1e-5,1e-4)"])


def test_glob_matching_nothing_lists_the_options() -> None:
    with pytest.raises(ConfigError, match=r"matches no option of kl; choose from: abs, full"):
        expand_globs(["kl=glob(zz*)"], CONF_DIR)


def test_cli_sweep_with_choice_and_range_names_job_folders_short(tmp_path: Path) -> None:
    long_value = "x" * 120  # a long value: the folder name stays bounded, overrides.yaml keeps it whole
    command = [sys.executable, "-m", "rlhf_lab", "-m", "model=tiny", "trainer.steps=1", "trainer.eval_prompts=1",
               "algorithm.group_size=2", "trainer.max_new_tokens=4", "kl=choice(k3,kl)", "seed=range(0,1)", f"+model.system_prompt={long_value}",
               f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0_k3,seed=0", "1_kl,seed=0"]
    overrides = yaml.safe_load((tmp_path / "sweep" / "1_kl,seed=0" / ".hydra" / "overrides.yaml").read_text())
    assert f"+model.system_prompt={long_value}" in overrides and "kl=kl" in overrides
    # The run's messages go through Python logging: each job's Hydra log file holds them.
    (log_file,) = (tmp_path / "sweep" / "1_kl,seed=0").glob("*.log")
    assert "[after training] prompt:" in log_file.read_text()
    assert "train job 1 kl,seed=0" in result.stderr  # each job's progress bar names it
    # The same sweep into the same folder: its first job's folder holds a finished run; refused in one line, the
    # earlier jobs' files as they were.
    summary = (tmp_path / "sweep" / "0_k3,seed=0" / "summary.json").read_bytes()
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD_S,
                           env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert again.returncode != 0
    assert f"run folder {str(tmp_path / 'sweep' / '0_k3,seed=0')!r} already holds checkpoints" in again.stderr
    assert "Traceback" not in again.stderr
    assert (tmp_path / "sweep" / "0_k3,seed=0" / "summary.json").read_bytes() == summary
