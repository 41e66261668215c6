"""Trackers: ``logger`` as a list (csv, tensorboard, mlflow behind one interface, across a resume), one-line
errors, and the W&B run's identity (one run across resume, WANDB_* environment, tables, model artifact).

W&B is replaced by a recording stand-in (no files, no network); the other trackers write their real files.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import rlhf_lab
from rlhf_lab.errors import ConfigError

TINY = ["model=tiny", "trainer.eval_prompts=2", "trainer.progress_bar=false", "algorithm.group_size=2",
        "trainer.prompts_per_step=2", "trainer.max_new_tokens=4", "trainer.num_threads=1"]
HAS_MLFLOW = importlib.util.find_spec("mlflow") is not None


def test_csv_tensorboard_and_mlflow_together_across_a_resume(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    trackers = "[csv,tensorboard,mlflow]" if HAS_MLFLOW else "[csv,tensorboard]"
    common = [*TINY, f"logger={trackers}", f"trainer.output_dir={run_dir}"]
    rlhf_lab.train([*common, "trainer.steps=1"])
    rlhf_lab.train([*common, "trainer.steps=2", "trainer.resume=auto"])

    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    train_steps = [int(row["step"]) for row in rows if row.get("reward/mean")]
    assert train_steps == [0, 1]  # no step twice after the resume
    assert "eval/reward/mean" in rows[0] and "reward/mean" in rows[0]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("reward/mean")] == [0, 1]
    assert "eval/reward/mean" in events.Tags()["scalars"]

    if HAS_MLFLOW:
        from mlflow.tracking import MlflowClient

        client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
        (experiment,) = [e for e in client.search_experiments() if e.name == "default"]
        runs = client.search_runs([experiment.experiment_id])
        assert len(runs) == 1  # the resumed run continued the same MLflow run
        history = client.get_metric_history(runs[0].info.run_id, "reward/mean")
        assert sorted(metric.step for metric in history) == [0, 1]
        assert runs[0].data.params["trainer.max_new_tokens"] == "4"


def test_unknown_tracker_is_one_line_with_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"^logger='nope' is not an option; did you mean 'none'\? choose from: csv, "):
        rlhf_lab.compose(["model=tiny", "logger=[wandb,nope]"])


@pytest.mark.skipif(HAS_MLFLOW, reason="mlflow is installed here")
def test_mlflow_without_its_extra_names_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r"logger=mlflow needs mlflow, which is not installed; .*requirements-mlflow"):
        rlhf_lab.compose(["model=tiny", "logger=mlflow"])


def test_trackio_without_its_extra_names_what_to_install(monkeypatch) -> None:
    from rlhf_lab.trackers import multi

    monkeypatch.setattr(multi, "_installed", lambda module: module != "trackio")  # as where it is not installed
    with pytest.raises(ConfigError, match=r"^logger=trackio needs trackio, which is not installed; install the "
                                          r"optional `trackio` extra: pip install -r requirements-trackio.txt$"):
        rlhf_lab.compose(["model=tiny", "logger=[csv,trackio]"])


READ_TRACKIO = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
project = sys.argv[1]
runs = SQLiteStorage.get_runs(project)
print(json.dumps({"runs": runs, "logs": {run: SQLiteStorage.get_logs(project, run) for run in runs}}))
"""


@pytest.mark.extra("trackio")
def test_trackio_logs_one_run_across_a_resume_in_its_own_store(tmp_path: Path) -> None:
    """``logger=trackio`` in a process whose ``$TRACKIO_DIR`` is a temporary folder (trackio reads it on import): a
    run of 1 step and its resume to 2 write one trackio run, named after the run folder, with each step's metrics
    once and the sample tables; the store is that folder's (nothing uploaded)."""
    import os
    import subprocess

    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "store"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "runs" / "run"
    common = [sys.executable, "-m", "rlhf_lab", *TINY, "logger=trackio", "logger.trackio_project=tests",
              "logger.samples_every=1", f"trainer.output_dir={run_dir}"]
    for more in (["trainer.steps=1"], ["trainer.steps=2", "trainer.resume=auto"]):
        result = subprocess.run([*common, *more], capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "store" / "tests.db").is_file()
    assert json.loads((run_dir / "trackio_run.json").read_text()) == {"project": "tests", "name": "runs/run"}
    read = subprocess.run([sys.executable, "-c", READ_TRACKIO, "tests"], capture_output=True, text=True, env=env,
                          timeout=120)
    stored = json.loads(read.stdout.splitlines()[-1])
    assert stored["runs"] == ["runs/run"]
    logs = stored["logs"]["runs/run"]
    steps = [line["step"] for line in logs if "reward/mean" in line]
    assert steps == [0, 1]  # the resume continued the run, no step twice
    assert any("eval/reward/mean" in line for line in logs)
    tables = [line["samples"] for line in logs if "samples" in line]
    assert tables and tables[0]["_type"] == "trackio.table" and "response" in tables[0]["_value"][0]


