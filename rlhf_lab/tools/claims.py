"""An experiment's claims evaluated on its jobs (``rlhf-lab report``): PASS / FAIL, seeds, effect, 95% interval.

The claims are the ``claims:`` of the jobs' resolved config (:mod:`rlhf_lab.config.claims`). Per claim, each
seed gives one number: ``a − b`` for ``less`` and ``equal`` (seeds paired, those both arms ran), ``a − value`` for
``at_most`` / ``at_least``. The effect is their mean; the 95% interval is the percentile bootstrap of that mean
over seeds (10,000 resamples, a fixed generator, so a report is reproducible). Verdicts:

- ``less``: PASS when the whole interval is below 0 (the ordering is beyond the seeds' noise), and with
  ``every_seed`` also a < b in every seed;
- ``equal``: PASS when |a − b| ≤ ``tolerance`` in every seed;
- ``at_most`` / ``at_least``: PASS when the interval's upper end is ≤ 0 / its lower end is ≥ 0;
- NO DATA: an arm the report does not have (a partial sweep), or too few seeds (a bootstrap needs 2).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlhf_lab.config.claims import parse_arm

RESAMPLES = 10_000


@dataclass
class ClaimResult:
    name: str
    text: str
    metric: str
    comparison: str  # "a < b" written with the arms
    verdict: str  # PASS | FAIL | NO DATA
    seeds: list[Any]
    effect: float  # mean over seeds of a − b (or a − value)
    low: float  # 95% bootstrap interval of the effect
    high: float
    why: str = ""  # what NO DATA lacks

    def summary(self) -> dict[str, Any]:
        """The W&B summary / claims.json entry: ``claims/<name>/<field>``."""
        return {f"claims/{self.name}/{key}": value for key, value in (
            ("verdict", self.verdict), ("pass", self.verdict == "PASS"), ("effect", self.effect),
            ("ci_low", self.low), ("ci_high", self.high), ("seeds", len(self.seeds)), ("metric", self.metric))}


def bootstrap_interval(values: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the mean of ``values`` (over seeds)."""
    generator = np.random.default_rng(seed)
    means = values[generator.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def _text(value: Any) -> str:
    """A config value as an override writes it (``0.05``, ``true``, ``kl_reward``)."""
    return value if isinstance(value, str) else json.dumps(value)


def _arm_values(spec: str, arms: list[Any], per_job: dict[int, dict[str, float]], metric: str) -> dict[Any, float] | str:
    """Seed -> the metric of the one arm matching ``spec``; a reason string if none or several match."""
    wanted = parse_arm(spec)

    def matches(arm: Any) -> bool:
        return all(_text(arm.jobs[0].config.get(key, arm.jobs[0].config.get(f"{key}.name"))) == value
                   for key, value in wanted.items())

    found = [arm for arm in arms if matches(arm)]
    if len(found) != 1:
        return f"{spec} matches {len(found)} arms of the report"
    values = {job.config.get("seed"): per_job[id(job)].get(metric, math.nan) for job in found[0].jobs
              if id(job) in per_job}  # (an unfinished job has no final value)
    return {seed: value for seed, value in values.items() if not math.isnan(value)}


def evaluate_claim(claim: Any, arms: list[Any], per_job: dict[int, dict[str, float]]) -> ClaimResult:
    """One claim on the report's arms (``per_job``: each job's columns, by ``id(job)``)."""
    kind, metric = claim["kind"], claim["metric"]
    a = _arm_values(claim["a"], arms, per_job, metric)
    against = claim.get("b") if kind in ("less", "equal") else claim.get("value")
    symbol = {"less": "<", "equal": "=", "at_most": "≤", "at_least": "≥"}[kind]
    comparison = f"{claim['a']} {symbol} {against}"
    b = _arm_values(against, arms, per_job, metric) if kind in ("less", "equal") else None
    result = ClaimResult(claim["name"], claim.get("text", ""), metric, comparison, "NO DATA", [], math.nan, math.nan,
                         math.nan)
    for side in (a, b):
        if isinstance(side, str):
            result.why = side
            return result
    if b is None:
        seeds = sorted(a, key=str)
        differences = np.array([a[seed] - float(against) for seed in seeds])
    else:
        seeds = sorted(set(a) & set(b), key=str)
        differences = np.array([a[seed] - b[seed] for seed in seeds])
    result.seeds = seeds
    if len(seeds) < 2:
        result.why = f"{len(seeds)} seed(s) with {metric} in both arms; a bootstrap needs 2"
        return result
    result.effect = float(differences.mean())
    result.low, result.high = bootstrap_interval(differences)
    passed = {
        "less": result.high < 0 and (not claim.get("every_seed") or bool((differences < 0).all())),
        "equal": bool((np.abs(differences) <= float(claim.get("tolerance") or 0.0)).all()),
        "at_most": result.high <= 0,
        "at_least": result.low >= 0,
    }[kind]
    result.verdict = "PASS" if passed else "FAIL"
    return result


def claims_of(jobs: list[Any]) -> list[dict[str, Any]]:
    """The claims in the jobs' resolved configs (the first job's: an experiment's claims are the same in every job)."""
    for job in jobs:
        claims = job.config.get("claims")
        if claims:
            return list(claims)
    return []


def experiment_claims(name: str) -> list[dict[str, Any]]:
    """The claims ``experiment=NAME`` lists now (``rlhf-lab report --claims NAME``: claims revised after a sweep)."""
    from omegaconf import OmegaConf

    from rlhf_lab.config.compose import _hydra_compose, group_options
    from rlhf_lab.errors import ToolError

    if name not in group_options("experiment"):
        raise ToolError(f"--claims {name}: no such experiment; choose from: {', '.join(group_options('experiment'))}")
    return list(OmegaConf.to_container(_hydra_compose([f"experiment={name}"]).claims, resolve=True))


def claims_table(results: list[ClaimResult]) -> str:
    """The markdown table of verdicts."""
    lines = ["| claim | verdict | metric | comparison | seeds | effect (a − b) | 95% interval |",
             "| --- | --- | --- | --- | ---: | ---: | --- |"]
    for result in results:
        interval = "—" if math.isnan(result.low) else f"[{result.low:.3g}, {result.high:.3g}]"
        effect = "—" if math.isnan(result.effect) else f"{result.effect:.3g}"
        verdict = result.verdict if not result.why else f"{result.verdict} ({result.why})"
        lines.append(f"| {result.name} | {verdict} | {result.metric} | {result.comparison} | {len(result.seeds)} | "
                     f"{effect} | {interval} |")
    return "\n".join(lines)


def claim_lines(results: list[ClaimResult]) -> list[str]:
    """One console line per claim."""
    lines = []
    for r in results:
        if r.verdict == "NO DATA":
            lines.append(f"NO DATA {r.name}: {r.comparison} on {r.metric} ({r.why})")
            continue
        seeds = ",".join(str(seed) for seed in r.seeds)
        lines.append(f"{r.verdict} {r.name}: {r.comparison} on {r.metric}; seeds {seeds}; effect {r.effect:.3g} "
                     f"[95% CI {r.low:.3g}, {r.high:.3g}]")
    return lines
