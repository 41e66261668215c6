"""An experiment's claims evaluated on its jobs (``rlhf-lab report``): PASS / FAIL / INCONCLUSIVE with stated error
rates (:mod:`rlhf_lab.tools.claim_rule` derives them).

The claims are the ``claims:`` of the jobs' resolved config (:mod:`rlhf_lab.config.claims`). Per claim, each
seed gives one number: ``a − b`` for ``less`` and ``equal`` (seeds paired, those both arms ran), ``a − value`` for
``at_most`` / ``at_least``; for a 0/1 metric (``diverged``) the number of seeds where it is 1. The effect is their
mean (or the rate). Each claim's two one-sided tests (its effect beyond 0 in the claimed direction: PASS; short of
its ``min_effect``: FAIL) are Holm-corrected over the experiment's claims at α = 0.05 each way, so the chance that
any claim of an experiment PASSes wrongly is at most 5%, whatever the number of claims. A claim below the seeds its
power needs is INCONCLUSIVE, with the seeds it needs. NO DATA: an arm the report does not have (a partial sweep),
or fewer than 2 seeds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlhf_lab.config.claims import RATE_METRICS, parse_arm
from rlhf_lab.tools import claim_rule
from rlhf_lab.tools.claim_rule import ALPHA, POWER

CLAIMS_NOTE = ("Each claim's effect is the mean over seeds of a − b (or a − the bound; for `diverged` the rate), its "
               "interval the t interval (Clopper–Pearson for a rate) at 1 − 2·0.05/m over the m claims. PASS and FAIL "
               "are one-sided tests Holm-corrected over the claims at 0.05 each way; below the seeds its power needs "
               "(0.8 at the claim's minimum effect) a claim is INCONCLUSIVE (rlhf_lab/tools/claim_rule.py).")


@dataclass
class ClaimResult:
    name: str
    text: str
    metric: str
    comparison: str  # "a < b" written with the arms
    verdict: str  # PASS | FAIL | INCONCLUSIVE | NO DATA
    seeds: list[Any]
    effect: float  # mean over seeds of a − b (or a − value); the rate for a 0/1 metric
    low: float  # the interval of the effect at 1 − 2α/m (m claims): each end at Bonferroni's level
    high: float
    min_effect: float = math.nan  # the claim's: the smallest effect that matters (equal: the margin)
    seeds_needed: int | None = None  # for power POWER at min_effect, the noise these seeds show
    false_pass: float = math.nan  # the chance a claim with no effect PASSes at these seeds and this level
    p_pass: float = math.nan  # Holm-adjusted p of the PASS test
    p_fail: float = math.nan  # Holm-adjusted p of the FAIL test
    sd: float = math.nan  # the seeds' standard deviation (of a − b)
    why: str = ""  # what NO DATA lacks; why INCONCLUSIVE; why FAIL
    replicated: dict[str, Any] = field(default_factory=dict)  # the same claim at fresh seeds (--replicate)

    def summary(self) -> dict[str, Any]:
        """The W&B summary / claims.json entry: ``claims/<name>/<field>``."""
        fields = [("verdict", self.verdict), ("pass", self.verdict == "PASS"), ("effect", self.effect),
                  ("ci_low", self.low), ("ci_high", self.high), ("min_effect", self.min_effect),
                  ("seeds", len(self.seeds)), ("seeds_needed", self.seeds_needed), ("false_pass_rate", self.false_pass),
                  ("p_pass", self.p_pass), ("p_fail", self.p_fail), ("metric", self.metric),
                  ("comparison", self.comparison)]
        if self.replicated:
            fields += [(f"replicate_{key}", value) for key, value in self.replicated.items()]
        return {f"claims/{self.name}/{key}": value for key, value in fields}


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


def _numbers(claim: Any, arms: list[Any], per_job: dict[int, dict[str, float]],
             result: ClaimResult) -> np.ndarray | None:
    """The claim's number per seed (``a − b`` paired, ``a − value``, or the 0/1 metric itself); None, with
    ``result.why`` set, when an arm is missing or fewer than 2 seeds have it."""
    kind, metric = claim["kind"], claim["metric"]
    a = _arm_values(claim["a"], arms, per_job, metric)
    b = _arm_values(claim["b"], arms, per_job, metric) if kind in ("less", "equal") else None
    for side in (a, b):
        if isinstance(side, str):
            result.why = side
            return None
    seeds = sorted(a if b is None else set(a) & set(b), key=lambda seed: (0, seed) if isinstance(seed, int) else (1, str(seed)))
    result.seeds = seeds
    if len(seeds) < 2:
        result.why = f"{len(seeds)} seed(s) with {metric} in {'both arms' if b is not None else 'the arm'}; a test needs 2"
        return None
    if metric in RATE_METRICS:
        return np.array([a[seed] for seed in seeds])
    return np.array([a[seed] - (b[seed] if b is not None else float(claim["value"])) for seed in seeds])


def _test(claim: Any, numbers: np.ndarray, level: float) -> tuple[claim_rule.Test, int | None, float]:
    """The claim's tests at one-sided ``level``, the seeds its power needs and its false-PASS rate."""
    kind, delta = claim["kind"], float(claim["min_effect"])
    n = len(numbers)
    if claim["metric"] in RATE_METRICS:
        at_most, bound = kind == "at_most", float(claim["value"])
        test = claim_rule.rate_test(int(round(numbers.sum())), n, bound, level, at_most)
        needed = claim_rule.seeds_for(kind, delta, level, bound=bound)
        return test, needed, claim_rule.rate_pass_probability(n, bound, level, at_most, bound)
    if kind == "equal":
        test = claim_rule.equivalence_test(numbers, delta, level)
    else:
        test = claim_rule.mean_test(numbers, delta, level, sign=1 if kind == "at_least" else -1)
    return test, claim_rule.seeds_for(kind, delta, level, sd=test.sd), level


