"""``rlhf-lab report FOLDER --replicate``: an experiment's claims again at fresh seeds, both verdicts side by side.

The replication runs the folder's own jobs again (each job's saved ``.hydra/overrides.yaml``: what stays the same
is kept, the keys that vary are cut down to the values the claims' arms name) at seeds the folder did not use
(``--replicate SEEDS``; by default as many as it used, from 100 up), as one sweep into ``FOLDER_replicate`` (with
``trainer.resume=auto``: jobs already finished there are not run again, an interrupted replication resumes; one
with all its jobs finished is read without launching anything). The
claims are then evaluated on those jobs by the same rule, and each claim's replication goes beside it in the report,
``claims.json`` and the W&B summary (``claims/<name>/replicate_verdict``, ``.../replicate_flipped``): a claim whose
verdict differs at fresh seeds is flagged.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rlhf_lab.config.claims import parse_arm
from rlhf_lab.errors import ToolError

SUFFIX = "_replicate"  # the replication's folder: beside the folder, not in it (the report reads every job below it)
FIRST_FRESH_SEED = 100
REPLACED = ("seed", "trainer.resume", "trainer.output_dir")  # the replication sets its own


def parse_seeds(text: str | None) -> list[int] | None:
    """``--replicate [SEEDS]``: None without the flag, [] for the default seeds, else the listed integers."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ToolError(f"--replicate {text}: not a list of integer seeds (e.g. 100,101,102)") from None


def replication_folder(folder: Path) -> Path:
    return folder.parent / f"{folder.name}{SUFFIX}"


def _job_overrides(job: Any) -> list[str]:
    path = job.folder / ".hydra" / "overrides.yaml"
    try:
        return [str(line) for line in (yaml.safe_load(path.read_text(encoding="utf-8")) or [])]
    except (OSError, yaml.YAMLError) as error:
        raise ToolError(f"--replicate: {path} cannot be read ({error}); the replication needs each job's "
                        "overrides") from None


def fresh_seeds(used: set[Any], count: int) -> list[int]:
    """``count`` seeds from :data:`FIRST_FRESH_SEED` up that the folder did not use."""
    seeds, seed = [], FIRST_FRESH_SEED
    while len(seeds) < count:
        if seed not in used and str(seed) not in {str(s) for s in used}:
            seeds.append(seed)
        seed += 1
    return seeds


def replication_overrides(jobs: list[Any], claims: list[dict[str, Any]], seeds: list[int]) -> list[str]:
    """The sweep's overrides: every job's common ones kept; a key whose value varies cut down to the values the
    claims' arms name (all of them where no claim names the key); the seed swept over ``seeds``."""
    values: dict[str, dict[str, None]] = {}  # bare key -> values in first-seen order
    written: dict[str, str] = {}  # bare key -> the key as the jobs wrote it (``+kl_arm``)
    for job in jobs:
        for override in _job_overrides(job):
            key, _, value = override.partition("=")
            bare = key.lstrip("+~")
            written.setdefault(bare, key)
            values.setdefault(bare, {})[value] = None
    named: dict[str, set[str]] = {}
    for claim in claims:
        for side in ("a", "b"):
            if claim.get(side):
                for key, value in parse_arm(claim[side]).items():
                    named.setdefault(key, set()).add(value)
    overrides = []
    for bare, seen in values.items():
        if bare in REPLACED or bare.startswith("hydra."):
            continue
        kept = [value for value in seen if len(seen) == 1 or bare not in named or value in named[bare]]
        overrides.append(f"{written[bare]}={','.join(kept)}")
    return [*overrides, f"seed={','.join(str(seed) for seed in seeds)}"]


def run_replication(folder: Path, jobs: list[Any], claims: list[dict[str, Any]], seeds: list[int] | None,
                    out: Path | None = None) -> Path:
    """Launch (or resume) the replication's sweep; the folder it wrote."""
    used = {job.config.get("seed") for job in jobs}
    seeds = seeds or fresh_seeds(used, len(used))
    again = sorted(set(seeds) & {int(seed) for seed in used if str(seed).lstrip("-").isdigit()})
    if again:
        raise ToolError(f"--replicate {','.join(map(str, seeds))}: seed(s) {','.join(map(str, again))} are "
                        f"the folder's own; choose fresh ones (default: {FIRST_FRESH_SEED} up)")
    target = out or replication_folder(folder)
    overrides = replication_overrides(jobs, claims, seeds)
    expected = math.prod(len(override.partition("=")[2].split(",")) for override in overrides)
    if finished_jobs(target) >= expected:  # a replication run before: read, not run again
        print(f"the replication in {target} has its {expected} jobs; reading it", flush=True)
        return target
    command = [sys.executable, "-m", "rlhf_lab", "--multirun", *overrides, "trainer.resume=auto",
               f"hydra.sweep.dir={target}"]
    print(f"replicating the claims at seeds {','.join(map(str, seeds))} into {target}", flush=True)
    finished = subprocess.run(command, check=False)
    if finished.returncode != 0:
        raise ToolError(f"--replicate: the replication's sweep stopped (exit {finished.returncode}); its jobs are in "
                        f"{target}, and the same command resumes it")
    return target


def finished_jobs(folder: Path) -> int:
    """Job folders under ``folder`` whose run finished (it wrote its summary last)."""
    from rlhf_lab.trackers.jsonl import SUMMARY_FILE

    return sum(1 for _ in Path(folder).glob(f"*/{SUMMARY_FILE}")) if Path(folder).is_dir() else 0


def attach(results: list[Any], again: list[Any]) -> None:
    """Each claim's replication beside it: verdict, effect, interval, seeds, and whether the verdict changed."""
    by_name = {result.name: result for result in again}
    for result in results:
        other = by_name.get(result.name)
        if other is None:
            continue
        interval = "—" if other.low != other.low else f"[{other.low:.3g}, {other.high:.3g}]"
        result.replicated = {"verdict": other.verdict, "effect": other.effect, "interval": interval,
                             "seeds": len(other.seeds), "flipped": other.verdict != result.verdict}


def replicate_claims(results: list[Any], jobs: list[Any], claims: list[dict[str, Any]], folder: Path,
              seeds: list[int] | None, evaluate: Callable[[list[Any]], list[Any]]) -> Path:
    """Run the replication and attach its verdicts to ``results``; ``evaluate(jobs)`` is the report's claim rule on
    other jobs. Returns the replication's folder."""
    from rlhf_lab.tools.report_jobs import find_jobs

    if not claims:
        raise ToolError(f"--replicate: {folder} has no claims (its jobs ran no experiment with claims:); "
                        "--claims EXPERIMENT names an experiment's")
    target = run_replication(folder, jobs, claims, seeds)
    attach(results, evaluate(find_jobs(target)))
    return target
