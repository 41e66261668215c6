"""The claim rule's error rates by simulation: the old rule (percentile bootstrap, "every seed") against the new one
(t tests, Holm, a minimum effect, seeds by power), at 3, 5 and 10 seeds.

    python -m benchmarks.claim_rule_errors [--reps 20000] [--out FILE.json]

Prints, per n and noise (paired differences: normal; heavy-tailed, Student's t with 3 degrees of freedom; one seed in
five a far outlier either way, as a diverged run is):

- the two-sided 95% interval's coverage of the true mean, bootstrap and t;
- the false-PASS rate of one claim whose arms do not differ (old: interval wholly below 0; new: the t test at 0.05);
- the chance that at least one of 6 such claims PASSes (old, uncorrected; new, Holm);
- stability: the old "never diverges" (0 of n) PASSing at a true divergence rate of 10%; the new "at most 0.4"
  (Clopper–Pearson at 0.05/6) PASSing at the bound (its false-PASS rate) and at a rate of 0 (its power).

docs/guides/sweeps.md#claims quotes these figures; tests/unit/test_claim_rule.py checks them with fixed seeds.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from scipy import stats

from rlhf_lab.tools.claim_rule import holm, rate_pass_probability


def differences(kind: str, generator: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    if kind == "normal":
        return generator.standard_normal(shape)
    if kind == "heavy":
        return generator.standard_t(3, shape)
    outlier = generator.random(shape) < 0.2
    return np.where(outlier, 8.0 * generator.choice([-1.0, 1.0], shape), generator.standard_normal(shape))


def bootstrap_bounds(values: np.ndarray, generator: np.random.Generator, resamples: int = 1000) -> np.ndarray:
    """The old rule's 95% percentile-bootstrap interval of the mean, per row: [rows, 2]."""
    rows, n = values.shape
    means = values[np.arange(rows)[:, None, None], generator.integers(0, n, (rows, resamples, n))].mean(-1)
    return np.percentile(means, [2.5, 97.5], axis=1).T


def measure(n: int, kind: str, reps: int, generator: np.random.Generator) -> dict[str, float]:
    values = differences(kind, generator, (reps, n))
    mean, sd = values.mean(1), values.std(1, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = mean / (sd / math.sqrt(n))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    boot = bootstrap_bounds(values[: min(reps, 4000)], generator)
    six = differences(kind, generator, (reps // 4, 6, n))
    with np.errstate(divide="ignore", invalid="ignore"):
        six_t = six.mean(-1) / (six.std(-1, ddof=1) / math.sqrt(n))
    p = stats.t.sf(six_t, n - 1)
    six_boot = np.stack([bootstrap_bounds(six[: 1000, k], generator)[:, 1] < 0 for k in range(6)], 1)
    return {
        "coverage_bootstrap": float(np.mean((boot[:, 0] <= 0) & (boot[:, 1] >= 0))),
        "coverage_t": float(np.mean((mean - half <= 0) & (mean + half >= 0))),
        "false_pass_old": float(np.mean(boot[:, 1] < 0)),
        "false_pass_new": float(np.mean(stats.t.sf(t, n - 1) <= 0.05)),
        "any_of_6_old": float(np.mean(six_boot.any(1))),
        "any_of_6_new": float(np.mean([min(holm(list(row))) <= 0.05 for row in p])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20_000)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    generator = np.random.default_rng(0)
    results = {}
    for n in (3, 5, 10):
        for kind in ("normal", "heavy", "outliers"):
            results[f"n={n} {kind}"] = measure(n, kind, options.reps, generator)
        results[f"n={n} stability"] = {  # old: "never diverges" PASSes on 0 of n, here at a true rate of 10%
            "old_pass_at_rate_10pct": 0.9 ** n,  # new: "at most 0.4" at 0.05/6, PASS at the bound (its size), at 0
            "new_pass_at_bound": rate_pass_probability(n, 0.4, 0.05 / 6, True, 0.4),
            "new_pass_at_rate_0": rate_pass_probability(n, 0.4, 0.05 / 6, True, 0.0)}
    for key, figures in results.items():
        print(key, " ".join(f"{name} {value:.4f}" for name, value in figures.items()))
    if options.out:
        with open(options.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
