"""``rlhf-lab report --replicate`` (rlhf_lab/tools/report_replicate.py): the sweep it launches (the folder's own jobs,
cut to the claims' arms, at fresh seeds), both verdicts side by side with a changed one flagged, in report.md,
claims.json and the console; its refusals in one line. The launch itself is the CLI's (a subprocess); here it is
replaced by one that writes the jobs the sweep would, so the test reads what the report does with them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from rlhf_lab.errors import ConfigError, ToolError
from rlhf_lab.tools import report_replicate
from rlhf_lab.tools.report import main, write_report

CLAIMS = [{"name": "ordered", "metric": "final_gap", "kind": "less", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss",
           "min_effect": 0.1}]


def write_job(folder: Path, arm: str, seed: int, gap: float, claims: list[dict]) -> None:
    (folder / ".hydra").mkdir(parents=True)
    config = {"kl": {"name": "kl"}, "trainer": {"steps": 1}, "seed": seed, "claims": claims}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {"kl_arm": arm}}}}))
    overrides = ["experiment=kl_placement_bias", f"+kl_arm={arm}", f"seed={seed}", "trainer.steps=40"]
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    line = {"step": 0, "reward/mean": 0.5, "exact/gap": gap, "exact/kl_sequence": 1.0}
    (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    (folder / "summary.json").write_text("{}")


def sweep(folder: Path, gaps: dict[str, list[float]], seeds: list[int], claims: list[dict]) -> None:
    number = 0
    for arm, values in gaps.items():
        for seed, gap in zip(seeds, values):
            write_job(folder / str(number), arm, seed, gap, claims)
            number += 1


ORIGINAL = {"kl_reward": [0.01, 0.02, 0.03, 0.02], "mse_loss": [0.31, 0.32, 0.33, 0.31],
            "full_loss": [0.5, 0.5, 0.5, 0.5]}  # full_loss: an arm no claim names


def test_the_replication_is_the_folders_jobs_cut_to_the_claims_arms_at_fresh_seeds(tmp_path: Path,
                                                                                   monkeypatch, capsys) -> None:
    folder = tmp_path / "multirun"
    sweep(folder, ORIGINAL, [0, 1, 2, 3], CLAIMS)
    launched = []

    def fake_run(command: list[str], check: bool) -> subprocess.CompletedProcess:
        launched.append(command)
        target = Path(next(part for part in command if part.startswith("hydra.sweep.dir=")).split("=", 1)[1])
        # at fresh seeds the order reverses: the claim flips
        sweep(target, {"kl_reward": [0.31, 0.32, 0.33, 0.31], "mse_loss": [0.01, 0.02, 0.03, 0.02]},
              [100, 101, 102, 103], CLAIMS)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(report_replicate.subprocess, "run", fake_run)
    main([str(folder), "--replicate", "--wandb", "off"])
    (command,) = launched
    target = tmp_path / "multirun_replicate"
    assert command[1:] == ["-m", "rlhf_lab", "--multirun", "experiment=kl_placement_bias",
                           "+kl_arm=kl_reward,mse_loss", "trainer.steps=40", "seed=100,101,102,103",
                           "trainer.resume=auto", f"hydra.sweep.dir={target}"]
    out = capsys.readouterr().out
    assert f"replicating the claims at seeds 100,101,102,103 into {target}" in out
    assert "PASS ordered:" in out and "at fresh seeds FAIL **FLIPPED**: 0.297" in out
    markdown = (folder / "report.md").read_text()
    assert "| at fresh seeds |" in markdown and "FAIL **FLIPPED**: 0.297 [" in markdown
    summary = json.loads((folder / "claims.json").read_text())
    assert summary["claims/ordered/verdict"] == "PASS" and summary["claims/ordered/replicate_verdict"] == "FAIL"
    assert summary["claims/ordered/replicate_flipped"] is True and summary["claims/ordered/replicate_seeds"] == 4
    # the original folder's report does not take in the replication's jobs (it sits beside the folder)
    assert "12 jobs in 3 arms" in markdown


def test_a_replication_that_agrees_is_not_flagged(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "multirun"
    sweep(folder, ORIGINAL, [0, 1, 2, 3], CLAIMS)
    seen = []

    def fake_run(command: list[str], check: bool) -> subprocess.CompletedProcess:
        seen.append(command)
        target = Path(command[-1].split("=", 1)[1])
        sweep(target, ORIGINAL, [7, 8, 9, 10], CLAIMS)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(report_replicate.subprocess, "run", fake_run)
    report = write_report(folder, wandb="off", replicate=[7, 8, 9, 10])
    assert "seed=7,8,9,10" in seen[0]
    (result,) = report.claims
    assert result.replicated["verdict"] == "PASS" and result.replicated["flipped"] is False
    # a replication whose jobs all finished is read again, not relaunched
    monkeypatch.setattr(report_replicate.subprocess, "run", lambda *a, **k: pytest.fail("launched again"))
    again = write_report(folder, wandb="off", replicate=[7, 8, 9, 10])
    assert again.claims[0].replicated == result.replicated


def test_replicate_refusals_are_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    folder = tmp_path / "multirun"
    sweep(folder, ORIGINAL, [0, 1, 2, 3], [])
    monkeypatch.setattr(report_replicate.subprocess, "run", lambda *a, **k: pytest.fail("nothing may launch"))
    with pytest.raises(ToolError, match=rf"^--replicate: {folder} has no claims \(its jobs ran no experiment with "
                                        r"claims:\); --claims EXPERIMENT names an experiment's$"):
        write_report(folder, wandb="off", replicate=[])
    claimed = tmp_path / "claimed"
    sweep(claimed, ORIGINAL, [0, 1, 2, 3], CLAIMS)
    with pytest.raises(ToolError, match=r"^--replicate 3,100: seed\(s\) 3 are the folder's own; choose fresh "):
        write_report(claimed, wandb="off", replicate=[3, 100])
    with pytest.raises(SystemExit) as stopped:
        main([str(claimed), "--replicate", "1,x"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "error: --replicate 1,x: not a list of integer seeds (e.g. 100,101,102)\n"


def test_a_failed_replication_says_where_its_jobs_are(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "multirun"
    sweep(folder, ORIGINAL, [0, 1, 2, 3], CLAIMS)
    monkeypatch.setattr(report_replicate.subprocess, "run",
                        lambda command, check: subprocess.CompletedProcess(command, 130))
    with pytest.raises(ToolError, match=r"^--replicate: the replication's sweep stopped \(exit 130\); its jobs are in "
                                        rf"{tmp_path / 'multirun_replicate'}, and the same command resumes it$"):
        write_report(folder, wandb="off", replicate=[])


def test_the_replications_overrides_compose_into_the_experiments_sweep(monkeypatch) -> None:
    """The overrides the replication launches, for a real experiment's jobs, pass the CLI's checks (arms, claims,
    seeds against power) as a sweep; too few fresh seeds for a claim's power are refused as a launch would be."""
    from types import SimpleNamespace

    from rlhf_lab.config.compose import _hydra_compose, compose

    def jobs_of(experiment: str, group: str, arms: tuple[str, ...]) -> list[SimpleNamespace]:
        return [SimpleNamespace(folder=None, config={"seed": seed},
                                overrides=[f"experiment={experiment}", f"+{group}={arm}", f"seed={seed}"])
                for arm in arms for seed in range(10)]

    monkeypatch.setattr(report_replicate, "_job_overrides", lambda job: job.overrides)
    jobs = jobs_of("async_drop_bias", "drop_arm", ("sync", "continuous", "drop6", "wait6", "drop5", "wait5"))
    assert report_replicate.fresh_seeds({job.config["seed"] for job in jobs} | {101}, 3) == [100, 102, 103]
    seeds = report_replicate.fresh_seeds({job.config["seed"] for job in jobs}, 2)  # 12 jobs to compose, not 60
    claims = list(_hydra_compose(["experiment=async_drop_bias"]).claims)
    overrides = report_replicate.replication_overrides(jobs, claims, seeds)
    assert overrides == ["experiment=async_drop_bias", "+drop_arm=continuous,drop6,drop5,wait5", "seed=100,101"]
    cfg = compose(overrides)
    assert cfg.experiment_name == "async_drop_bias" and cfg.seed == 100
    kl_to_go = jobs_of("kl_to_go", "kl_arm", ("sequence_k1_loss", "mse_loss", "kl_reward", "k1_plus_loss",
                                             "full_loss", "sequence_full_loss"))
    overrides = report_replicate.replication_overrides(kl_to_go, list(_hydra_compose(["experiment=kl_to_go"]).claims),
                                                       seeds)
    with pytest.raises(ConfigError, match=r"^claim 'to_go_beats_per_position': 2 seed\(s\) are below its power"):
        compose(overrides)