# ------------------------------------------------------------------------------------------ W&B


class FakeWandb(types.ModuleType):
    """Records what the tracker asks of W&B."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits: list[dict[str, Any]] = []
        self.logged: list[dict[str, Any]] = []
        self.saved: list[str] = []
        self.artifacts: list[Any] = []
        fake = self

        class Settings:
            def __init__(self, **kwargs: Any) -> None:
                self.sync_dir, self._offline = "/nowhere", True

        class Table:
            def __init__(self, columns: list[str], log_mode: str | None = None) -> None:
                self.columns, self.data = columns, []

            def add_data(self, *values: Any) -> None:
                self.data.append(values)

        class Artifact:
            def __init__(self, name: str, type: str, metadata: dict | None = None) -> None:  # noqa: A002
                self.name, self.type, self.folders = name, type, []

            def add_dir(self, folder: str) -> None:
                self.folders.append(folder)

        class Run:
            def __init__(self, kwargs: dict[str, Any]) -> None:
                self.id, self.settings, self.summary, self.url = kwargs["id"], Settings(), {}, ""
                self.dir = str(Path(kwargs["dir"]) / "wandb_files")  # the run's own files, uploaded with it

            def define_metric(self, *args: Any, **kwargs: Any) -> None: ...
            def save(self, pattern: str, base_path: str, policy: str) -> None:
                fake.saved.append(pattern)

            def log(self, payload: dict[str, Any], step: int | None = None) -> None:
                assert step == payload["step"]  # W&B's step is the trainer's
                fake.logged.append(payload)

            def log_artifact(self, artifact: Any, aliases: list[str]) -> None:
                fake.artifacts.append(artifact)

            def finish(self, exit_code: int = 0) -> None: ...

        self.Settings, self.Table, self.Artifact = Settings, Table, Artifact
        self.init = lambda mode, settings, **kwargs: (self.inits.append(kwargs), Run(kwargs))[1]


def test_wandb_one_run_across_resume_environment_tables_and_artifact(tmp_path: Path, monkeypatch) -> None:
    from rlhf_lab.trackers.wandb import WandbTracker

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_RUN_GROUP", "env-group")
    monkeypatch.setenv("WANDB_TAGS", "baseline,lr-sweep")
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)
    cfg = OmegaConf.create({"mode": "offline", "project": None, "entity": None, "group": None, "run_name": None,
                            "tags": ["mine"], "job_type": "train", "log_model": True})

    tracker = WandbTracker(cfg, {"experiment_name": "e"}, tmp_path)
    first = fake.inits[-1]
    assert (first["project"], first["group"], first["resume"]) == ("env-project", "env-group", "allow")
    assert {"mine", "baseline", "lr-sweep"} <= set(first["tags"])
    assert fake.saved == [str(tmp_path / "wandb_files" / ".hydra" / "*")]  # copies: W&B links nothing
    assert (tmp_path / "wandb_files" / ".hydra" / "config.yaml").read_text() == "seed: 0\n"
    tracker.log_samples([{"step": 0, "prompt": "p", "response": "r", "reward": 1.0, "advantage": 0.5,
                          "reward/length": 0.2}], 0)
    tracker.log({"reward/mean": 1.0}, 0)
    tracker.log_eval_samples([{"step": 0, "prompt": "p", "response": "r", "reward": 0.3}], 0)
    tracker.log({"eval/reward/mean": 0.3}, 0)  # the evaluation's table goes out with its metrics line
    assert "eval_samples" in fake.logged[-1] and "eval/reward/mean" in fake.logged[-1]
    tables = {key: value for payload in fake.logged for key, value in payload.items() if key.endswith("samples")}
    assert tables["samples"].columns == ["step", "prompt", "response", "reward", "advantage", "reward/length"]
    assert tables["eval_samples"].data == [(0, "p", "r", 0.3)]
    tracker.finish({"steps": 2})
    (artifact,) = fake.artifacts
    assert artifact.type == "model" and artifact.folders == [str(tmp_path / "checkpoints" / "step_1")]

    WandbTracker(cfg, {}, tmp_path, resuming=True)
    assert fake.inits[-1]["id"] == first["id"]  # the resumed run continues the same W&B run
    WandbTracker(cfg, {}, tmp_path, resuming=False)
    assert fake.inits[-1]["id"] != first["id"]
    assert json.loads((tmp_path / "wandb_run.json").read_text())["id"] == fake.inits[-1]["id"]
