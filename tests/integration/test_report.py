"""``rlhf-lab report`` (rlhf_lab/tools/report.py): hand-computed numbers on synthetic job folders, one real sweep
(the smoke sweep of test_sweeps.py, run once per session), valid plots and the no-jobs error."""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_sweeps import read_metrics, smoke_sweep, swept

from rlhf_lab.app.cli import main as cli_main
from rlhf_lab.tools import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_job(folder: Path, config: dict, lines: list, choices: dict | None = None, torn: bool = False) -> None:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    if choices is not None:
        (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (folder / "metrics.jsonl").write_text(text + ('{"step": 9, "reward/me' if torn else ""))


def config(algorithm: str, seed: int, baseline: str, logger_mode: str = "offline") -> dict:
    return {
        "algorithm": {"name": "reinforce" if algorithm == "rloo" else algorithm, "baseline": baseline},
        "kl": {"name": "k3", "coef": 0.05, "placement": "loss"},
        "trainer": {"steps": 3, "output_dir": None},
        "logger": {"name": "wandb", "mode": logger_mode},
        "seed": seed,
        "experiment_name": "synthetic",
    }


def train_line(step: int, reward: float, estimate: float, exact: float, seconds: float, **extra) -> dict:
    return {
        "step": step,
        "reward/mean": reward,
        "reward/std": 0.1,
        "kl/estimate": estimate,
        "kl/exact": exact,
        "time/step_s": seconds,
        **extra,
    }


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    """Arm grpo: seeds 0 and 1; arm rloo (algorithm.name `reinforce`, baseline loo): seed 0 only."""
    write_job(
        tmp_path / "0_algorithm=grpo,seed=0",
        config("grpo", 0, "group"),
        [
            train_line(0, 0.1, 0.02, 0.01, 1.0),
            train_line(1, 0.5, 0.03, 0.02, 3.0),
            train_line(2, 0.3, 0.05, 0.04, 2.0),
            {"step": 3, "eval/reward/mean": 0.4, "eval/kl/exact": 0.05},
        ],
        choices={"algorithm": "grpo", "kl": "k3", "hydra/launcher": "basic"},
    )
    write_job(
        tmp_path / "1_algorithm=grpo,seed=1",
        config("grpo", 1, "group", logger_mode="disabled"),
        [
            train_line(0, 0.2, 0.01, 0.01, 2.0),
            train_line(1, 0.4, 0.04, 0.01, 2.0),
            train_line(2, 0.7, 0.03, 0.06, 4.0),
            {"step": 3, "eval/reward/mean": 0.6, "eval/kl/exact": 0.07},
        ],
        choices={"algorithm": "grpo", "kl": "k3"},
        torn=True,
    )
    write_job(
        tmp_path / "2_algorithm=rloo,seed=0",
        config("rloo", 0, "loo"),
        [
            {"step": 1, "eval/reward/mean": 9.0},  # an eval-only line out of order: not a training step
            train_line(0, 1.0, 0.5, 0.25, 5.0),
            train_line(1, 2.0, 0.5, 0.75, 7.0, **{"eval/reward/mean": 1.5}),  # eval merged into a step line
            train_line(2, 1.5, 1.0, 0.5, 6.0),
            {"step": 3, "eval/reward/mean": 3.0},
        ],
        choices={"algorithm": "rloo", "kl": "k3"},
    )
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    return tmp_path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_synthetic_report_numbers_by_hand(synthetic: Path, capsys) -> None:
    report.main([str(synthetic)])
    rows = {row["arm"]: row for row in read_csv(synthetic / "report.csv")}
    # Arms differ by the algorithm only (seed, logger.mode and the follow-on keys are not arm keys).
    assert list(rows) == ["algorithm=grpo", "algorithm=rloo"]
    grpo, rloo = rows["algorithm=grpo"], rows["algorithm=rloo"]
    assert (grpo["n_seeds"], grpo["seeds"], rloo["n_seeds"]) == ("2", "0,1", "1")

    def check(row: dict, name: str, mean: float, std: float) -> None:
        assert float(row[f"{name}_mean"]) == pytest.approx(mean), name
        if math.isnan(std):
            assert math.isnan(float(row[f"{name}_std"])), name
        else:
            assert float(row[f"{name}_std"]) == pytest.approx(std), name

    sqrt2 = math.sqrt(2)
    # grpo seed 0: final 0.3, best 0.5, final KL 0.04, bias mean(0.01, 0.01, 0.01), median s/step 2, eval 0.4
    # grpo seed 1: final 0.7, best 0.7, final KL 0.06, bias mean(0, 0.03, -0.03),    median s/step 2, eval 0.6
    check(grpo, "final_reward", 0.5, 0.4 / sqrt2)
    check(grpo, "best_reward", 0.6, 0.2 / sqrt2)
    check(grpo, "final_kl_exact", 0.05, 0.02 / sqrt2)
    check(grpo, "kl_estimate_minus_exact", 0.005, 0.01 / sqrt2)
    check(grpo, "step_time_s", 2.0, 0.0)
    check(grpo, "eval_reward", 0.5, 0.2 / sqrt2)
    # rloo, one seed: no std. bias = mean(0.25, -0.25, 0.5); median(5, 7, 6) = 6; the last eval line is step 3.
    check(rloo, "final_reward", 1.5, math.nan)
    check(rloo, "best_reward", 2.0, math.nan)
    check(rloo, "final_kl_exact", 0.5, math.nan)
    check(rloo, "kl_estimate_minus_exact", 0.5 / 3, math.nan)
    check(rloo, "step_time_s", 6.0, math.nan)
    check(rloo, "eval_reward", 3.0, math.nan)

    printed = capsys.readouterr().out
    markdown = (synthetic / "report.md").read_text()
    assert (
        "| algorithm=grpo | 2 | 0.5 ± 0.28 | 0.6 ± 0.14 | 0.05 ± 0.014 | 0.005 ± 0.0071 | 2 ± 0 | 0.5 ± 0.14 |"
        in printed
    )
    assert "| algorithm=rloo | 1 | 1.5 | 2 | 0.5 | 0.1667 | 6 | 3 |" in printed
    assert printed.split("\n\n")[0] in markdown
    for name in report.PLOTS:
        assert f"]({name})" in markdown


def test_synthetic_curves_and_plots(synthetic: Path) -> None:
    report.main([str(synthetic), "--out", str(synthetic / "out")])
    arms = report.group_arms(report.find_jobs(synthetic))
    steps, means, stds = report.curve(arms[0], "reward/mean")
    assert steps.tolist() == [0, 1, 2]
    np.testing.assert_allclose(means, [0.15, 0.45, 0.5])
    np.testing.assert_allclose(stds, np.std([[0.1, 0.5, 0.3], [0.2, 0.4, 0.7]], axis=0, ddof=1))
    steps, means, stds = report.curve(arms[1], "kl/exact")  # eval-only lines are not on the curve
    assert (steps.tolist(), means.tolist(), stds.tolist()) == ([0, 1, 2], [0.25, 0.75, 0.5], [0.0, 0.0, 0.0])
    assert_valid_pngs(synthetic / "out")
    assert not (synthetic / "report.csv").exists()


def assert_valid_pngs(folder: Path) -> None:
    import matplotlib.image

    for name in report.PLOTS:
        path = folder / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name
        assert image[..., :3].std() > 0, f"{name} is blank"


def test_arm_labels_skip_keys_that_follow_from_others(tmp_path: Path) -> None:
    for index, (kl, coef, seed) in enumerate([("k3", 0.05, 0), ("none", 0.0, 0), ("k3", 0.05, 1), ("none", 0.0, 1)]):
        cfg = {"kl": {"name": kl, "coef": coef, "placement": "loss"}, "seed": seed}
        write_job(tmp_path / f"{index}_job", cfg, [train_line(0, 1.0, 0.0, 0.0, 1.0)])
    arms = report.group_arms(report.find_jobs(tmp_path))
    assert [(arm.name, len(arm.jobs)) for arm in arms] == [("kl=k3", 2), ("kl=none", 2)]


def test_no_jobs_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty_job" / ".hydra").mkdir(parents=True)  # a folder without metrics.jsonl is no job
    for folder, message in (
        (tmp_path, f"error: no jobs in {tmp_path}: expected job folders with metrics.jsonl"),
        (tmp_path / "missing", f"error: {tmp_path / 'missing'} is not a folder"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["report", str(folder)])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(message) and "\n" not in error


def test_report_on_the_real_smoke_sweep(tmp_path_factory, capsys) -> None:
    sweep = smoke_sweep(tmp_path_factory.getbasetemp())
    cli_main(["report", str(sweep.folder)])
    printed = capsys.readouterr().out
    print(printed)  # shown with -s: the smoke sweep's table
    rows = read_csv(sweep.folder / "report.csv")
    assert [row["arm"] for row in rows] == [swept(job) for job in sweep.jobs()]
    for row, job in zip(rows, sweep.jobs()):
        lines = read_metrics(job)
        train = [line for line in lines if "reward/mean" in line]
        expected = {
            "final_reward": train[-1]["reward/mean"],
            "best_reward": max(line["reward/mean"] for line in train),
            "final_kl_exact": train[-1]["kl/exact"],
            "kl_estimate_minus_exact": np.mean([line["kl/estimate"] - line["kl/exact"] for line in train]),
            "step_time_s": np.median([line["time/step_s"] for line in train]),
            "eval_reward": [line for line in lines if "eval/reward/mean" in line][-1]["eval/reward/mean"],
        }
        assert row["n_seeds"] == "1"
        for name, value in expected.items():
            assert float(row[f"{name}_mean"]) == pytest.approx(value), (job.name, name)
        assert f"| {row['arm']} | 1 |" in printed
    assert_valid_pngs(sweep.folder)
    assert (sweep.folder / "report.md").read_text().count("| algorithm=") == 4


def test_offline_stages_share_the_table_and_the_frontier_through_their_evaluations(tmp_path: Path) -> None:
    # A GRPO job (training lines + evaluations) and a DPO job (evaluations and losses only), two seeds each.
    for seed in (0, 1):
        rl_lines = [train_line(s, 0.1 * s, 0.01, 0.02, 1.0) for s in range(3)]
        rl_lines += [{"step": 0, "eval/reward/mean": 0.2, "eval/kl/exact": 0.0},
                     {"step": 3, "eval/reward/mean": 0.5 + 0.1 * seed, "eval/kl/exact": 0.04}]
        write_job(tmp_path / f"{seed}_grpo", config("grpo", seed, "none"), rl_lines)
        dpo_lines = [{"step": s, "loss/total": 0.7 - 0.1 * s, "time/step_s": 2.0} for s in range(3)]
        dpo_lines += [{"step": 0, "eval/reward/mean": 0.2, "eval/kl/exact": 0.0},
                      {"step": 3, "eval/reward/mean": 0.3 + 0.1 * seed, "eval/kl/exact": 0.01}]
        write_job(tmp_path / f"{2 + seed}_dpo", config("dpo", seed, "none"), dpo_lines)
    table, rows = report.build_report(tmp_path)
    by_arm = {row["arm"]: row for row in rows}
    assert set(by_arm) == {"algorithm=grpo", "algorithm=dpo"}
    assert by_arm["algorithm=dpo"]["eval_reward_mean"] == pytest.approx(0.35)
    assert by_arm["algorithm=dpo"]["eval_kl_exact_mean"] == pytest.approx(0.01)
    assert math.isnan(by_arm["algorithm=dpo"]["final_reward_mean"])  # no sampled training reward
    assert by_arm["algorithm=grpo"]["eval_reward_mean"] == pytest.approx(0.55)
    assert by_arm["algorithm=grpo"]["final_reward_mean"] == pytest.approx(0.2)
    assert "eval KL (exact, per token)" in table
    # The frontier uses every arm's final evaluation: GRPO (KL .04, reward .55) and DPO (.01, .35) both on it.
    from rlhf_lab.tools.report_plots import last_k_point

    arms = report.group_arms(report.find_jobs(tmp_path))
    points = {arm.name: last_k_point(arm, 1, "eval")[:2] for arm in arms}
    assert points["algorithm=dpo"] == pytest.approx((0.01, 0.35))
    assert points["algorithm=grpo"] == pytest.approx((0.04, 0.55))
    assert (tmp_path / "reward_vs_kl.png").stat().st_size > 0


def test_arms_are_labelled_by_every_varying_key_with_short_floats(tmp_path: Path) -> None:
    """A search varies kl.coef and trainer.lr together: both label the arms (the fewest keys that tell them apart
    would drop one), floats to 4 significant digits; kl.coef of kl=none (set by the option) stays out."""

    def job_config(kl: str, coef: float, lr: float) -> dict:
        return {"algorithm": {"name": "grpo"}, "kl": {"name": kl, "coef": coef}, "trainer": {"lr": lr, "steps": 1},
                "seed": 0, "experiment_name": "search"}

    for number, (coef, lr) in enumerate([(0.13981961408994045, 1.2345678e-05), (0.5, 3e-06)]):
        write_job(tmp_path / str(number), job_config("k3", coef, lr), [train_line(0, 0.1, 0.02, 0.01, 1.0)],
                  choices={"kl": "k3"})
    names = [arm.name for arm in report.group_arms(report.find_jobs(tmp_path))]
    assert names == ["kl.coef=0.1398,trainer.lr=1.235e-05", "kl.coef=0.5,trainer.lr=3e-06"]

    options = tmp_path / "options"
    for number, (kl, coef) in enumerate([("k3", 0.1), ("none", 0.0)]):
        write_job(options / str(number), job_config(kl, coef, 1e-5), [train_line(0, 0.1, 0.02, 0.01, 1.0)],
                  choices={"kl": kl})
    assert [arm.name for arm in report.group_arms(report.find_jobs(options))] == ["kl=k3", "kl=none"]


def test_what_an_arm_group_sets_does_not_repeat_in_the_label(tmp_path: Path) -> None:
    """A grid over ``kl_arm`` (which sets the kl group and its placement) and ``trainer.lr``: the arms read
    ``kl_arm=...`` and the learning rate, not ``kl=k1,kl.placement=reward,kl_arm=kl_reward``; two arms that share a
    kl group still differ by their arm."""
    arms = {"kl_reward": ("k1", "reward"), "k3_loss": ("k3", "loss"), "k3_loss_v32": ("k3", "loss")}
    for number, ((arm, (kl, placement)), lr) in enumerate(itertools.product(arms.items(), (1e-3, 1e-2))):
        job = {"algorithm": {"name": "grpo"}, "kl": {"name": kl, "coef": 0.1, "placement": placement},
               "kl_arm": arm, "trainer": {"lr": lr, "steps": 1}, "seed": 0, "experiment_name": "grid"}
        write_job(tmp_path / str(number), job, [train_line(0, 0.1, 0.02, 0.01, 1.0)],
                  choices={"kl": kl, "kl_arm": arm})
    names = [arm.name for arm in report.group_arms(report.find_jobs(tmp_path))]
    assert names == [f"kl_arm={arm},trainer.lr={lr:g}" for arm in arms for lr in (1e-3, 1e-2)]
