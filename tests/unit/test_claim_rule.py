"""The claim rule's error rates, by simulation with fixed seeds (rlhf_lab/tools/claim_rule.py): the t interval's
coverage at 3, 5 and 10 seeds where the percentile bootstrap's falls short, the false-PASS rate of one claim and of
an experiment's claims together (Holm), the power the seed count promises, Clopper–Pearson against its exact
coverage, and the closed forms of Student's t with 2 degrees of freedom."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from rlhf_lab.tools import claim_rule
from rlhf_lab.tools.claim_rule import equivalence_test, holm, mean_power, mean_test, rate_pass_probability, seeds_needed

REPS = 20_000  # Monte Carlo standard error of a 5% rate: 0.0015


def noise(kind: str, generator: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """Paired differences of two arms that do not differ: symmetric about 0 (the arms are exchangeable)."""
    if kind == "normal":
        return generator.standard_normal(shape)
    if kind == "heavy":  # Student's t with 3 degrees of freedom
        return generator.standard_t(3, shape)
    outlier = generator.random(shape) < 0.2  # one seed in five far off (a run that diverged), either side
    return np.where(outlier, 8.0 * generator.choice([-1.0, 1.0], shape), generator.standard_normal(shape))


def t_statistics(values: np.ndarray) -> np.ndarray:
    n = values.shape[1]
    with np.errstate(divide="ignore"):  # every seed the same outlier: sd 0, t infinite (mean_test: p 0 or 1)
        return values.mean(1) / (values.std(1, ddof=1) / math.sqrt(n))


@pytest.mark.parametrize("n", [3, 5, 10])
def test_the_t_interval_keeps_its_coverage_where_the_bootstrap_does_not(n: int) -> None:
    """95% two-sided, normal noise, a null and a non-null effect: the t interval covers the mean 95% of the time
    (± 0.6%); the percentile bootstrap the old rule used covers about 76% at 3 seeds, 84% at 5."""
    generator = np.random.default_rng(n)
    for effect in (0.0, 0.7):
        values = effect + generator.standard_normal((REPS, n))
        mean, error = values.mean(1), values.std(1, ddof=1) / math.sqrt(n)
        half = stats.t.ppf(0.975, n - 1) * error
        assert abs(np.mean((mean - half <= effect) & (effect <= mean + half)) - 0.95) < 0.006
        # mean_test's interval at one-sided level 0.025 is the same interval
        test = mean_test(values[0], 0.1, 0.025)
        assert (test.low, test.high) == pytest.approx((mean[0] - half[0], mean[0] + half[0]))
    values = generator.standard_normal((2000, n))
    means = values[np.arange(2000)[:, None, None], generator.integers(0, n, (2000, 1000, n))].mean(-1)
    low, high = np.percentile(means, [2.5, 97.5], axis=1)
    bootstrap = np.mean((low <= 0) & (high >= 0))
    assert bootstrap < {3: 0.80, 5: 0.88, 10: 0.93}[n]


@pytest.mark.parametrize("n", [3, 5, 10])
@pytest.mark.parametrize("kind", ["normal", "heavy", "outliers"])
def test_a_claim_with_no_effect_passes_at_most_alpha(n: int, kind: str) -> None:
    """One claim at level 0.05, arms that do not differ: PASS (p of 'mean ≤ 0' at most 0.05) about 5% of the time
    with normal noise, no more with heavy tails or a diverged seed in five (the old rule: 12.3% at 3 seeds)."""
    generator = np.random.default_rng(100 + n)
    values = noise(kind, generator, (REPS, n))
    rate = np.mean(stats.t.sf(t_statistics(values), n - 1) <= 0.05)
    if kind == "normal":
        assert abs(rate - 0.05) < 0.006
    else:
        assert rate <= 0.055
    # the same decision through mean_test, on a few of the draws
    for row in values[:50]:
        assert (mean_test(row, 0.5, 0.05).p_pass <= 0.05) == (stats.t.sf(t_statistics(row[None])[0], n - 1) <= 0.05)


def test_holm_keeps_an_experiments_false_pass_rate_at_alpha() -> None:
    """Six claims with no effect at 5 seeds: without a correction at least one PASSes ~26% of the time (1 − 0.95^6);
    with Holm at most 5%."""
    generator = np.random.default_rng(7)
    values = generator.standard_normal((REPS, 6, 5))
    p = stats.t.sf(values.mean(-1) / (values.std(-1, ddof=1) / math.sqrt(5)), 4)
    uncorrected = np.mean((p <= 0.05).any(1))
    assert abs(uncorrected - (1 - 0.95 ** 6)) < 0.01
    corrected = np.mean([min(holm(list(row))) <= 0.05 for row in p[:5000]])
    assert corrected <= 0.05 + 0.006


def test_holm_adjusted_p_values_by_hand() -> None:
    # sorted 0.01, 0.03, 0.04, 0.2 -> 4·0.01, 3·0.03, max(0.09, 2·0.04), max(0.09, 1·0.2)
    assert holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_the_fail_test_errs_at_most_alpha_when_the_effect_is_exactly_min_effect() -> None:
    generator = np.random.default_rng(3)
    delta = 0.4
    values = delta + generator.standard_normal((REPS, 5))
    error = values.std(1, ddof=1) / math.sqrt(5)
    rate = np.mean(stats.t.cdf((values.mean(1) - delta) / error, 4) <= 0.05)
    assert abs(rate - 0.05) < 0.006
    assert mean_test(values[0], delta, 0.05).p_fail == pytest.approx(
        stats.t.cdf((values[0].mean() - delta) / error[0], 4))


@pytest.mark.parametrize(("sd", "delta", "level"), [(1.0, 1.0, 0.05), (0.05, 0.02, 0.01), (2.0, 1.0, 0.05 / 6)])
def test_the_seeds_a_claim_needs_give_it_its_power(sd: float, delta: float, level: float) -> None:
    """At n = seeds_needed the PASS test detects an effect of δ with probability ≥ 0.8 (simulated), at n − 1 it does
    not (the noncentral t)."""
    n = seeds_needed(lambda k: mean_power(k, sd, delta, level))
    assert n is not None and n >= 2
    assert mean_power(n, sd, delta, level) >= 0.8 > mean_power(n - 1, sd, delta, level)
    generator = np.random.default_rng(n)
    values = delta + sd * generator.standard_normal((REPS, n))
    simulated = np.mean(stats.t.sf(t_statistics(values), n - 1) <= level)
    assert simulated == pytest.approx(mean_power(n, sd, delta, level), abs=0.01)


def test_equivalence_at_the_margin_passes_at_most_alpha_and_inside_it_with_its_power() -> None:
    generator = np.random.default_rng(11)
    margin, n, sd = 0.5, 12, 0.4
    at_margin = margin + sd * generator.standard_normal((4000, n))
    rate = np.mean([equivalence_test(row, margin, 0.05).p_pass <= 0.05 for row in at_margin])
    assert rate <= 0.05 + 0.01
    inside = sd * generator.standard_normal((4000, n))
    power = np.mean([equivalence_test(row, margin, 0.05).p_pass <= 0.05 for row in inside])
    assert power == pytest.approx(mean_power(n, sd, margin, 0.05, equivalence=True), abs=0.03)


def test_clopper_pearson_by_hand_and_its_exact_coverage() -> None:
    """0 of 10: the one-sided 95% upper bound solves (1 − p)^10 = 0.05; 10 of 10 the mirror. Over a grid of true
    rates the one-sided upper bound covers at least 95% (exact binomial sums)."""
    assert claim_rule.clopper_pearson(0, 10, 0.05) == pytest.approx((0.0, 1 - 0.05 ** 0.1))
    assert claim_rule.clopper_pearson(10, 10, 0.05) == pytest.approx((0.05 ** 0.1, 1.0))
    for rate in np.linspace(0.01, 0.99, 25):
        covered = sum(stats.binom.pmf(k, 10, rate) for k in range(11)
                      if claim_rule.clopper_pearson(k, 10, 0.05)[1] >= rate)
        assert covered >= 0.95 - 1e-9


def test_a_rate_claim_at_five_seeds_cannot_pass_and_its_size_is_exact() -> None:
    """'Never diverges' as 0 of 5 passed 59% of the time at a true rate of 10% under the old rule. Now a rate claim
    (at most 0.4, planned for a true rate of 0) needs 10 seeds at α = 0.05/6: at 5 it cannot PASS whatever it sees;
    at the bound, its PASS probability (its false-PASS rate) is at most the level."""
    level = 0.05 / 6
    assert rate_pass_probability(5, 0.4, level, True, 0.0) == 0.0  # 0.6^5 = 0.078 > level: no outcome PASSes
    assert seeds_needed(lambda n: rate_pass_probability(n, 0.4, level, True, 0.0)) == 10  # 0.6^10 = 0.006
    for n in (5, 10, 20, 40):
        for bound in (0.1, 0.3, 0.5):
            assert rate_pass_probability(n, bound, 0.05, True, bound) <= 0.05
            assert rate_pass_probability(n, bound, 0.05, False, bound) <= 0.05
    test = claim_rule.rate_test(0, 10, 0.4, level, at_most=True)
    assert test.p_pass == pytest.approx(0.6 ** 10) and test.effect == 0.0


def test_two_degrees_of_freedom_by_hand() -> None:
    """Differences −0.3, −0.1, −0.3: mean −0.2333, sd 0.11547, t = 3.5 towards the claim; with 2 degrees of freedom
    P(T > t) = 1/2 − t / (2·√(t² + 2)) = 0.036411, and the quantile t_q = (2q − 1)·√(2 / (1 − (2q − 1)²))."""
    test = mean_test(np.array([-0.3, -0.1, -0.3]), 0.05, 0.025, sign=-1)
    assert test.p_pass == pytest.approx(0.5 - 3.5 / (2 * math.sqrt(3.5 ** 2 + 2)), rel=1e-9)
    assert test.sd == pytest.approx(math.sqrt(0.04 / 3), rel=1e-12)
    u = 2 * 0.975 - 1
    half = u * math.sqrt(2 / (1 - u * u)) * math.sqrt(0.04 / 3) / math.sqrt(3)
    assert (test.low, test.high) == pytest.approx((-0.7 / 3 - half, -0.7 / 3 + half), rel=1e-9)
    # FAIL test: H0 "b − a ≥ 0.05" is rejected by small values: p = P(T ≤ (0.2333 − 0.05) / 0.06667 = 2.75)
    assert test.p_fail == pytest.approx(0.5 + 2.75 / (2 * math.sqrt(2.75 ** 2 + 2)), rel=1e-9)
