"""An experiment's claims (rlhf_lab/config/claims.py, rlhf_lab/tools/claims.py): the check before any job starts,
the verdicts, effects and t intervals against hand computation, and the report's table and claims.json on synthetic
job folders. The rule's error rates by simulation: tests/unit/test_claim_rule.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from rlhf_lab.config.claims import check_claims, parse_arm
from rlhf_lab.errors import ConfigError
from rlhf_lab.tools.report import write_report

GRID = [[f"+kl_arm={arm}", f"seed={seed}"] for arm in ("kl_reward", "mse_loss") for seed in (0, 1, 2)]


def claim(**fields):
    from omegaconf import OmegaConf

    return OmegaConf.create({"name": "c", "kind": "less", "b": None, "value": None, "min_effect": 0.01,
                             "noise": None, "text": "", **fields})


def exact_cfg(**extra):
    from omegaconf import OmegaConf

    return OmegaConf.create({"model": {"name": "exact", "exact": {"stop": False}}, "reward": {"modes": 0},
                             "trainer": {"eval_prompts": 0}, **extra})


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
        check_claims([claim(**fields)], GRID, exact_cfg())


def test_an_arm_must_be_one_arm_of_the_grid() -> None:
    grid = [[f"algorithm={algorithm}", f"+kl_arm={arm}", "seed=0"] for algorithm in ("grpo", "rloo")
            for arm in ("mse_loss", "k3_loss")]
    check_claims([claim(metric="final_gap", a="algorithm=grpo,kl_arm=mse_loss", b="algorithm=rloo,kl_arm=mse_loss")],
                 grid, exact_cfg())
    with pytest.raises(ConfigError, match="a='kl_arm=mse_loss' matches 2 arms; name one with more of the swept keys"):
        check_claims([claim(metric="final_gap", a="kl_arm=mse_loss", b="algorithm=rloo,kl_arm=k3_loss")], grid,
                     exact_cfg())


@pytest.mark.parametrize(("fields", "cfg", "message"), [
    ({"metric": "final_gap", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss", "min_effect": None}, {},
     r"claim 'c': min_effect=None must be a number > 0: the smallest effect that matters, in the metric's units "
     r"\(equal: the margin\), e.g. min_effect: 0.01"),
    ({"metric": "final_gap", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss", "min_effect": 0.0}, {},
     "claim 'c': min_effect=0.0 must be a number > 0"),
    ({"metric": "final_gap", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss"}, {"model": {"name": "tiny"}},
     r"claim 'c': metric=final_gap is the exact task's \(model=exact\), which this experiment does not log; choose "
     "a metric its jobs log, or change the experiment"),
    ({"metric": "modes_effective", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss"}, {},
     r"metric=modes_effective is logged with several optimal modes \(reward.modes\), which this experiment does not"),
    ({"metric": "diverged", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss"}, {},
     r"claim 'c': metric=diverged is 0 or 1 per seed, so a claim on it bounds a rate: kind=at_most or at_least with a "
     r"value in \(0, 1\) \(got kind=less, value=None\)"),
    ({"metric": "diverged", "a": "kl_arm=kl_reward", "kind": "at_most", "value": 0.4, "min_effect": 0.4}, {},
     r"claim 'c': 3 seed\(s\) are below its power: to detect a rate of 0 against the bound 0.4 with power 0.8 "
     r"\(α = 0.05 over 1 claims\) it needs 6; sweep seed over at least that many values"),
    ({"metric": "final_gap", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss", "min_effect": 0.1, "noise": 0.1}, {},
     r"claim 'c': 3 seed\(s\) are below its power: to detect min_effect=0.1 at noise=0.1 with power 0.8 \(α = 0.05 "
     r"over 1 claims\) it needs 8; sweep seed over at least that many values"),
])
def test_a_claim_without_its_effect_on_a_metric_not_logged_or_below_its_power_is_one_line(
        fields: dict, cfg: dict, message: str) -> None:
    """0 of n diverged PASSes 'at most 0.4' at level 0.05 once 0.6^n ≤ 0.05: n = 6; a t test for δ = σ at level
    0.05 with power 0.8 needs 8 seeds (the noncentral t)."""
    base = exact_cfg()
    merged = {**{key: base[key] for key in base}, **cfg}
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError, match=message):
        check_claims([claim(**fields)], GRID, OmegaConf.create(merged))


def test_the_seeds_are_checked_on_the_jobs_launched_and_a_left_out_arm_is_not_an_error() -> None:
    rate = claim(metric="diverged", a="kl_arm=kl_reward", kind="at_most", value=0.4, min_effect=0.4)
    enough = [[f"+kl_arm={arm}", f"seed={seed}"] for arm in ("kl_reward", "mse_loss") for seed in range(6)]
    check_claims([rate], GRID, exact_cfg(), enough)
    check_claims([rate], GRID, exact_cfg(), [job for job in enough if "+kl_arm=mse_loss" in job])  # arm left out


@pytest.mark.parametrize("experiment", ["kl_to_go", "kl_placement_bias", "grpo_kl_scale", "mode_collapse",
                                        "off_policy_kl", "async_kl", "async_drop_bias"])
def test_the_experiments_claims_pass_the_check(experiment: str) -> None:
    """Each experiment's claims against its own grid (what ``compose`` checks before the jobs; composing every job
    of the three sweeps here would take a minute)."""
    from rlhf_lab.config.compose import CONF_DIR, _hydra_compose
    from rlhf_lab.config.sweep_jobs import expand_jobs, sweeper_params

    cfg = _hydra_compose([f"experiment={experiment}"], return_hydra_config=True)
    check_claims(cfg.claims, expand_jobs(sweeper_params(cfg), [], CONF_DIR), cfg)
    assert len(cfg.claims) >= 3 and all(claim.min_effect > 0 for claim in cfg.claims)


def write_job(folder: Path, arm: str, seed: int, gap: float, claims: list[dict]) -> None:
    (folder / ".hydra").mkdir(parents=True)
    config = {"kl": {"name": "kl"}, "trainer": {"steps": 1}, "seed": seed, "claims": claims}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": {"kl_arm": arm}}}}))
    line = {"step": 0, "reward/mean": 0.5, "exact/gap": gap, "exact/kl_sequence": 1.0}
    (folder / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    (folder / "summary.json").write_text("{}")


def test_the_report_prints_verdicts_effects_and_intervals(tmp_path: Path) -> None:
    """Five claims with data (m = 5), 4 seeds: each verdict, effect and interval against Student's t computed here."""
    from scipy import stats

    from rlhf_lab.tools import claim_rule

    claims = [
        {"name": "ordered", "metric": "final_gap", "kind": "less", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss",
         "min_effect": 0.1},
        {"name": "reversed", "metric": "final_gap", "kind": "less", "a": "kl_arm=mse_loss", "b": "kl_arm=kl_reward",
         "min_effect": 0.1},
        {"name": "same", "metric": "final_gap", "kind": "equal", "a": "kl_arm=kl_reward", "b": "kl_arm=mse_loss",
         "min_effect": 0.35},
        {"name": "small", "metric": "final_gap", "kind": "at_most", "a": "kl_arm=kl_reward", "value": 0.05,
         "min_effect": 0.01},
        {"name": "tiny", "metric": "final_gap", "kind": "less", "a": "kl_arm=kl_reward", "b": "kl_arm=k3_loss",
         "min_effect": 0.05},
        {"name": "missing", "metric": "final_gap", "kind": "less", "a": "kl_arm=full_loss", "b": "kl_arm=mse_loss",
         "min_effect": 0.1},
    ]
    gaps = {"kl_reward": [0.01, 0.02, 0.03, 0.02], "mse_loss": [0.31, 0.32, 0.33, 0.31],
            "k3_loss": [0.011, 0.021, 0.031, 0.021]}  # k3_loss: 0.001 above kl_reward in every seed
    number = 0
    for arm, values in gaps.items():
        for seed, gap in enumerate(values):
            write_job(tmp_path / f"{number}_{arm},seed={seed}", arm, seed, gap, claims)
            number += 1
    report = write_report(tmp_path)
    results = {result.name: result for result in report.claims}
    level = 0.05 / 5
    differences = np.array(gaps["kl_reward"]) - np.array(gaps["mse_loss"])  # −0.30, −0.30, −0.30, −0.29
    mean, error = differences.mean(), differences.std(ddof=1) / 2
    half = stats.t.ppf(1 - level, 3) * error
    ordered = results["ordered"]
    assert ordered.verdict == "PASS" and ordered.seeds == [0, 1, 2, 3] and ordered.why == ""
    assert (ordered.effect, ordered.low, ordered.high) == pytest.approx((mean, mean - half, mean + half))
    assert ordered.false_pass == pytest.approx(level)
    assert results["reversed"].verdict == "FAIL" and results["reversed"].why == "short of min_effect"
    assert results["same"].verdict == "PASS"  # |a − b| ≈ 0.3 within the margin 0.35, well beyond the noise
    small = results["small"]  # a − 0.05 = −0.04, −0.03, −0.02, −0.03: below the bound by 0.03 ± 0.008
    assert small.effect == pytest.approx(-0.03)
    needed = claim_rule.seeds_needed(lambda n: claim_rule.mean_power(n, small.sd, 0.01, level))
    assert needed > 4 and small.verdict == "INCONCLUSIVE" and small.why.startswith(f"needs {needed} seeds, has 4")
    assert small.why.endswith("; its test would PASS at these seeds")  # decisive, but below its power: not printed
    # a consistent difference of 0.001 (sd 0) is real but not the claim's 0.05: FAIL, as −0.00075 modes should
    assert results["tiny"].verdict == "FAIL" and results["tiny"].effect == pytest.approx(-0.001)
    assert results["missing"].verdict == "NO DATA" and "kl_arm=full_loss matches 0 arms" in results["missing"].why
    markdown = (tmp_path / "report.md").read_text()
    assert "## Claims" in markdown and "Holm-corrected" in markdown
    assert "| ordered | PASS | final_gap | kl_arm=kl_reward < kl_arm=mse_loss | -0.297 |" in markdown
    summary = json.loads((tmp_path / "claims.json").read_text())
    assert summary["claims/ordered/pass"] is True and summary["claims/reversed/verdict"] == "FAIL"
    assert summary["claims/ordered/seeds"] == 4 and summary["claims/small/seeds_needed"] == needed
    assert summary["claims/ordered/min_effect"] == 0.1 and summary["claims/ordered/false_pass_rate"] == level


