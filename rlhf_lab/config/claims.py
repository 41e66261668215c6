"""An experiment's claims (``claims:`` in its YAML), checked before any job starts.

A claim compares a report column (``metric``, :data:`rlhf_lab.tools.report_columns.COLUMNS`) of arm ``a`` with
arm ``b`` (``less``, ``equal``) or with a number (``at_most``, ``at_least``). An arm is named by its swept
overrides, ``key=value`` joined by commas (``kl_arm=kl_reward``, ``algorithm=grpo,kl_arm=mse_loss``; a leading
``+`` is optional); it must name exactly one arm of the experiment's grid (seeds apart). Every claim states its
``min_effect`` (the smallest effect that matters, in the metric's units; for ``equal`` the margin), and may state
``noise`` (the standard deviation of its per-seed numbers a pilot showed): then the sweep's seeds are checked
against the seeds its power needs before any job starts, as they always are for a rate (``diverged``), whose
noise the bound fixes. ``rlhf-lab report`` evaluates them (:mod:`rlhf_lab.tools.claims`).
"""

from __future__ import annotations

from typing import Any

from rlhf_lab.errors import ConfigError
from rlhf_lab.tools.report_columns import COLUMNS
from rlhf_lab.tools.report_exact import EXACT_METRICS, LENGTH_METRICS, MODE_METRICS

KINDS = {"less": "b", "equal": "b", "at_most": "value", "at_least": "value"}  # kind -> what a is compared with
SEED_KEYS = ("seed",)
RATE_METRICS = ("diverged",)  # 0/1 per seed: a claim on one bounds a rate (at_most / at_least a value in (0, 1))
# What a metric needs the experiment to log: (columns, the condition on the config, what to set).
LOGGED_BY = (
    ({column for column, _, _ in EXACT_METRICS} | set(RATE_METRICS), lambda cfg: cfg.model.name == "exact",
     "the exact task's (model=exact)"),
    ({column for column, _, _ in MODE_METRICS}, lambda cfg: bool(cfg.reward.get("modes")),
     "logged with several optimal modes (reward.modes)"),
    ({column for column, _, _ in LENGTH_METRICS}, lambda cfg: bool(cfg.model.get("exact", {}).get("stop")),
     "logged with responses of several lengths (model.exact.stop=true)"),
    ({"eval_reward", "eval_kl_exact"}, lambda cfg: cfg.trainer.get("eval_prompts", 0) > 0,
     "logged with evaluations (trainer.eval_prompts > 0)"),
)


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


def _check_logged(where: str, metric: str, cfg: Any) -> None:
    for columns, logged, what in LOGGED_BY:
        if metric in columns and not logged(cfg):
            raise ConfigError(f"{where}: metric={metric} is {what}, which this experiment does not log; choose a "
                              "metric its jobs log, or change the experiment")


def _check_effect(where: str, claim: Any) -> None:
    """min_effect (and noise) present and in range; a rate's bound in (0, 1) and its kind a bound."""
    if claim.get("min_effect") is None or not claim.min_effect > 0:
        raise ConfigError(f"{where}: min_effect={claim.get('min_effect')} must be a number > 0: the smallest effect "
                          "that matters, in the metric's units (equal: the margin), e.g. min_effect: 0.01")
    if claim.get("noise") is not None and not claim.noise >= 0:
        raise ConfigError(f"{where}: noise={claim.noise} must be >= 0 (the sd of the per-seed numbers) or null")
    if claim.metric in RATE_METRICS:
        if claim.kind not in ("at_most", "at_least") or not 0 < float(claim.value) < 1:
            raise ConfigError(f"{where}: metric={claim.metric} is 0 or 1 per seed, so a claim on it bounds a rate: "
                              f"kind=at_most or at_least with a value in (0, 1) (got kind={claim.kind}, "
                              f"value={claim.get('value')})")
        inside = float(claim.value) - claim.min_effect if claim.kind == "at_most" else float(claim.value) + claim.min_effect
        if not 0 <= inside <= 1:
            raise ConfigError(f"{where}: min_effect={claim.min_effect} puts the rate it plans for at {inside:.3g}, "
                              "outside [0, 1]")


def _check_seeds(where: str, claim: Any, seeds: int, claims: int) -> None:
    """The seeds the sweep runs against the seeds the claim's power needs (a rate's; a mean's with ``noise``)."""
    from rlhf_lab.tools import claim_rule

    level, delta = claim_rule.ALPHA / claims, float(claim.min_effect)
    if claim.metric in RATE_METRICS:
        bound = float(claim.value)
        needed = claim_rule.seeds_for(claim.kind, delta, level, bound=bound)
        noise = f"a rate of {bound - delta if claim.kind == 'at_most' else bound + delta:.3g} against the bound {bound:.3g}"
    elif claim.get("noise") is not None:
        needed = claim_rule.seeds_for(claim.kind, delta, level, sd=float(claim.noise))
        noise = f"min_effect={delta:.3g} at noise={float(claim.noise):.3g}"
    else:
        return
    if needed is None or seeds < needed:
        raise ConfigError(f"{where}: {seeds} seed(s) are below its power: to detect {noise} with power "
                          f"{claim_rule.POWER} (α = {claim_rule.ALPHA} over {claims} claims) it needs "
                          f"{needed or f'more than {claim_rule.MAX_SEEDS}'}; sweep seed over at least that many values")


def check_claims(claims: Any, grid: list[list[str]], cfg: Any, launched: list[list[str]] | None = None) -> None:
    """Every claim's kind, metric, effect and arms, against the report's columns, the experiment's config ``cfg``
    and ``grid`` (the experiment's own jobs as override lists), and its seeds against its power in ``launched``
    (the jobs the command line launches: a claim whose arms it leaves out is NO DATA in the report, not an error):
    one line for the first bad one."""
    jobs = [_job_pairs(job) for job in grid]
    launched_jobs = [_job_pairs(job) for job in (grid if launched is None else launched)]
    swept = sorted({key for job in jobs for key in job if key not in SEED_KEYS})
    for claim in claims or []:
        where = f"claim {claim.name!r}"
        if claim.kind not in KINDS:
            raise ConfigError(f"{where}: kind={claim.kind!r} is not valid; choose from: {', '.join(KINDS)}")
        if claim.metric not in COLUMNS:
            raise ConfigError(f"{where}: metric={claim.metric!r} is not a report column; choose from: "
                              f"{', '.join(COLUMNS)}")
        _check_logged(where, claim.metric, cfg)
        other = KINDS[claim.kind]
        if claim.get(other) is None:
            raise ConfigError(f"{where}: kind={claim.kind} compares a with {other}; set {other}")
        _check_effect(where, claim)
        sides = ("a", "b") if other == "b" else ("a",)
        for side in sides:
            arms = _arms_of(claim[side], jobs)
            if not arms:
                raise ConfigError(f"{where}: {side}={claim[side]!r} names no arm of the experiment's sweep "
                                  f"(swept keys: {', '.join(swept) or 'none'})")
            if len(arms) > 1:
                raise ConfigError(f"{where}: {side}={claim[side]!r} matches {len(arms)} arms; name one with more "
                                  f"of the swept keys ({', '.join(swept)})")
        seeds = [{job.get("seed", "") for job in launched_jobs if _arms_of(claim[side], [job])} for side in sides]
        if all(seeds):
            _check_seeds(where, claim, len(set.intersection(*seeds)), len(claims))
