"""W&B for the dashboards: the step axis across a resume, summary min/max, sample tables with KL and length,
``rlhf-lab eval`` in its training run's group, ``wandb agent`` driving rlhf_lab, the sweep file and the workspace
view. Every run is offline (read back from its ``.wandb`` transaction log); nothing contacts a server."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from test_sweeps import read_metrics, read_offline_run, read_offline_runs
from test_wandb import _isolated_wandb  # noqa: F401  (offline, no credentials, W&B folders in a tmp folder)

import rlhf_lab
from tests.limits import HANG_GUARD_S

pytestmark = pytest.mark.integration

TINY = ["+experiment=smoke", "hydra.mode=RUN", "logger=wandb", "logger.mode=offline", "trainer.device=cpu",
        "trainer.eval_prompts=0", "trainer.samples_per_step_logged=4"]


def _tables(segment: dict) -> list[dict]:
    """The sample tables a segment logged, read from its files (W&B writes each logged table as JSON)."""
    files = sorted((segment["folder"] / "files" / "media" / "table").glob("samples_*.table.json"))
    return [json.loads(path.read_text()) for path in files]


def test_a_resumed_run_continues_the_step_axis_and_the_eval_joins_its_group(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rlhf_lab.train([*TINY, f"trainer.output_dir={run_dir}", "trainer.steps=2"])
    rlhf_lab.train([*TINY, f"trainer.output_dir={run_dir}", "trainer.steps=4", "trainer.resume=auto"])

    first, second = read_offline_runs(run_dir / "wandb")
    assert first["id"] == second["id"] and (first["job_type"], first["group"]) == ("train", "smoke")
    for segment in (first, second):  # W&B's own step is the trainer's
        assert all(row["_step"] == row["step"] for row in segment["history"])
    trained = [sorted({row["step"] for row in s["history"] if "reward/mean" in row}) for s in (first, second)]
    assert trained == [[0, 1], [2, 3]]  # the second segment starts where the checkpoint left off

    lines = read_metrics(run_dir)
    rewards = [line["reward/mean"] for line in lines if "reward/mean" in line]
    assert len(rewards) == 4  # min/max over the whole run, not the last segment only
    assert second["summary"]["reward/mean/min"] == pytest.approx(min(rewards))
    assert second["summary"]["reward/mean/max"] == pytest.approx(max(rewards))

    # Sample tables: per-sample KL and length. All 4 samples of a step are logged, so their means are the step's
    # kl/exact_sequence and response/length_mean.
    table = _tables(first)[0]
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert {"kl", "length"} <= set(table["columns"]) and len(rows) == 4
    step = next(line for line in lines if line.get("step") == rows[0]["step"] and "reward/mean" in line)
    assert sum(r["kl"] for r in rows) / 4 == pytest.approx(step["kl/exact_sequence"], rel=1e-5, abs=1e-7)
    assert sum(r["length"] for r in rows) / 4 == pytest.approx(step["response/length_mean"])

    from rlhf_lab.tools.evaluate import evaluate_source

    result = evaluate_source(str(run_dir), ["trainer.eval_prompts=2", "logger.mode=offline"])
    evaluation = read_offline_run(Path(result["out"]) / "wandb")
    assert (evaluation["job_type"], evaluation["group"]) == ("eval", "smoke")
    assert evaluation["config"]["evaluates"]["wandb_run_id"] == first["id"]
    assert evaluation["config"]["evaluates"]["step"] == result["step"]
    assert evaluation["id"] != first["id"]


def test_a_wandb_agent_runs_rlhf_lab_with_its_run_id_and_values(tmp_path: Path, monkeypatch) -> None:
    """W&B's own agent code builds the command from the sweep file's grid point and starts it; the run is the
    agent's W&B run (id and sweep), trained with the point's values."""
    from wandb.wandb_agent import Agent

    from rlhf_lab.trackers.wandb_sweep import sweep_config

    config = sweep_config(["experiment=smoke", "algorithm=grpo,rloo", "kl=k3,kl", "logger=wandb",
                           "logger.mode=offline", "trainer.eval_prompts=0", "trainer.steps=1"])
    assert config["method"] == "grid" and config["parameters"]["algorithm"] == {"values": ["grpo", "rloo"]}
    point = {key: spec["values"][-1] if "values" in spec else spec["value"]
             for key, spec in config["parameters"].items()}
    monkeypatch.chdir(tmp_path)
    for key in ("WANDB_RUN_ID", "WANDB_SWEEP_PARAM_PATH", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep42")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    agent = Agent.__new__(Agent)
    agent._sweep_command, agent._in_jupyter, agent._function = config["command"], False, None
    agent._forward_signals, agent._run_processes = False, {}
    agent._command_run({"run_id": "agentrun1", "program": None, "args": {k: {"value": v} for k, v in point.items()}})
    assert agent._run_processes["agentrun1"]._popen.wait(timeout=HANG_GUARD_S) == 0

    (run_dir,) = (tmp_path / "outputs" / "smoke").iterdir()  # one plain run, not a multirun
    run = read_offline_run(run_dir / "wandb")
    assert (run["id"], run["sweep_id"]) == ("agentrun1", "sweep42")
    assert json.loads((run_dir / "wandb_run.json").read_text())["id"] == "agentrun1"
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    assert {"algorithm=rloo", "kl=kl", "trainer.steps=1"} <= set(overrides)
    assert (run["config"]["algorithm_name"], run["config"]["kl_name"]) == ("rloo", "kl")
    assert [line["step"] for line in read_metrics(run_dir) if "reward/mean" in line] == [0]
