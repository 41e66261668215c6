"""Compare the jobs of a multirun folder: ``rlhf-lab report <folder> [--out DIR]``.

Reads every job's ``metrics.jsonl`` and resolved ``.hydra/config.yaml`` under the folder and groups the
jobs into arms by every config value that varies across jobs, except ``seed`` and bookkeeping keys
(``logger.*``, ``trainer.resume``, ``trainer.output_dir``, ``trainer.progress_bar``, ``trainer.save``). Jobs of
one arm are its seeds. Arms are labelled by every key that varies across them, less those a chosen config
option sets (:func:`arm_keys`), using the options chosen on the command line (``algorithm=rloo``, read from
``.hydra/hydra.yaml``) where known; floats to 4 significant digits. KL columns say per token or per sequence.

Per arm, as mean ± sample std over seeds (a single seed has no std):

- final reward: ``reward/mean`` at the last training step; best reward: its maximum over steps;
- final KL: ``kl/exact`` at the last training step;
- KL est − exact: the mean over steps of ``kl/estimate − kl/exact`` (the estimator's bias, per token);
- s/step: the median ``time/step_s``;
- eval reward and eval KL: the last ``eval/reward/mean`` and ``eval/kl/exact`` (only when jobs evaluated):
  the one yardstick of every algorithm, so offline stages (``sft``, ``dpo``), which log evaluations but no
  sampled training reward, sit in the same table; when any arm has no training reward, the frontier plot
  uses the final evaluation of every arm;
- on the exact task (``exact/*`` metrics): final gap J* − J, true KL, KL of π*, TV to π*, the estimate's bias;
  arms are then ranked by final gap, and gap and true KL are plotted against steps
  (:mod:`rlhf_lab.tools.report_exact`).

Training curves use the lines that have ``reward/mean``; the evaluation-only lines (``eval/...``) are
left out of them. Written into the folder (or ``--out``): ``report.csv``, ``report.md`` and the plots of
:mod:`rlhf_lab.tools.report_plots` (``--ema``, ``--band sd|ci95``, ``--last-k``): reward, exact KL and
evaluation reward against step, the KL estimate against the exact KL per arm, and the reward-vs-KL frontier with
its Pareto front. A plot with no data (no job logged its keys) is left out, and report.md and the console say
which and why. The markdown table is printed, then every file written. A job whose run did not finish (no
``summary.json`` and fewer training steps than its ``trainer.steps``: killed, failed or still running) is left out of
the table's values and the claims (the seeds column says how many of an arm's jobs finished) and named, with the
command that finishes it, in both.

An experiment's claims (``claims:`` in its YAML, or ``--claims EXPERIMENT`` for the ones it lists now) are checked
on the arms (:mod:`rlhf_lab.tools.claims`): PASS / FAIL / INCONCLUSIVE, effect, interval, minimum effect, seeds (and
those its power needs), false-PASS rate, printed, in report.md and ``claims.json``, and (``--wandb auto|on``) in a
W&B run's summary (:mod:`rlhf_lab.tools.report_wandb`); ``--replicate`` runs them again at fresh seeds.

An Optuna search's folder (``hydra/sweeper=optuna``) also holds ``optimization_results.yaml``: the report then
starts with the best trial (value, parameters, folder) and a table of every trial by objective value.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rlhf_lab.app.help_text import plain, resume_command
from rlhf_lab.errors import ToolError
from rlhf_lab.tools.claims import ClaimResult, claim_lines, claims_of, claims_table, evaluate_claims, experiment_claims
from rlhf_lab.tools.report_columns import METRICS
from rlhf_lab.tools.report_exact import exact_job_metrics, exact_plots, rank_by_gap
from rlhf_lab.tools.report_jobs import SUMMARY_FILE, Job, JobProblem, failure, find_jobs, load_job  # noqa: F401
from rlhf_lab.tools.report_plots import BANDS, PLOT_FILES, PlotOptions, write_all
from rlhf_lab.tools.report_replicate import parse_seeds, replicate_claims
from rlhf_lab.tools.report_search import optuna_section
from rlhf_lab.tools.report_wandb import CHOICES as WANDB_CHOICES
from rlhf_lab.tools.report_wandb import log_claims

IGNORED_KEYS = ("seed", "trainer.resume", "trainer.output_dir", "trainer.progress_bar", "trainer.library_progress_bars",
                "trainer.save")
IGNORED_PREFIXES = ("logger.",)

PLOTS = PLOT_FILES  # rlhf_lab/tools/report_plots.py: styles and legends that hold at 36 arms


class ReportError(ToolError):
    """Nothing to report on; printed as one line."""


@dataclass
class Report:
    """What ``rlhf-lab report`` wrote: the markdown table, its rows, every file written, the plots left out (one
    reason each), the failed jobs (folder: why) and the experiment's claims, evaluated."""

    table: str
    rows: list[dict[str, Any]]
    files: list[Path]
    skipped: list[str]
    failed: list[str]
    claims: list[ClaimResult] = field(default_factory=list)
    wandb: str | None = None  # where the claims went in W&B, if they did


