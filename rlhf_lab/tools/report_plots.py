"""The report's plots, readable at sweep scale (36 arms and more): ``rlhf-lab report`` calls :func:`write_all`.

- every arm has its own colour × line style (10 colours × 4 styles: 40 distinct before any repeats), the same in
  every plot, and the legend sits outside the axes, on the right;
- curves are the mean over an arm's seeds, optionally smoothed by an exponential moving average (``--ema A``:
  ``s_t = A·s_{t−1} + (1 − A)·x_t``), with a labelled band: ± 1 sample sd over seeds (``--band sd``) or a 95%
  confidence interval of the mean (``--band ci95``, Student's t);
- ``eval_reward_vs_step.png``: the evaluation reward against step;
- ``kl_estimate_vs_exact.png``: one panel per arm, the KL estimate the run penalised and the exact KL;
- ``reward_vs_kl.png``: on the exact task, each arm's final policy (exact per-sequence KL and expected reward)
  against the optimum π* at each β (with one β, the line J = J*); elsewhere each arm's reward against exact KL,
  each a mean over the last ``k`` training steps
  (``--last-k``, default 20% of the steps) then over seeds, with the Pareto front (no other arm has more reward
  at less KL) drawn through the arms on it.

Arms are read duck-typed: ``arm.name``, ``arm.jobs``, each job's ``train`` and ``eval`` lines (dicts with ``step``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")  # matplotlib's tab10
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D")
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


@dataclass(frozen=True)
class PlotOptions:
    ema: float = 0.0  # 0: no smoothing
    band: str = "sd"  # sd | ci95
    last_k: int | None = None  # None: 20% of the steps (at least 1)


BANDS = ("sd", "ci95")


def arm_style(index: int) -> dict[str, Any]:
    """Colour, line style and marker of the ``index``-th arm: distinct for the first 40 arms."""
    return {"color": COLORS[index % len(COLORS)], "linestyle": LINE_STYLES[(index // len(COLORS)) % len(LINE_STYLES)],
            "marker": MARKERS[(index // len(COLORS)) % len(MARKERS)]}


def ema(values: np.ndarray, alpha: float) -> np.ndarray:
    """Exponential moving average, ``s_0 = x_0``, ``s_t = alpha·s_{t−1} + (1 − alpha)·x_t``."""
    if alpha <= 0 or len(values) == 0:
        return values
    out = np.empty_like(values, dtype=float)
    out[0] = values[0]
    for t in range(1, len(values)):
        out[t] = alpha * out[t - 1] + (1 - alpha) * values[t]
    return out


def seed_curves(arm: Any, key: str, split: str = "train") -> tuple[np.ndarray, list[np.ndarray]]:
    """Steps every seed of the arm logged ``key`` at, and each seed's values there."""
    per_job = []
    for job in arm.jobs:
        lines = getattr(job, split)
        per_job.append({int(line["step"]): float(line[key]) for line in lines if key in line and "step" in line})
    per_job = [values for values in per_job if values]
    if not per_job:
        return np.array([]), []
    steps = np.array(sorted(set.intersection(*(set(values) for values in per_job))))
    return steps, [np.array([values[s] for s in steps]) for values in per_job]


def mean_band(curves: list[np.ndarray], band: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean over seeds and the band's half-width (0 with one seed)."""
    stacked = np.stack(curves)
    mean = stacked.mean(axis=0)
    if len(curves) < 2:
        return mean, np.zeros_like(mean)
    sd = stacked.std(axis=0, ddof=1)
    if band == "ci95":
        return mean, T_975.get(len(curves) - 1, 1.96) * sd / math.sqrt(len(curves))
    return mean, sd


def band_label(band: str, seeds: list[int]) -> str:
    seeds_text = f"{min(seeds)}–{max(seeds)} seeds per arm" if seeds and min(seeds) != max(seeds) else (
        f"{seeds[0]} seed(s) per arm" if seeds else "")
    what = "95% CI of the mean (t)" if band == "ci95" else "± 1 sd over seeds"
    return f"line: mean over seeds; band: {what}; {seeds_text}"


def _figure(arms: list[Any], panels: int = 1) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    legend_columns = 1 if len(arms) <= 18 else 2
    width = 7 + 2.6 * legend_columns
    height = max(4.5, 0.22 * len(arms) / legend_columns + 1.5)
    return plt.subplots(figsize=(width, height)) if panels == 1 else plt.subplots(panels, figsize=(width, height))


def _legend_outside(figure: Any, axes: Any, count: int) -> None:
    columns = 1 if count <= 18 else 2
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, ncols=columns,
                frameon=False)
    figure.tight_layout()


