"""The report's job folders: each job's resolved config (flattened, with the group options chosen) and its
``metrics.jsonl`` lines, split into training and evaluation lines; a job whose run did not finish is marked failed,
a folder that cannot be read is skipped with one warning line (``rlhf-lab report``, :mod:`rlhf_lab.tools.report`)."""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_lab.config.overrides import flatten
from rlhf_lab.trackers.jsonl import SUMMARY_FILE  # a run writes it last: a job folder without it did not finish


@dataclass
class Job:
    folder: Path
    config: dict[str, Any]  # flattened resolved config (dotted keys) plus chosen group options
    train: list[dict[str, float]]  # training lines, by step
    eval: list[dict[str, float]]  # lines with eval/reward/mean, by step
    failed: str | None = None  # why the job counts as failed (its run did not finish), or None


# ------------------------------------------------------------------------------------------ loading


def _to_float(value: Any) -> float:
    try:
        return float(value)  # also "nan" / "inf", as older run folders stored them
    except (TypeError, ValueError):
        return math.nan


class JobProblem(Exception):
    """A job folder that cannot be read: it is skipped with one warning line naming the file and the problem."""


def _read_lines(path: Path) -> list[dict[str, Any]]:
    records = []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a torn last line of a killed run
                    continue
                if not isinstance(record, dict):
                    raise JobProblem(f"{path}: line {number} is not a JSON object ({line.strip()[:30]})")
                step = record.get("step", 0)
                if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step):
                    raise JobProblem(f"{path}: line {number}: step {step!r} is not a number")
                records.append(record)
    except UnicodeDecodeError as error:
        raise JobProblem(f"{path}: not valid UTF-8 (byte {error.start})") from None
    return records


def _group_choices(hydra_file: Path) -> dict[str, Any]:
    """Config group options the job ran with (``algorithm -> rloo``), from Hydra's saved runtime config."""
    if not hydra_file.is_file():
        return {}
    from omegaconf import OmegaConf

    try:
        choices = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.choices") or {}
        return {str(k): v for k, v in OmegaConf.to_container(choices).items() if not str(k).startswith("hydra/")}
    except Exception:
        return {}


def load_job(folder: Path) -> Job:
    from omegaconf import OmegaConf

    config_file = folder / ".hydra" / "config.yaml"
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(config_file), resolve=True)
    except UnicodeDecodeError as error:
        raise JobProblem(f"{config_file}: not valid UTF-8 (byte {error.start})") from None
    except Exception as error:  # noqa: BLE001 (YAML and OmegaConf raise many types)
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise JobProblem(f"{config_file}: invalid YAML or config ({first})") from None
    if not isinstance(loaded, dict):
        raise JobProblem(f"{config_file}: not a mapping of config keys")
    config = flatten(loaded)
    for group, option in _group_choices(folder / ".hydra" / "hydra.yaml").items():
        if group != "schema" and group not in config:
            config[group] = option
    lines = [
        {key: value if key == "step" else _to_float(value) for key, value in line.items()}
        for line in _read_lines(folder / "metrics.jsonl")
    ]
    train = sorted((line for line in lines if "reward/mean" in line), key=lambda line: line.get("step", 0))
    evals = sorted((line for line in lines if "eval/reward/mean" in line), key=lambda line: line.get("step", 0))
    steps = [line for line in lines if "time/step_s" in line]  # every training step's line (an offline stage's too)
    return Job(folder, config, train, evals, failure(folder, config, steps))


def failure(folder: Path, config: dict[str, Any], train: list[dict[str, Any]]) -> str | None:
    """Why a job folder holds a failed run: no ``summary.json`` (written last) and fewer training steps' lines
    (``train``) than its ``trainer.steps``, so it ended in an error or was killed (or is still running). None for a
    finished job."""
    steps = config.get("trainer.steps")
    if (folder / SUMMARY_FILE).is_file() or not isinstance(steps, int) or len(train) >= steps:
        return None
    return (f"failed: {len(train)} of trainer.steps={steps} steps in metrics.jsonl and no {SUMMARY_FILE} (the run "
            "ended in an error or was killed, or is still running)")


def _job_order(folder: Path) -> tuple[int, str]:
    match = re.match(r"(\d+)(?:_|$)", folder.name)  # Hydra's job number prefix: 2_... before 10_... (or just 2, 10)
    return (int(match.group(1)) if match else 1 << 30, str(folder))


def find_jobs(root: Path) -> list[Job]:
    """Every job folder under ``root`` (itself included) with metrics.jsonl and .hydra/config.yaml."""
    folders = {p.parent for p in Path(root).rglob("metrics.jsonl") if (p.parent / ".hydra" / "config.yaml").is_file()}
    jobs = []
    for folder in sorted(folders, key=_job_order):
        try:
            job = load_job(folder)
        except (JobProblem, OSError) as problem:
            print(f"warning: skipping {folder}: {problem}", file=sys.stderr)
            continue
        if job.train or job.eval:
            jobs.append(job)
        elif not (folder / SUMMARY_FILE).is_file():
            print(f"skipping failed job {folder}: no training steps or evaluations in metrics.jsonl and no "
                  f"{SUMMARY_FILE} (the run ended in an error or was killed)", file=sys.stderr)
        else:
            print(f"skipping {folder}: no training steps or evaluations in metrics.jsonl", file=sys.stderr)
    return jobs
