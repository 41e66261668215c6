"""The claim rule's statistics: tests with stated error rates on a handful of seeds (``rlhf-lab report``).

A claim is judged on one number per seed (``a − b`` paired by seed, or ``a − value``). It states a direction and a
minimum effect δ > 0 in the metric's units (``min_effect``: the smallest difference that would matter). Two
one-sided tests decide it, each at the experiment's family-wise level α = :data:`ALPHA`, with Holm's step-down
correction over the experiment's claims (:func:`holm`):

- **PASS** test, H0 "the effect is not on the claimed side" (mean ≤ 0): rejected, the claim PASSes;
- **FAIL** test, H0 "the effect reaches δ" (mean ≥ δ): rejected, the claim FAILs (the effect is absent, reversed or
  smaller than δ). A FAIL takes precedence: a real effect below δ is not the claim.

Neither rejected: INCONCLUSIVE (the interval holds both 0 and δ). For a mean (:func:`mean_test`) both are t tests
on the seeds' numbers (Student's t: exact for normal noise at any n, where the percentile bootstrap's "95%"
interval covers 76% at 3 seeds); the interval printed is the two-sided t interval at 1 − 2α/m (Bonferroni's
simultaneous level for m claims, the first step of Holm's). For ``equal`` claims δ is the margin of equivalence:
PASS by two one-sided tests that the mean lies within ±δ (:func:`equivalence_test`), FAIL when it lies beyond. A
rate (a 0/1 metric per seed, ``diverged``; :func:`rate_test`) is judged by exact binomial tests, whose interval is
Clopper–Pearson's: PASS when the rate is below (``at_most``) or above (``at_least``) the claimed bound, FAIL when
beyond it on the other side.

**Seeds by power** (:func:`seeds_needed`): a claim needs the smallest n at which its PASS test, at the most
stringent level Holm can ask (α/m), detects an effect of exactly δ with probability :data:`POWER` under the noise its
seeds show (the noncentral t; for a rate, the binomial at the bound less δ). Below that n the verdict is
INCONCLUSIVE, with the n it needs: a PASS or FAIL is printed only where the seeds could have told.

The false-PASS rate of each claim's test is what a claim with no effect would PASS with, at its n and level: the
level for the t tests (exact under normal noise), the binomial test's exact size for a rate
(:func:`rate_pass_probability` at the bound). The rule's
coverage and error rates are measured by simulation in tests/unit/test_claim_rule.py and
``benchmarks/claim_rule_errors.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05  # each way: the chance that any of an experiment's claims PASSes (or FAILs) wrongly
POWER = 0.8  # the chance to PASS a claim whose effect is exactly its min_effect, at the seeds it asks for
MAX_SEEDS = 1000  # seeds_needed stops looking here (an effect this small against this noise: say so, do not loop)


@dataclass
class Test:
    """One claim's statistics before the correction: the effect, its interval, the two one-sided p-values."""

    effect: float  # mean over seeds of a − b (a − value); a rate for 0/1 metrics
    low: float  # the interval at 1 − 2·level
    high: float
    p_pass: float  # H0: the claim is false at its boundary (rejecting it PASSes)
    p_fail: float  # H0: the claim holds by its min_effect (rejecting it FAILs)
    sd: float  # the seeds' sample standard deviation (0 for a rate)


def _sd(values: np.ndarray, mean: float, delta: float) -> float:
    """The sample standard deviation, 0 where it is rounding (equal numbers whose differences were rounded)."""
    sd = float(np.std(values, ddof=1))
    return 0.0 if sd <= 1e-12 * max(abs(mean), delta) else sd


def _t():
    from scipy import stats

    return stats.t


def mean_test(values: np.ndarray, delta: float, level: float, sign: int = 1) -> Test:
    """The claim "sign × mean > 0, by at least ``delta``" on ``values`` (one per seed, n ≥ 2): one-sided t tests
    of mean ≤ 0 (PASS) and mean ≥ δ (FAIL) in the claimed direction, and the t interval of the mean at
    1 − 2·``level``."""
    n, mean = len(values), float(np.mean(values))
    sd = _sd(values, mean, delta)
    oriented = sign * mean
    if sd == 0.0:  # every seed the same number (a deterministic arm): the tests are certain
        return Test(mean, mean, mean, float(oriented <= 0), float(oriented >= delta), 0.0)
    t, error = _t(), sd / math.sqrt(n)
    half = float(t.ppf(1 - level, n - 1)) * error
    return Test(mean, mean - half, mean + half, float(t.sf(oriented / error, n - 1)),
                float(t.cdf((oriented - delta) / error, n - 1)), sd)