@dataclass
class Arm:
    label: dict[str, Any]  # displayed key -> value
    jobs: list[Job] = field(default_factory=list)

    @property
    def name(self) -> str:
        return ",".join(f"{key}={_format_value(value)}" for key, value in self.label.items()) or "all jobs"


# ------------------------------------------------------------------------------------------ arms


def _hashable(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _format_value(value: Any) -> str:
    """A label's value: floats to 4 significant digits (``kl.coef=0.1398``, not 0.13981961408994045)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value)


def _ignored(key: str) -> bool:
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES)


def arm_keys(jobs: list[Job]) -> list[str]:
    """Every key that varies across the jobs labels the arms, less the keys a chosen config option sets: a key
    of group ``g`` (``kl.coef``, ``algorithm.baseline``) that takes one value for each choice of ``g`` (``kl=none``
    sets ``kl.coef=0``; ``algorithm=rloo`` sets its baseline) follows from that choice, and any key that takes one
    value for each choice of an arm group (``*_arm``: ``kl_arm=kl_reward`` sets ``kl``) follows from that. Keys that
    vary together (``kl.coef`` and ``trainer.lr`` of a search) are all shown: neither follows from the other's
    option.
    """
    keys = list(dict.fromkeys(key for job in jobs for key in job.config))
    varying = [k for k in keys if not _ignored(k) and len({_hashable(job.config.get(k)) for job in jobs}) > 1]

    def set_by(key: str, chooser: str) -> bool:
        """Whether ``key`` takes one value for each value of ``chooser``."""
        seen: dict[str, str] = {}
        return all(seen.setdefault(_hashable(job.config.get(chooser)), _hashable(job.config.get(key)))
                   == _hashable(job.config.get(key)) for job in jobs)

    # An arm group's choice (``kl_arm=kl_reward``, ``async_arm=inflight_k6_icepop``: conf groups that set other
    # groups and keys) labels its arms alone: what it sets (``kl=k1``, ``kl.placement``) follows from it.
    arm_groups = [key for key in varying if "." not in key and key.endswith("_arm")]

    def follows(key: str) -> bool:
        if key not in arm_groups and any(set_by(key, arm) for arm in arm_groups if arm != key):
            return True
        if "." not in key:  # a chosen option (``algorithm=rloo``) is what the others follow from
            return False
        group = key.split(".")[0]
        choosers = [c for c in (group, f"{group}.name") if c in varying and c != key]
        if key.endswith(".name"):  # the option's registered name, where the option itself is shown
            choosers = [c for c in choosers if c == group]
        return any(set_by(key, chooser) for chooser in choosers)

    selected = [key for key in varying if not follows(key)]
    roots = list(dict.fromkeys(key.split(".")[0] for key in keys))  # config order: algorithm, kl, ...
    return sorted(selected, key=lambda k: (roots.index(k.split(".")[0]), k.count("."), k))


def group_arms(jobs: list[Job]) -> list[Arm]:
    """Jobs grouped into arms, in order of each arm's first job."""
    keys = arm_keys(jobs)
    shown = {
        key: key[: -len(".name")] if key.endswith(".name") and key[: -len(".name")] not in keys else key for key in keys
    }
    arms: dict[tuple[str, ...], Arm] = {}
    for job in jobs:
        signature = tuple(_hashable(job.config.get(key)) for key in keys)
        arm = arms.setdefault(signature, Arm({shown[key]: job.config.get(key) for key in keys}))
        arm.jobs.append(job)
    return list(arms.values())


# ------------------------------------------------------------------------------------------ numbers


def job_metrics(job: Job) -> dict[str, float]:
    """The table's per-job numbers (see the module docstring)."""
    metrics: dict[str, float] = {}
    if job.train:
        rewards = [line.get("reward/mean", math.nan) for line in job.train]
        last = job.train[-1]
        gaps = [line.get("kl/estimate", math.nan) - line.get("kl/exact", math.nan) for line in job.train]
        metrics.update({
            "final_reward": rewards[-1],
            "best_reward": max(rewards),
            "final_kl_exact": last.get("kl/exact", math.nan),
            "kl_estimate_minus_exact": float(np.mean(gaps)),
            "step_time_s": float(np.median([line.get("time/step_s", math.nan) for line in job.train])),
        })
        metrics.update(exact_job_metrics(job.train))
    if job.eval:
        metrics["eval_reward"] = job.eval[-1]["eval/reward/mean"]
        metrics["eval_kl_exact"] = job.eval[-1].get("eval/kl/exact", math.nan)
    return metrics


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; NaN for a single value)."""
    array = np.asarray(values, dtype=float)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else math.nan


def summarize(arms: list[Arm]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per arm (label columns, its finished jobs' seeds and count, every job's count, and
    ``<metric>_mean``/``_std`` over the finished jobs only: an unfinished job's last step is no final value) and the
    metric columns present."""
    jobs = [job for arm in arms for job in arm.jobs]
    per_job = finished_metrics(jobs)
    logged = [per_job.get(id(job)) or job_metrics(job) for job in jobs]  # the columns: every job's, finished or not
    present = [name for name, _ in METRICS if any(name in m for m in logged)]
    rows = []
    for arm in arms:
        finished = [job for job in arm.jobs if id(job) in per_job]
        row: dict[str, Any] = {key: _format_value(value) for key, value in arm.label.items()}
        row["arm"] = arm.name
        row["n_seeds"], row["n_jobs"] = len(finished), len(arm.jobs)
        row["seeds"] = ",".join(str(job.config.get("seed")) for job in finished)
        for name in present:
            row[f"{name}_mean"], row[f"{name}_std"] = (
                mean_std([per_job[id(job)].get(name, math.nan) for job in finished]) if finished else (math.nan,) * 2)
        rows.append(row)
    return rows, present


