"""An experiment's claims (rlhf_lab/config/claims.py, rlhf_lab/tools/claims.py): the check before any job starts,
the verdicts, effects and bootstrap intervals against hand computation, and the report's table and claims.json on
synthetic job folders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from rlhf_lab.config.claims import check_claims, parse_arm
from rlhf_lab.errors import ConfigError
from rlhf_lab.tools.claims import bootstrap_interval
from rlhf_lab.tools.report import write_report

GRID = [[f"+kl_arm={arm}", f"seed={seed}"] for arm in ("kl_reward", "mse_loss") for seed in (0, 1, 2)]


def claim(**fields):
    from omegaconf import OmegaConf

    return OmegaConf.create({"name": "c", "kind": "less", "b": None, "value": None, "tolerance": 0.0,
                             "every_seed": False, "text": "", **fields})


def test_parse_arm_takes_several_keys_and_drops_the_plus() -> None:
    assert parse_arm("algorithm=grpo,+kl_arm=mse_loss") == {"algorithm": "grpo", "kl_arm": "mse_loss"}
    with pytest.raises(ConfigError, match="claim arm 'grpo' is not KEY=VALUE"):
        parse_arm("grpo")


@pytest.mark.parametrize(("fields", "message"), [
    ({"metric": "final_gapp", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss"},
     "claim 'c': metric='final_gapp' is not a report column; choose from: final_reward, .*final_gap"),
    ({"metric": "final_gap", "a": "kl_arm=k9", "b": "kl_arm=mse_loss"},
     r"claim 'c': a='kl_arm=k9' names no arm of the experiment's sweep \(swept keys: kl_arm\)"),
    ({"metric": "final_gap", "a": "kl_arm=kl_reward", "b": "algorithm=grpo"}, "b='algorithm=grpo' names no arm"),
    ({"metric": "final_gap", "a": "kl_arm=kl_reward"}, "kind=less compares a with b; set b"),
    ({"metric": "final_gap", "a": "kl_arm=kl_reward", "kind": "below", "value": 1.0}, "kind='below' is not valid"),
])
def test_a_bad_claim_is_one_line(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_claims([claim(**fields)], GRID)


def test_an_arm_must_be_one_arm_of_the_grid() -> None:
    grid = [[f"algorithm={algorithm}", f"+kl_arm={arm}", "seed=0"] for algorithm in ("grpo", "rloo")
            for arm in ("mse_loss", "k3_loss")]
    check_claims([claim(metric="final_gap", a="algorithm=grpo,kl_arm=mse_loss", b="algorithm=rloo,kl_arm=mse_loss")],
                 grid)
    with pytest.raises(ConfigError, match="a='kl_arm=mse_loss' matches 2 arms; name one with more of the swept keys"):
        check_claims([claim(metric="final_gap", a="kl_arm=mse_loss", b="algorithm=rloo,kl_arm=k3_loss")], grid)


@pytest.mark.parametrize("experiment", ["kl_to_go", "kl_placement_bias", "grpo_kl_scale", "mode_collapse",
                                        "off_policy_kl"])
def test_the_experiments_claims_pass_the_check(experiment: str) -> None:
    """Each experiment's claims against its own grid (what ``compose`` checks before the jobs; composing every job
    of the three sweeps here would take a minute)."""
    from rlhf_lab.config.compose import CONF_DIR, _hydra_compose
    from rlhf_lab.config.sweep_jobs import expand_jobs, sweeper_params

    cfg = _hydra_compose([f"experiment={experiment}"], return_hydra_config=True)
    check_claims(cfg.claims, expand_jobs(sweeper_params(cfg), [], CONF_DIR))
    assert len(cfg.claims) >= 3


def test_bootstrap_interval_brackets_the_mean_and_is_reproducible() -> None:
    values = np.array([-0.3, -0.1, -0.2])
    low, high = bootstrap_interval(values)
    assert (low, high) == bootstrap_interval(values)
    assert -0.3 <= low < -0.2 < high <= -0.1  # resampled means lie within the values' range
    assert bootstrap_interval(np.array([1.0, 1.0])) == (1.0, 1.0)


def write_job(folder: Path, arm: str, seed: int, gap: float, claims: list[dict]) -> None:
    (folder / ".hydra").mkdir(parents=True)
    config = {"kl": {"name": "kl"}, "trainer": {"steps": 1}, "seed": seed, "claims": claims}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {"kl_arm": arm}}}}))
    line = {"step": 0, "reward/mean": 0.5, "exact/gap": gap, "exact/kl_sequence": 1.0}
    (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    (folder / "summary.json").write_text("{}")


def test_the_report_prints_verdicts_effects_and_intervals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    claims = [
        {"name": "ordered", "metric": "final_gap", "kind": "less", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss",
         "every_seed": True},
        {"name": "reversed", "metric": "final_gap", "kind": "less", "a": "kl_arm=mse_loss", "b": "kl_arm=kl_reward"},
        {"name": "same", "metric": "final_gap", "kind": "equal", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss",
         "tolerance": 0.35},
        {"name": "small", "metric": "final_gap", "kind": "at_most", "a": "kl_arm=kl_reward", "value": 0.05},
        {"name": "missing", "metric": "final_gap", "kind": "less", "a": "kl_arm=full_loss", "b": "kl_arm=mse_loss"},
    ]
    gaps = {"kl_reward": [0.01, 0.02, 0.03], "mse_loss": [0.31, 0.12, 0.33]}
    number = 0
    for arm, values in gaps.items():
        for seed, gap in enumerate(values):
            write_job(tmp_path / f"{number}_{arm},seed={seed}", arm, seed, gap, claims)
            number += 1
    report = write_report(tmp_path)
    results = {result.name: result for result in report.claims}
    differences = np.array([0.01 - 0.31, 0.02 - 0.12, 0.03 - 0.33])
    assert results["ordered"].verdict == "PASS" and results["ordered"].seeds == [0, 1, 2]
    assert math.isclose(results["ordered"].effect, differences.mean())
    assert (results["ordered"].low, results["ordered"].high) == bootstrap_interval(differences)
    assert results["reversed"].verdict == "FAIL"
    assert results["same"].verdict == "PASS"  # every |a − b| ≤ 0.35
    assert results["small"].verdict == "PASS" and math.isclose(results["small"].effect, 0.02 - 0.05)
    assert results["missing"].verdict == "NO DATA" and "kl_arm=full_loss matches 0 arms" in results["missing"].why
    markdown = (tmp_path / "report.md").read_text()
    assert "## Claims" in markdown and "| ordered | PASS | final_gap | kl_arm=kl_reward < kl_arm=mse_loss | 3 |" in markdown
    summary = json.loads((tmp_path / "claims.json").read_text())
    assert summary["claims/ordered/pass"] is True and summary["claims/reversed/verdict"] == "FAIL"
    assert summary["claims/ordered/seeds"] == 3



def test_the_report_checks_an_experiments_current_claims_on_request(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from rlhf_lab.tools.report import main

    for number, (arm, seed, gap) in enumerate([("kl_reward", 0, 0.01), ("kl_reward", 1, 0.02), ("mse_loss", 0, 0.3),
                                               ("mse_loss", 1, 0.2)]):
        write_job(tmp_path / f"{number}_{arm},seed={seed}", arm, seed, gap, [])
    report = write_report(tmp_path, claims_from="kl_to_go")
    verdicts = {result.name: result.verdict for result in report.claims}
    assert verdicts["per_position_keeps_too_much_kl"] == "FAIL"  # equal KL in both arms here
    assert verdicts["to_go_beats_per_position"] == "NO DATA"  # no sequence_k1_loss arm in this folder
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--claims", "kl_to_gone"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --claims kl_to_gone: no such experiment; choose from: ")