def evaluate_claims(claims: list[Any], arms: list[Any], per_job: dict[int, dict[str, float]]) -> list[ClaimResult]:
    """The claims on the report's arms (``per_job``: each job's columns, by ``id(job)``), Holm-corrected together."""
    results, tests = [], {}
    for claim in claims:
        symbol = {"less": "<", "equal": "=", "at_most": "≤", "at_least": "≥"}[claim["kind"]]
        against = claim.get("b") if claim["kind"] in ("less", "equal") else claim.get("value")
        result = ClaimResult(claim["name"], claim.get("text", ""), claim["metric"], f"{claim['a']} {symbol} {against}",
                             "NO DATA", [], math.nan, math.nan, math.nan, float(claim.get("min_effect") or math.nan))
        numbers = _numbers(claim, arms, per_job, result)
        if numbers is not None:
            tests[len(results)] = (claim, numbers)
        results.append(result)
    level = ALPHA / max(1, len(tests))  # Bonferroni's per-claim level: Holm's strictest, the power's and intervals'
    computed = {index: _test(claim, numbers, level) for index, (claim, numbers) in tests.items()}
    adjusted_pass = claim_rule.holm([test.p_pass for test, _, _ in computed.values()])
    adjusted_fail = claim_rule.holm([test.p_fail for test, _, _ in computed.values()])
    for (index, (test, needed, false_pass)), p_pass, p_fail in zip(computed.items(), adjusted_pass, adjusted_fail):
        result = results[index]
        result.effect, result.low, result.high, result.sd = test.effect, test.low, test.high, test.sd
        result.seeds_needed, result.false_pass, result.p_pass, result.p_fail = needed, false_pass, p_pass, p_fail
        n = len(result.seeds)
        if needed is None or n < needed:
            result.verdict = "INCONCLUSIVE"
            result.why = (f"needs {needed} seeds, has {n}" if needed else "no seed count up to "
                          f"{claim_rule.MAX_SEEDS} reaches power {POWER}") + f" (min_effect {result.min_effect:.3g}"
            result.why += f", sd {test.sd:.3g})" if result.metric not in RATE_METRICS else ")"
            leaning = "FAIL" if p_fail <= ALPHA else "PASS" if p_pass <= ALPHA else None
            result.why += f"; its test would {leaning} at these seeds" if leaning else ""
        elif p_fail <= ALPHA:
            result.verdict = "FAIL"
            result.why = ("beyond the margin" if tests[index][0]["kind"] == "equal" else
                          "against the bound" if result.metric in RATE_METRICS else "short of min_effect")
        elif p_pass <= ALPHA:
            result.verdict = "PASS"
        else:
            result.verdict = "INCONCLUSIVE"
            result.why = "the interval holds both outcomes"
    return results


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


def _interval(result: ClaimResult) -> str:
    return "—" if math.isnan(result.low) else f"[{result.low:.3g}, {result.high:.3g}]"


def _number(value: float | None) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def claims_table(results: list[ClaimResult]) -> str:
    """How the claims were judged, then the markdown table of verdicts (with a replication's verdict beside each,
    when there is one)."""
    replicated = any(result.replicated for result in results)
    lines = [CLAIMS_NOTE, "","| claim | verdict | metric | comparison | effect | interval | min effect | seeds (needed) | "
             "false PASS | p (Holm) |" + (" at fresh seeds |" if replicated else ""),
             "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |" + (" --- |" if replicated else "")]
    for result in results:
        verdict = result.verdict if not result.why else f"{result.verdict} ({result.why})"
        needed = "—" if result.seeds_needed is None else result.seeds_needed
        line = (f"| {result.name} | {verdict} | {result.metric} | {result.comparison} | {_number(result.effect)} | "
                f"{_interval(result)} | {_number(result.min_effect)} | {len(result.seeds)} ({needed}) | "
                f"{_number(result.false_pass)} | {_number(result.p_pass)} |")
        if replicated:
            line += f" {_replication(result)} |"
        lines.append(line)
    return "\n".join(lines)


def _replication(result: ClaimResult) -> str:
    again = result.replicated
    if not again:
        return "—"
    flag = " **FLIPPED**" if again.get("flipped") else ""
    return f"{again['verdict']}{flag}: {_number(again['effect'])} {again['interval']} at {again['seeds']} seeds"


def claim_lines(results: list[ClaimResult]) -> list[str]:
    """One console line per claim."""
    lines = []
    for r in results:
        if r.verdict == "NO DATA":
            lines.append(f"NO DATA {r.name}: {r.comparison} on {r.metric} ({r.why})")
            continue
        seeds = ",".join(str(seed) for seed in r.seeds)
        why = f" ({r.why})" if r.why else ""
        line = (f"{r.verdict}{why} {r.name}: {r.comparison} on {r.metric}; seeds {seeds}; effect {r.effect:.3g} "
                f"{_interval(r)}, min effect {r.min_effect:.3g}, false PASS {r.false_pass:.3g}")
        if r.replicated:
            line += f"; at fresh seeds {_replication(r)}"
        lines.append(line)
    return lines
