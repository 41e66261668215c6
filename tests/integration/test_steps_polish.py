"""Console and report polish: a W&B run prints no "Symlinked N files" line, shell completion offers no
``*_schema`` config, and ``rlhf-lab report`` lists what it writes, leaves out empty plots and names failed jobs."""

from __future__ import annotations

import csv
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_lab.app.completion import offered
from rlhf_lab.app.help_text import program_in_shell
from rlhf_lab.tools import report
from tests.limits import HANG_GUARD_S


def test_a_wandb_run_saves_the_hydra_files_without_a_symlink_line(tmp_path: Path, capfd) -> None:
    from test_sweeps import read_offline_run, wandb_test_env

    from rlhf_lab.config import compose
    from rlhf_lab.training.loop import Trainer

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (run_dir / ".hydra" / "overrides.yaml").write_text("- logger=wandb\n")
    cfg = compose(["+experiment=smoke", "logger=wandb", "logger.mode=offline", "trainer.eval_prompts=0",
                   "trainer.device=cpu"])
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("WANDB_")]:
            patch.delenv(key)
        for key, value in wandb_test_env(tmp_path / "env").items():
            patch.setenv(key, value)
        Trainer(cfg, run_dir).train()
    printed = capfd.readouterr()
    assert "Symlinked" not in printed.out + printed.err
    files = read_offline_run(run_dir / "wandb")["folder"] / "files" / ".hydra"
    assert (files / "config.yaml").read_text() == "seed: 0\n" and not (files / "config.yaml").is_symlink()
    assert (files / "overrides.yaml").is_file()


def test_completion_leaves_the_schemas_out() -> None:
    assert offered(["algorithm=grpo", "algorithm=grpo_schema", "kl/", "schema", "trainer="]) == [
        "algorithm=grpo", "kl/", "trainer="]
    line = "rlhf-lab algorithm="
    done = subprocess.run([sys.executable, "-m", "rlhf_lab", "-sc", "query=bash"], capture_output=True, text=True,
                          env={**os.environ, "COMP_LINE": line, "COMP_POINT": str(len(line))}, timeout=HANG_GUARD_S)
    words = done.stdout.split()
    assert done.returncode == 0, done.stderr
    assert "algorithm=grpo" in words and "algorithm=ppo" in words
    assert not [word for word in words if word.endswith("_schema")], words


def write_job(folder: Path, seed: int, steps_done: int, finished: bool) -> None:
    (folder / ".hydra").mkdir(parents=True)
    config = {"algorithm": {"name": "grpo"}, "seed": seed, "trainer": {"steps": 2}}
    (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / ".hydra" / "overrides.yaml").write_text(f"- seed={seed}\n")
    lines = [{"step": step, "reward/mean": 0.1 * (step + seed), "kl/estimate": 0.01, "kl/exact": 0.02,
              "time/step_s": 1.0} for step in range(steps_done)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if finished:
        (folder / "summary.json").write_text(json.dumps({"steps": steps_done}))


def test_report_lists_its_files_skips_empty_plots_and_names_failed_jobs(tmp_path: Path, capsys) -> None:
    write_job(tmp_path / "0_seed=0", 0, 2, finished=True)
    write_job(tmp_path / "1_seed=1", 1, 1, finished=False)  # died after its first step
    report.main([str(tmp_path), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    written = sorted(p.name for p in out.iterdir())
    assert written == ["kl_estimate_vs_exact.png", "kl_exact_vs_step.png", "report.csv", "report.md",
                       "reward_vs_kl.png", "reward_vs_step.png"]
    listed = printed.split("\nwrote:\n")[1].split()
    assert sorted(Path(path).name for path in listed) == written and all(Path(path).is_file() for path in listed)
    # No job evaluated: no empty evaluation plot, and the reason is given.
    assert ("no plot eval_reward_vs_step.png: no job has eval/reward/mean in its evaluation lines" in printed)
    markdown = (out / "report.md").read_text()
    assert "eval_reward_vs_step" not in markdown.split("Plots left out")[0]
    assert "Plots left out (no data): eval_reward_vs_step.png: no job has eval/reward/mean" in markdown
    folder = tmp_path / "1_seed=1"
    failed = (f"{folder}: failed: 1 of trainer.steps=2 steps in metrics.jsonl and no summary.json (the run ended in "
              f"an error or was killed, or is still running); to finish it: {program_in_shell()} seed=1 "
              f"trainer.resume=auto {shlex.quote(f'trainer.output_dir={folder.resolve()}')}")
    assert f"unfinished job {failed}" in printed and f"- {failed}" in markdown
    assert str(tmp_path / "0_seed=0") not in markdown.split("Unfinished jobs")[1]
    # The unfinished job is left out of the final values: the arm's numbers are the finished seed's alone.
    row = next(csv.DictReader((out / "report.csv").open()))
    assert (row["n_seeds"], row["n_jobs"], row["seeds"]) == ("1", "2", "0")
    assert float(row["final_reward_mean"]) == pytest.approx(0.1)  # seed 0's last step (1): 0.1 * (1 + 0)
    assert "| 1 of 2 finished |" in markdown


def test_an_arm_whose_jobs_all_died_has_no_final_values(tmp_path: Path, capsys) -> None:
    write_job(tmp_path / "0_seed=0", 0, 1, finished=False)
    report.main([str(tmp_path), "--out", str(tmp_path / "out")])
    row = next(csv.DictReader((tmp_path / "out" / "report.csv").open()))
    assert (row["n_seeds"], row["n_jobs"], row["final_reward_mean"]) == ("0", "1", "nan")
    assert "| 0 of 1 finished |" in (tmp_path / "out" / "report.md").read_text()
