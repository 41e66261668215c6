"""A bad claim in an experiment is one line before any job starts (rlhf_lab/config/claims.py), from the CLI; the
report's claims go into a W&B run's summary when the jobs logged to W&B (rlhf_lab/tools/report_wandb.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_sweeps import read_offline_run

from rlhf_lab.tools.report import write_report
from tests.limits import HANG_GUARD_S
from tests.unit.test_claims import write_job


def test_a_bad_claim_on_the_command_line_stops_before_any_job(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "rlhf_lab", "experiment=kl_to_go", 'claims.0.b="kl_arm=k9_loss"',
                             f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == ("error: claim 'to_go_beats_per_position': b='kl_arm=k9_loss' names no arm of the "
                         "experiment's sweep (swept keys: kl_arm)"), result.stderr
    assert not (tmp_path / "sweep").exists()


def test_the_claims_go_into_a_wandb_summary_when_the_jobs_logged_to_wandb(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    claims = [{"name": "ordered", "metric": "final_gap", "kind": "less", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss",
               "min_effect": 0.05}]
    for number, (arm, seed, gap) in enumerate([("kl_reward", 0, 0.01), ("kl_reward", 1, 0.02), ("kl_reward", 2, 0.03),
                                               ("mse_loss", 0, 0.31), ("mse_loss", 1, 0.32), ("mse_loss", 2, 0.33)]):
        folder = tmp_path / "sweep" / f"{number}_{arm},seed={seed}"
        write_job(folder, arm, seed, gap, claims)
        (folder / "wandb_run.json").write_text(json.dumps({"id": f"r{number}", "project": "p", "group": "g1"}))
    assert write_report(tmp_path / "sweep", tmp_path / "out", wandb="off").wandb is None
    report = write_report(tmp_path / "sweep", tmp_path / "out")
    assert report.wandb is not None and "(offline, group g1)" in report.wandb
    run = read_offline_run(tmp_path / "out" / "wandb")
    summary = run["summary"]
    assert summary["claims/ordered/verdict"] == "PASS" and summary["claims/ordered/seeds"] == 3
    assert summary["claims/ordered/min_effect"] == 0.05 and summary["claims/ordered/seeds_needed"] == 2
