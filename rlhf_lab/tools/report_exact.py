"""The report's part for runs on the exact task (``model=exact``, metrics ``exact/*``): columns, ranking, plots.

Per job, from its last training line that has ``exact/gap`` (the final policy):

- final gap: ``exact/gap`` = J* − J(π) = β·KL(π‖π*), 0 at the regularised optimum;
- KL(π‖π_ref): ``exact/kl_sequence``, the true sequence-level KL, beside KL(π*‖π_ref) (``exact/kl_optimal``);
- TV to π*: ``exact/tv_to_optimal``;
- estimate bias: ``exact/kl_estimate_bias``, E_π[Σ_t estimate_t] − KL(π‖π_ref) under the final policy;
- with several equally rewarded optimal responses (``exact/mode_coverage`` logged): the entropies H(π), H(π*), the
  mass on the modes, the mode coverage and the effective number of modes of π and of π*;
- with responses of several lengths (``exact/length`` logged, ``model.exact.stop``): the mean length, and less π*'s.

Arms are ranked by final gap (mean over seeds), and ``gap_vs_step.png`` / ``kl_sequence_vs_step.png`` plot
gap and true KL against steps with a band over seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (column, markdown header, metrics.jsonl key): appended to the report's columns when jobs have them.
EXACT_METRICS = (
    ("final_gap", "final gap J*−J", "exact/gap"),
    ("final_kl_sequence", "KL(π‖π_ref) per sequence", "exact/kl_sequence"),
    ("kl_optimal", "KL(π*‖π_ref) per sequence", "exact/kl_optimal"),
    ("final_tv", "TV to π*", "exact/tv_to_optimal"),
    ("kl_to_optimal", "KL(π‖π*) per sequence", "exact/kl_to_optimal"),
    ("estimate_bias", "estimate bias per sequence", "exact/kl_estimate_bias"),
)
# With several equally rewarded optimal responses (reward.modes, rlhf_lab/testbed/modes.py): columns only for jobs
# that logged them.
MODE_METRICS = (
    ("final_entropy", "H(π)", "exact/entropy"),
    ("entropy_optimal", "H(π*)", "exact/entropy_optimal"),
    ("mode_mass", "mass on modes", "exact/mode_mass"),
    ("mode_coverage", "mode coverage", "exact/mode_coverage"),
    ("modes_effective", "effective modes", "exact/modes_effective"),
    ("modes_effective_optimal", "effective modes of π*", "exact/modes_effective_optimal"),
)
# With responses of several lengths (model.exact.stop): the policy's mean length, and less π*'s.
LENGTH_METRICS = (
    ("final_length", "mean length", "exact/length"),
    ("length_bias", "length − π*'s", "exact/length_bias"),
)
EXACT_PLOTS = (("exact/gap", "gap J* − J(π) (exact)", "gap_vs_step.png"),
               ("exact/kl_sequence", "KL(π‖π_ref) per sequence (exact)", "kl_sequence_vs_step.png"))


def exact_job_metrics(train_lines: list[dict[str, Any]]) -> dict[str, float]:
    """The exact columns of one job (empty when it has no ``exact/gap``)."""
    exact_lines = [line for line in train_lines if "exact/gap" in line]
    if not exact_lines:
        return {}
    last = exact_lines[-1]
    metrics = {column: last.get(key, math.nan) for column, _, key in EXACT_METRICS}
    # Diverged: the run ended further from π* than the initial policy (π_ref) was, or at a non-finite objective.
    # Runs logged before exact/gap_initial existed have no start to compare with: NaN, not the first logged gap
    # (that one is already `exact_every` updates in).
    start, last_gap = last.get("exact/gap_initial", math.nan), last["exact/gap"]
    metrics["diverged"] = (1.0 if not math.isfinite(last_gap) else math.nan if math.isnan(start)
                           else float(last_gap > start))
    if "exact/mode_coverage" in last:
        metrics.update({column: last.get(key, math.nan) for column, _, key in MODE_METRICS})
    if "exact/length" in last:
        metrics.update({column: last.get(key, math.nan) for column, _, key in LENGTH_METRICS})
    return metrics


def rank_by_gap(rows: list[dict[str, Any]], arms: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Rows and arms sorted by mean final gap, smallest first (unchanged when no row has one)."""
    if not any("final_gap_mean" in row for row in rows):
        return rows, arms

    def key(pair: tuple[dict[str, Any], Any]) -> float:
        gap = pair[0].get("final_gap_mean", math.nan)
        return math.inf if math.isnan(gap) else gap

    ranked = sorted(zip(rows, arms), key=key)
    for rank, (row, _) in enumerate(ranked, start=1):
        row["rank"] = rank
    return [row for row, _ in ranked], [arm for _, arm in ranked]


def exact_plots(arms: list[Any], out: Path, curve: Callable[[Any, str], tuple]) -> list[Path]:
    """Gap (log scale) and true KL against steps, mean line and ± std band over seeds, one line per arm with the
    legend beside the axes (an ablation has dozens of arms); only for keys some job logs. Returns the paths."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    paths = []
    for key, ylabel, name in EXACT_PLOTS:
        if not any(key in line for arm in arms for job in arm.jobs for line in job.train):
            continue
        figure, axes = plt.subplots(figsize=(12, 6))
        for arm in arms:
            steps, means, stds = curve(arm, key)
            (line,) = axes.plot(steps, means, linewidth=1.2, label=f"{arm.name} (n={len(arm.jobs)})")
            low = np.maximum(means - stds, means * 0.1) if key == "exact/gap" else means - stds
            axes.fill_between(steps, low, means + stds, color=line.get_color(), alpha=0.12, linewidth=0)
        if key == "exact/gap":
            axes.set_yscale("log")
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3)
        axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        figure.tight_layout()
        paths.append(out / name)
        figure.savefig(paths[-1], dpi=110)
        plt.close(figure)
    return paths
