"""MLflow tracker (``logger=mlflow``; optional extra: ``pip install -r requirements-mlflow.txt``).

Store: ``logger.mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else a local file store in
``<run folder>/mlruns`` (``mlflow ui --backend-store-uri <run folder>/mlruns``). Experiment:
``logger.mlflow_experiment`` or ``experiment_name``. The run id is kept in ``<run folder>/mlflow_run.json``, so a
resumed run (``trainer.resume``) continues the same MLflow run. Logged: the flat resolved config as params, every
numeric metric per step, the job's overrides as tags, sample tables as JSON artifacts, ``.hydra/`` and the summary.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rlhf_lab.registry import register
from rlhf_lab.trackers.base import Tracker

ID_FILE = "mlflow_run.json"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)[:500]  # MLflow's limit on a parameter's value
    return flat


@register("logger", "mlflow")
class MlflowTracker(Tracker):
    def __init__(self, logger_cfg: Any, config: dict[str, Any], run_dir: Path, resuming: bool = False) -> None:
        super().__init__(logger_cfg, config, run_dir)
        self.run_dir = Path(run_dir)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the local default is a file store
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = (logger_cfg.get("mlflow_tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
               or (self.run_dir / "mlruns").resolve().as_uri())
        self.client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        id_file = self.run_dir / ID_FILE
        stored = json.loads(id_file.read_text()) if resuming and id_file.is_file() else {}
        if stored.get("tracking_uri") == uri:
            self.run_id = stored["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = logger_cfg.get("mlflow_experiment") or str(config.get("experiment_name", "default"))
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=self.run_dir.name,
                                     tags={"run_dir": str(self.run_dir.resolve())})
        self.run_id = run.info.run_id
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": uri}))
        params = [Param(key, value) for key, value in flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        hydra_dir = self.run_dir / ".hydra"
        if hydra_dir.is_dir():
            self.client.log_artifacts(self.run_id, str(hydra_dir), ".hydra")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            if hasattr(value, "item"):
                value = value.item()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                batch.append(Metric(key, float(value), now, step))
        for start in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        self.client.log_dict(self.run_id, rows, f"samples/step_{step}.json")

    def log_eval_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        self.client.log_dict(self.run_id, rows, f"eval_samples/step_{step}.json")

    def finish(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id)