def test_the_report_checks_an_experiments_current_claims_on_request(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from rlhf_lab.tools.report import main

    for number, (arm, seed, gap) in enumerate([("kl_reward", 0, 0.01), ("kl_reward", 1, 0.02), ("mse_loss", 0, 0.3),
                                               ("mse_loss", 1, 0.2)]):
        write_job(tmp_path / f"{number}_{arm},seed={seed}", arm, seed, gap, [])
    report = write_report(tmp_path, claims_from="kl_to_go")
    verdicts = {result.name: result.verdict for result in report.claims}
    assert verdicts["per_position_keeps_too_much_kl"] == "FAIL"  # equal KL in both arms here (sd 0: certain)
    assert verdicts["to_go_beats_per_position"] == "NO DATA"  # no sequence_k1_loss arm in this folder
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--claims", "kl_to_gone"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: --claims kl_to_gone: no such experiment; choose from: ")


def test_an_experiment_launched_with_fewer_seeds_than_its_claims_need_is_refused_before_any_job() -> None:
    """off_policy_kl's first claim, at the noise the YAML states (0.123), needs 19 seeds to detect 0.1 nats at
    α = 0.05 over its 6 claims; its stability claim (at most 0.4 of seeds diverge) would need 10."""
    from rlhf_lab.config.compose import compose

    with pytest.raises(ConfigError) as refused:
        compose(["experiment=off_policy_kl", "seed=0,1,2,3,4,5,6,7,8"])
    assert str(refused.value) == (
        "claim 'k1_reward_beats_k3_loss_on_policy': 9 seed(s) are below its power: to detect min_effect=0.1 at "
        "noise=0.123 with power 0.8 (α = 0.05 over 6 claims) it needs 19; sweep seed over at least that many values")