def finished_metrics(jobs: list[Job]) -> dict[int, dict[str, float]]:
    """The table's numbers of each finished job, by ``id(job)`` (the unfinished ones are not there)."""
    return {id(job): job_metrics(job) for job in jobs if not job.failed}


def finish_command(job: Job) -> str:
    """The command that finishes an unfinished job in its own folder: its overrides, resumed from its checkpoint
    (started afresh where it wrote none), as a stopped run's own resume line is made."""
    try:
        overrides = yaml.safe_load((job.folder / ".hydra" / "overrides.yaml").read_text(encoding="utf-8")) or []
    except (OSError, yaml.YAMLError):
        overrides = []
    return resume_command([str(o) for o in overrides],
                          ("trainer.resume=auto", f"trainer.output_dir={job.folder.resolve()}"))


def _cell(mean: float, std: float) -> str:
    return f"{mean:.4g}" if math.isnan(std) else f"{mean:.4g} ± {std:.2g}"


def markdown_table(rows: list[dict[str, Any]], metrics: list[str]) -> str:
    headers = dict(METRICS)
    lines = [
        "| arm | seeds | " + " | ".join(headers[m] for m in metrics) + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in metrics) + " |",
    ]
    for row in rows:
        cells = [_cell(row[f"{m}_mean"], row[f"{m}_std"]) for m in metrics]
        seeds = row["n_seeds"] if row["n_seeds"] == row["n_jobs"] else f"{row['n_seeds']} of {row['n_jobs']} finished"
        lines.append(f"| {row['arm']} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------------------------------ plots


def curve(arm: Arm, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean and std (0 where fewer than two seeds have the step) of ``key`` over the arm's seeds."""
    by_step: dict[int, list[float]] = {}
    for job in arm.jobs:
        for line in job.train:
            if key in line and "step" in line:
                by_step.setdefault(int(line["step"]), []).append(line[key])
    steps = np.array(sorted(by_step))
    means = np.array([np.mean(by_step[s]) for s in steps])
    stds = np.array([np.std(by_step[s], ddof=1) if len(by_step[s]) > 1 else 0.0 for s in steps])
    return steps, means, stds


def write_plots(arms: list[Arm], rows: list[dict[str, Any]], out: Path,
                options: PlotOptions | None = None) -> tuple[list[Path], list[str]]:
    """The plots written, and one line for each plot left out for want of data."""
    paths, skipped = write_all(arms, out, options)  # rlhf_lab/tools/report_plots.py
    return paths + exact_plots(arms, out, curve), skipped  # the exact task's gap and true KL, when logged


# ------------------------------------------------------------------------------------------ command


def build_report(folder: Path, out: Path | None = None,
                 options: PlotOptions | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Write report.csv, report.md and the plots; return the markdown table and the rows."""
    report = write_report(folder, out, options)
    return report.table, report.rows


def write_report(folder: Path, out: Path | None = None, options: PlotOptions | None = None,
                 wandb: str = "auto", claims_from: str | None = None, replicate: list[int] | None = None) -> Report:
    """Write report.csv, report.md and the plots that have data; return what was written and left out.
    ``replicate``: the claims again at those fresh seeds (``[]``: the default ones), beside the verdicts."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ReportError(f"{folder} is not a folder")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ReportError(f"--out {out} is a file, not a folder")
    jobs = find_jobs(folder)
    if not jobs:
        raise ReportError(f"no jobs in {folder}: expected job folders with metrics.jsonl and .hydra/config.yaml")
    out = Path(out) if out is not None else folder
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ReportError(f"--out {out} cannot be created: {error.strerror}") from None
    arms = group_arms(jobs)
    rows, metrics = summarize(arms)
    rows, arms = rank_by_gap(rows, arms)  # the exact task: best (smallest final gap J* − J) first
    table = markdown_table(rows, metrics)
    write_csv(rows, out / "report.csv")
    plots, skipped = write_plots(arms, rows, out, options)
    failed = [f"{job.folder}: {job.failed}; to finish it: {finish_command(job)}" for job in jobs if job.failed]
    per_job = finished_metrics(jobs)
    listed = claims_of(jobs) if claims_from is None else experiment_claims(claims_from)
    claims = evaluate_claims(listed, arms, per_job)
    if replicate is not None:  # tools/report_replicate.py: the same jobs at fresh seeds, the same rule
        replicate_claims(claims, jobs, listed, folder, replicate,
                         lambda again: evaluate_claims(listed, group_arms(again), finished_metrics(again)))
    if claims:  # tools/claims.py: each claim's verdict, for machines (the W&B summary's keys)
        summary = {key: value for result in claims for key, value in result.summary().items()}
        (out / "claims.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    keys = ", ".join(arms[0].label) or "nothing varies across jobs"
    markdown = "\n".join(
        [
            f"# Report: {folder.resolve()}",
            "",
            *optuna_section(folder),
            f"{len(jobs)} jobs in {len(arms)} arms (arms differ by: {keys}; seeds are averaged).",
            "Cells are mean ± sample std over seeds. Final values are at the last training step; "
            "KL est − exact is the mean over steps of kl/estimate − kl/exact; s/step is the median time/step_s.",
            "",
            table,
            "",
            *(["## Claims", "", claims_table(claims), ""] if claims else []),
            *([f"Unfinished jobs ({len(failed)}; left out of the table's values and the claims, their curves "
               "drawn as far as they got):", "", *(f"- {line}" for line in failed), ""] if failed else []),
            *(f"![{path.stem}]({path.name})" for path in plots),
            "",
            *([f"Plots left out (no data): {'; '.join(skipped)}.", ""] if skipped else []),
        ]
    )
    (out / "report.md").write_text(markdown, encoding="utf-8")
    files = [out / "report.csv", *plots, out / "report.md", *([out / "claims.json"] if claims else [])]
    return Report(table, rows, files, skipped, failed, claims, log_claims(jobs, claims, folder, out, wandb))


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlhf-lab report", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("folder", type=Path, help="a multirun folder (or any folder of run folders)")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default: the folder)")
    parser.add_argument("--ema", type=float, default=0.0, help="smooth curves: EMA weight in [0, 1) (default 0: off)")
    parser.add_argument("--band", choices=BANDS, default="sd", help="band over seeds: sd (default) or ci95")
    parser.add_argument("--wandb", choices=WANDB_CHOICES, default="auto", help="the claims into a W&B run's summary: "
                        "auto (default: when the jobs logged to W&B), on, off")
    parser.add_argument("--claims", default=None, metavar="EXPERIMENT", help="check the claims experiment=EXPERIMENT "
                        "lists now (default: those the jobs ran with)")
    parser.add_argument("--last-k", type=int, default=None, help="frontier: mean of the last K training steps "
                        "(default: 20%% of the steps)")
    parser.add_argument("--replicate", nargs="?", const="", default=None, metavar="SEEDS", help="run the claims "
                        "again at fresh seeds (SEEDS: e.g. 100,101,102; default: as many as the folder's, from 100) "
                        "into FOLDER_replicate and print both verdicts side by side")
    options = parser.parse_args(args)
    try:
        if not 0 <= options.ema < 1:
            raise ReportError(f"--ema {options.ema} is out of range; must be in [0, 1)")
        if options.last_k is not None and options.last_k < 1:
            raise ReportError(f"--last-k {options.last_k} is out of range; must be >= 1")
        plot_options = PlotOptions(ema=options.ema, band=options.band, last_k=options.last_k)
        report = write_report(options.folder, options.out, plot_options, options.wandb, options.claims,
                              parse_seeds(options.replicate))
    except ToolError as error:  # ReportError, and an unknown --claims experiment
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(report.table)
    search = optuna_section(options.folder)
    if search:
        print("\n" + "\n".join(line for line in search[:5] if line))
    if report.claims:
        print("\nclaims:")
        for line in claim_lines(report.claims):
            print(f"  {line}")
        if report.wandb:
            print(f"  {report.wandb}")
    for line in report.failed:
        print(f"unfinished job {line}")
    for line in report.skipped:
        print(f"no plot {line}")
    print("\nwrote:")
    for path in report.files:
        print(f"  {path}")
