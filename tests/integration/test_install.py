"""A non-editable install carries the Hydra tree (``conf/`` mapped to ``rlhf_lab/conf``) and the embedded prompts,
leaves ``benchmarks/`` out, runs, and finds a user's own ``conf/`` through the search path.

The package is installed with pip into a scratch folder (from a copy of the sources, so the checkout gets
no ``build/``) and run from another working folder with only that folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.limits import HANG_GUARD_S

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RUN = ["model=tiny", "trainer.steps=1", "trainer.prompts_per_step=1", "algorithm.group_size=2",
       "trainer.max_new_tokens=2", "trainer.eval_prompts=1", "trainer.progress_bar=false", "trainer.num_threads=1"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(PROJECT_ROOT / name, source / name)
    for name in ("rlhf_lab", "conf", "benchmarks"):
        shutil.copytree(PROJECT_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, text=True, timeout=HANG_GUARD_S)
    return target


def environment(target: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return env


def test_the_install_carries_conf_and_assets(installed: Path) -> None:
    package = installed / "rlhf_lab"
    shipped = {p.relative_to(package / "conf").as_posix() for p in (package / "conf").rglob("*.yaml")}
    expected = {p.relative_to(PROJECT_ROOT / "conf").as_posix() for p in (PROJECT_ROOT / "conf").rglob("*.yaml")}
    assert shipped == expected and "config.yaml" in shipped and "experiment/smoke.yaml" in shipped
    assert not (installed / "conf").exists() and not (installed / "benchmarks").exists()
    benches = {p.name for p in (PROJECT_ROOT / "benchmarks").glob("*.py")} - {"__init__.py"}
    assert "bench_trl.py" in benches and not benches & {p.name for p in installed.rglob("*.py")}  # none shipped
    assert (package / "assets" / "movie_prompts" / "train.jsonl").is_file()
    assert (package / "assets" / "movie_prompts" / "eval.jsonl").is_file()


def test_an_installed_package_runs_from_another_folder(installed: Path, tmp_path: Path) -> None:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = environment(installed)
    where = subprocess.run([sys.executable, "-c", "import rlhf_lab.config as c; print(c.__file__); print(c.CONF_DIR)"],
                           cwd=cwd, env=env, capture_output=True, text=True, check=True)
    module_file, conf_dir = where.stdout.split()
    assert Path(module_file).is_relative_to(installed) and Path(conf_dir) == installed / "rlhf_lab" / "conf"
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", *RUN, f"trainer.output_dir={run_dir}"], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").is_file()
    assert list(cwd.iterdir()) == []  # everything went to the run folder


def test_a_users_conf_beside_the_project_joins_the_installed_tree(installed: Path, tmp_path: Path) -> None:
    project = tmp_path / "my_project"
    (project / "conf" / "reward").mkdir(parents=True)
    (project / "conf" / "reward" / "my_length.yaml").write_text(
        "defaults:\n  - length_schema\n  - _self_\nname: length\nmin_words: 3\nmax_words: 7\n")
    command = [sys.executable, "-m", "rlhf_lab", "model=tiny", "reward=my_length"]
    for where in (["--config-dir", "conf"], ["hydra.searchpath=[file://conf]"]):
        result = subprocess.run([*command, *where, "--cfg", "job"], cwd=project, env=environment(installed), capture_output=True,
                                text=True, timeout=HANG_GUARD_S)
        assert result.returncode == 0, result.stderr[-3000:]
        reward = yaml.safe_load(result.stdout)["reward"]
        assert (reward["name"], reward["min_words"], reward["max_words"]) == ("length", 3, 7)
    alone = subprocess.run([*command, "--cfg", "job"], cwd=project, env=environment(installed), capture_output=True, text=True,
                           timeout=HANG_GUARD_S)  # without the search path the option is not there
    assert alone.returncode == 2 and alone.stderr.startswith("error: reward='my_length' is not an option"), alone.stderr


def test_bench_names_the_repository_when_installed_without_it(installed: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", "bench", "--compare", "trl"], cwd=tmp_path,
                            env=environment(installed), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: rlhf-lab bench runs from a repository checkout") and "make bench" in line