def plot_curves(arms: list[Any], key: str, ylabel: str, path: Path, options: PlotOptions,
                split: str = "train") -> None:
    """Mean ± band of ``key`` over steps, one styled line per arm, legend outside the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = _figure(arms)
    seeds, drawn = [], 0
    for index, arm in enumerate(arms):
        steps, curves = seed_curves(arm, key, split)
        if not len(steps):
            continue
        mean, half = mean_band([ema(c, options.ema) for c in curves], options.band)
        style = arm_style(index)
        axes.plot(steps, mean, color=style["color"], linestyle=style["linestyle"], linewidth=1.4,
                  marker=style["marker"] if len(steps) < 20 else None, markersize=3,
                  label=f"{arm.name} (n={len(curves)})")
        axes.fill_between(steps, mean - half, mean + half, color=style["color"], alpha=0.12, linewidth=0)
        seeds.append(len(curves))
        drawn += 1
    if not drawn:
        axes.text(0.5, 0.5, f"no {key} lines in these jobs", ha="center", va="center", transform=axes.transAxes)
    smoothing = f", EMA {options.ema:g}" if options.ema > 0 else ""
    axes.set_title(f"{ylabel}{smoothing}\n{band_label(options.band, seeds)}", fontsize="medium")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    if drawn:
        _legend_outside(figure, axes, drawn)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def plot_kl_estimate_vs_exact(arms: list[Any], path: Path, options: PlotOptions) -> None:
    """One small panel per arm: ``kl/estimate`` (dashed) and ``kl/exact`` (solid), means over seeds."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    columns = min(4, max(1, len(arms)))
    rows = math.ceil(len(arms) / columns) or 1
    figure, grid = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.4 * rows), squeeze=False, sharex=True)
    for index, arm in enumerate(arms):
        axes = grid[index // columns][index % columns]
        style = arm_style(index)
        for key, linestyle, label in (("kl/exact", "-", "exact"), ("kl/estimate", "--", "estimate")):
            steps, curves = seed_curves(arm, key)
            if len(steps):
                mean, _ = mean_band([ema(c, options.ema) for c in curves], options.band)
                axes.plot(steps, mean, color=style["color"], linestyle=linestyle, linewidth=1.2, label=label)
        axes.set_title(arm.name, fontsize="x-small")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        axes.tick_params(labelsize="x-small")
        axes.grid(alpha=0.3)
    for index in range(len(arms), rows * columns):
        grid[index // columns][index % columns].axis("off")
    handles, labels = grid[0][0].get_legend_handles_labels()
    figure.suptitle("KL per token: the penalised estimate (dashed) vs the exact KL (solid), mean over seeds",
                    fontsize="small")
    figure.supxlabel("step", fontsize="small")
    # The legend in a band of its own under the title (at the top right it covered the title's end).
    figure.tight_layout(rect=(0, 0, 1, 0.9 if rows == 1 else 0.95))
    if handles:
        top = grid[0][0].get_position().y1
        figure.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, top + 0.035 / rows), ncols=2,
                      fontsize="x-small", frameon=False)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def last_k_point(arm: Any, last_k: int | None, split: str = "train") -> tuple[float, float, float, float, int]:
    """Reward and exact KL averaged over each seed's last ``k`` training steps (``split="eval"``: evaluations),
    then mean and sd over seeds."""
    rewards, kls, used = [], [], 0
    reward_key, kl_key = ("reward/mean", "kl/exact") if split == "train" else ("eval/reward/mean", "eval/kl/exact")
    for job in arm.jobs:
        lines = [{"reward/mean": line[reward_key], "kl/exact": line[kl_key]}
                 for line in getattr(job, split) if reward_key in line and kl_key in line]
        if not lines:
            continue
        k = last_k or max(1, round(0.2 * len(lines)))
        used = k
        rewards.append(float(np.mean([line["reward/mean"] for line in lines[-k:]])))
        kls.append(float(np.mean([line["kl/exact"] for line in lines[-k:]])))
    if not rewards:
        return math.nan, math.nan, math.nan, math.nan, 0
    return float(np.mean(kls)), float(np.mean(rewards)), _sd(kls), _sd(rewards), used


