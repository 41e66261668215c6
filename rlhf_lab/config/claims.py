"""An experiment's claims (``claims:`` in its YAML), checked before any job starts.

A claim compares a report column (``metric``, :data:`rlhf_lab.tools.report_columns.COLUMNS`) of arm ``a`` with
arm ``b`` (``less``, ``equal``) or with a number (``at_most``, ``at_least``). An arm is named by its swept
overrides, ``key=value`` joined by commas (``kl_arm=kl_reward``, ``algorithm=grpo,kl_arm=mse_loss``; a leading
``+`` is optional); it must name exactly one arm of the experiment's own grid (``hydra.sweeper.params``, seeds
apart). ``rlhf-lab report`` evaluates them (:mod:`rlhf_lab.tools.claims`).
"""

from __future__ import annotations

from typing import Any

from rlhf_lab.errors import ConfigError
from rlhf_lab.tools.report_columns import COLUMNS

KINDS = {"less": "b", "equal": "b", "at_most": "value", "at_least": "value"}  # kind -> what a is compared with
SEED_KEYS = ("seed",)


def parse_arm(spec: str) -> dict[str, str]:
    """``"algorithm=grpo,+kl_arm=mse_loss"`` -> ``{"algorithm": "grpo", "kl_arm": "mse_loss"}``."""
    pairs = {}
    for part in str(spec).split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key.lstrip("+~") or not value:
            raise ConfigError(f"claim arm {spec!r} is not KEY=VALUE[,KEY=VALUE...] (e.g. kl_arm=kl_reward)")
        pairs[key.lstrip("+~")] = value.strip()
    return pairs


def _job_pairs(job: list[str]) -> dict[str, str]:
    pairs = {}
    for override in job:
        key, _, value = override.partition("=")
        pairs[key.lstrip("+~")] = value
    return pairs


def _arms_of(spec: str, jobs: list[dict[str, str]]) -> set[tuple[tuple[str, str], ...]]:
    """The distinct arms (a job's overrides, seeds apart) whose jobs match every pair of ``spec``."""
    wanted = parse_arm(spec)
    return {tuple(sorted((k, v) for k, v in job.items() if k not in SEED_KEYS)) for job in jobs
            if all(job.get(key) == value for key, value in wanted.items())}


def check_claims(claims: Any, grid: list[list[str]]) -> None:
    """Every claim's kind, metric and arms, against the report's columns and ``grid`` (the experiment's jobs as
    override lists): one line for the first bad one."""
    jobs = [_job_pairs(job) for job in grid]
    swept = sorted({key for job in jobs for key in job if key not in SEED_KEYS})
    for claim in claims or []:
        where = f"claim {claim.name!r}"
        if claim.kind not in KINDS:
            raise ConfigError(f"{where}: kind={claim.kind!r} is not valid; choose from: {', '.join(KINDS)}")
        if claim.metric not in COLUMNS:
            raise ConfigError(f"{where}: metric={claim.metric!r} is not a report column; choose from: "
                              f"{', '.join(COLUMNS)}")
        other = KINDS[claim.kind]
        if claim.get(other) is None:
            raise ConfigError(f"{where}: kind={claim.kind} compares a with {other}; set {other}")
        for side in ("a", "b") if other == "b" else ("a",):
            arms = _arms_of(claim[side], jobs)
            if not arms:
                raise ConfigError(f"{where}: {side}={claim[side]!r} names no arm of the experiment's sweep "
                                  f"(swept keys: {', '.join(swept) or 'none'})")
            if len(arms) > 1:
                raise ConfigError(f"{where}: {side}={claim[side]!r} matches {len(arms)} arms; name one with more "
                                  f"of the swept keys ({', '.join(swept)})")