def equivalence_test(values: np.ndarray, margin: float, level: float) -> Test:
    """The claim "|mean| ≤ ``margin``" (``equal``): PASS by two one-sided t tests (mean ≤ −margin and
    mean ≥ margin both rejected: the larger p), FAIL when the mean is beyond ±margin (the smaller side's p,
    doubled for the two sides)."""
    n, mean = len(values), float(np.mean(values))
    sd = _sd(values, mean, margin)
    if sd == 0.0:
        inside = abs(mean) <= margin
        return Test(mean, mean, mean, float(not inside), float(inside), 0.0)
    t, error = _t(), sd / math.sqrt(n)
    half = float(t.ppf(1 - level, n - 1)) * error
    p_pass = max(float(t.sf((mean + margin) / error, n - 1)), float(t.cdf((mean - margin) / error, n - 1)))
    p_fail = min(1.0, 2 * min(float(t.sf((mean - margin) / error, n - 1)),
                              float(t.cdf((mean + margin) / error, n - 1))))
    return Test(mean, mean - half, mean + half, p_pass, p_fail, sd)


def clopper_pearson(events: int, n: int, level: float) -> tuple[float, float]:
    """The exact (Clopper–Pearson) interval of a rate, ``events`` of ``n``, each end at one-sided ``level``."""
    from scipy import stats

    low = 0.0 if events == 0 else float(stats.beta.ppf(level, events, n - events + 1))
    high = 1.0 if events == n else float(stats.beta.ppf(1 - level, events + 1, n - events))
    return low, high


def rate_test(events: int, n: int, bound: float, level: float, at_most: bool) -> Test:
    """The claim "the rate is below ``bound``" (``at_most``; above it for ``at_least``): exact binomial tests of
    rate ≥ bound (PASS) and rate ≤ bound (FAIL), the interval Clopper–Pearson's at 1 − 2·``level``."""
    from scipy import stats

    below = float(stats.binom.cdf(events, n, bound))  # P(this few events or fewer | rate = bound)
    above = float(stats.binom.sf(events - 1, n, bound))  # P(this many or more | rate = bound)
    low, high = clopper_pearson(events, n, level)
    p_pass, p_fail = (below, above) if at_most else (above, below)
    return Test(events / n, low, high, p_pass, p_fail, 0.0)


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values: a hypothesis is rejected with the family-wise error rate at most α where
    its adjusted p is ≤ α (the k-th smallest p times m − k + 1, never below an earlier one, at most 1)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def mean_power(n: int, sd: float, delta: float, level: float, equivalence: bool = False) -> float:
    """The chance that the PASS test at one-sided ``level`` rejects with n seeds when the effect is δ (directional)
    or 0 (``equivalence``, margin δ), the noise ``sd``."""
    from scipy import stats

    if n < 2:
        return 0.0
    if sd == 0.0:
        return 1.0
    critical = float(stats.t.ppf(1 - level, n - 1))
    one_side = float(stats.nct.sf(critical, n - 1, delta * math.sqrt(n) / sd))
    return max(0.0, 2 * one_side - 1) if equivalence else one_side


def rate_pass_probability(n: int, bound: float, level: float, at_most: bool, rate: float) -> float:
    """The chance that the rate's PASS test at ``level`` rejects with n seeds when the true rate is ``rate``: at the
    bound, the test's exact size (its false-PASS rate, at most ``level``); δ inside it, its power."""
    from scipy import stats

    rate = min(1.0, max(0.0, rate))
    events = np.arange(n + 1)
    if at_most:  # PASS on k events where P(Bin(n, bound) ≤ k) ≤ level
        passing = events[stats.binom.cdf(events, n, bound) <= level]
        return float(stats.binom.cdf(passing.max(), n, rate)) if len(passing) else 0.0
    passing = events[stats.binom.sf(events - 1, n, bound) <= level]  # P(Bin ≥ k) ≤ level
    return float(stats.binom.sf(passing.min() - 1, n, rate)) if len(passing) else 0.0


def seeds_needed(power_at: Callable[[int], float], target: float = POWER) -> int | None:
    """The smallest n (2 to :data:`MAX_SEEDS`) with ``power_at(n)`` ≥ ``target``; None when none is."""
    if power_at(MAX_SEEDS) < target:
        return None
    low, high = 2, MAX_SEEDS  # power grows with n: bisect
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if power_at(middle) >= target else (middle + 1, high)
    return low


def seeds_for(kind: str, delta: float, level: float, sd: float | None = None, bound: float | None = None) -> int | None:
    """The seeds a claim's PASS test at ``level`` needs for power :data:`POWER` at its ``min_effect`` ``delta``: a
    rate's (``bound`` given; ``kind`` at_most or at_least, planned for the rate ``delta`` inside the bound), else a
    mean's at the noise ``sd`` (an ``equal`` claim's both one-sided tests)."""
    if bound is not None:
        at_most = kind == "at_most"
        true = bound - delta if at_most else bound + delta
        return seeds_needed(lambda n: rate_pass_probability(n, bound, level, at_most, true))
    return seeds_needed(lambda n: mean_power(n, sd, delta, level, kind == "equal"))