def _sd(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (less or equal KL and more or equal reward, one strictly),
    ordered by KL."""
    front = []
    for i, (kl, reward) in enumerate(points):
        if math.isnan(kl) or math.isnan(reward):
            continue
        dominated = any((k2 <= kl and r2 >= reward) and (k2 < kl or r2 > reward)
                        for j, (k2, r2) in enumerate(points) if j != i and not math.isnan(k2) and not math.isnan(r2))
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def frontier_split(arms: list[Any]) -> str:
    """The lines the frontier reads: ``train``, or ``eval`` when some arm has no sampled training reward (sft, dpo):
    one yardstick, every arm's final evaluation."""
    return "train" if all(_logged([arm], "train", "reward/mean") for arm in arms) else "eval"


EXACT_FRONTIER = ("exact/kl_sequence", "exact/reward", "exact/kl_optimal", "exact/reward_optimal")


def exact_final(arm: Any) -> tuple[float, float, float, float, tuple[float, float, float] | None]:
    """An exact-task arm's final policy: KL(π‖π_ref) and E_π[R] per sequence, mean and sd over seeds, and its optimum
    (β, KL(π*‖π_ref), E_π*[R]) from its jobs' last exact line."""
    kls, rewards, optimum = [], [], None
    for job in arm.jobs:
        lines = [line for line in job.train if all(key in line for key in EXACT_FRONTIER)]
        if lines:
            kls.append(float(lines[-1]["exact/kl_sequence"]))
            rewards.append(float(lines[-1]["exact/reward"]))
            beta = float(job.config.get("kl.coef", math.nan))  # (the job's flattened config)
            optimum = (beta, float(lines[-1]["exact/kl_optimal"]), float(lines[-1]["exact/reward_optimal"]))
    if not kls:
        return math.nan, math.nan, math.nan, math.nan, None
    return float(np.mean(kls)), float(np.mean(rewards)), _sd(kls), _sd(rewards), optimum


def plot_exact_frontier(arms: list[Any], path: Path) -> list[int]:
    """On the exact task every arm sits on some trade-off, so a Pareto front among arms says little: each arm's final
    policy (per-sequence KL and expected reward, exact) against the optimum's own front, π* at each β the arms ran
    (joined where there are several), or with one β the line J = J*: R − β·KL = J* (no policy lies above it)."""
    import matplotlib.pyplot as plt

    figure, axes = _figure(arms)
    optima = {}
    for index, arm in enumerate(arms):
        kl, reward, kl_sd, reward_sd, optimum = exact_final(arm)
        if math.isnan(kl):
            continue
        style = arm_style(index)
        axes.errorbar(kl, reward, xerr=kl_sd, yerr=reward_sd, fmt=style["marker"], color=style["color"],
                      capsize=3, markersize=6, label=arm.name)
        if optimum is not None:
            optima[optimum[0]] = optimum
    points = sorted(optima.values(), key=lambda point: point[1])
    if len(points) > 1:
        axes.plot([p[1] for p in points], [p[2] for p in points], color="black", marker="*", markersize=10,
                  linewidth=1.0, alpha=0.7, zorder=0, label="π* at each β (the optimum's front)")
    elif points:
        beta, kl_star, reward_star = points[0]
        axes.plot([kl_star], [reward_star], color="black", marker="*", markersize=12, linestyle="none",
                  label=f"π* (β = {beta:g})")
        if not math.isnan(beta):
            (low, high), (bottom, top) = axes.get_xlim(), axes.get_ylim()
            xs = np.linspace(max(low, 0.0), high, 50)
            axes.plot(xs, reward_star + beta * (xs - kl_star), color="black", linewidth=1.0, linestyle="--",
                      alpha=0.6, zorder=0, label="J = J*: R − β·KL at the optimum")
            axes.set_xlim(low, high)  # the arms' and the optimum's range, not the line's
            axes.set_ylim(bottom, top)
    axes.set_xlabel("exact KL per sequence, KL(π‖π_ref)")
    axes.set_ylabel("expected reward E_π[R] (exact)")
    axes.set_title("reward vs KL of the final policy, exact (bars: ± 1 sd over seeds), against the optimum",
                   fontsize="medium")
    axes.grid(alpha=0.3)
    _legend_outside(figure, axes, len(arms) + 2)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return []


def plot_frontier(arms: list[Any], path: Path, options: PlotOptions) -> list[int]:
    """Reward vs exact KL per arm (last-k means, ± sd over seeds), the Pareto front drawn; returns the front. On the
    exact task (every arm logs its exact metrics): :func:`plot_exact_frontier` instead."""
    import matplotlib.pyplot as plt

    if all(_logged([arm], "train", *EXACT_FRONTIER) for arm in arms):
        return plot_exact_frontier(arms, path)
    figure, axes = _figure(arms)
    points, k_used = [], 0
    split = frontier_split(arms)
    for index, arm in enumerate(arms):
        kl, reward, kl_sd, reward_sd, k_used = last_k_point(arm, options.last_k if split == "train" else 1, split)
        points.append((kl, reward))
        if math.isnan(kl):
            continue
        style = arm_style(index)
        axes.errorbar(kl, reward, xerr=kl_sd, yerr=reward_sd, fmt=style["marker"], color=style["color"],
                      capsize=3, markersize=6, label=arm.name)
    front = pareto_front(points)
    if front:
        axes.plot([points[i][0] for i in front], [points[i][1] for i in front], color="black", linewidth=1.0,
                  linestyle="-", alpha=0.6, zorder=0, label="Pareto front (less KL, more reward)")
    axes.set_xlabel("exact KL per token, KL(π‖π_ref)")
    axes.set_ylabel("reward (mean)")
    where = f"mean of the last {k_used} training steps" if split == "train" else "final evaluation (held-out prompts)"
    axes.set_title(f"reward vs KL: {where} per seed, then over seeds (bars: ± 1 sd over seeds)", fontsize="medium")
    axes.grid(alpha=0.3)
    _legend_outside(figure, axes, len(arms) + 1)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return front


PLOT_FILES = ("reward_vs_step.png", "kl_exact_vs_step.png", "reward_vs_kl.png", "eval_reward_vs_step.png",
              "kl_estimate_vs_exact.png")


def _logged(arms: list[Any], split: str, *keys: str) -> bool:
    """Whether some job has a ``split`` line (``train`` or ``eval``) with every one of ``keys``."""
    return any(all(key in line for key in keys) for arm in arms for job in arm.jobs for line in getattr(job, split))


def write_all(arms: list[Any], out: Path, options: PlotOptions | None = None) -> tuple[list[Path], list[str]]:
    """The plots of :data:`PLOT_FILES` that have data, into ``out``: their paths, and for each plot left out (it
    would be an empty figure) one line saying which and why."""
    import matplotlib

    matplotlib.use("Agg")
    options = options or PlotOptions()
    paths = dict(zip(PLOT_FILES, (Path(out) / name for name in PLOT_FILES), strict=True))
    frontier = ("train", "reward/mean", "kl/exact") if frontier_split(arms) == "train" else (
        "eval", "eval/reward/mean", "eval/kl/exact")
    plots = {
        "reward_vs_step.png": (("train", "reward/mean"), lambda path: plot_curves(
            arms, "reward/mean", "reward (mean over the step's samples)", path, options)),
        "kl_exact_vs_step.png": (("train", "kl/exact"), lambda path: plot_curves(
            arms, "kl/exact", "exact KL per token", path, options)),
        "reward_vs_kl.png": (frontier, lambda path: plot_frontier(arms, path, options)),
        "eval_reward_vs_step.png": (("eval", "eval/reward/mean"), lambda path: plot_curves(
            arms, "eval/reward/mean", "evaluation reward (held-out prompts)", path, options, split="eval")),
        "kl_estimate_vs_exact.png": (("train", "kl/estimate", "kl/exact"), lambda path: plot_kl_estimate_vs_exact(
            arms, path, options)),
    }
    written, skipped = [], []
    for name, ((split, *keys), draw) in plots.items():
        if _logged(arms, split, *keys):
            draw(paths[name])
            written.append(paths[name])
        else:
            lines = "training" if split == "train" else "evaluation"
            skipped.append(f"{name}: no job has {' and '.join(keys)} in its {lines} lines")
    return written, skipped
