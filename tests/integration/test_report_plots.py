"""Report plots at sweep scale: a synthetic 12-arm × 3-seed folder (the KL ablation's shape) renders with a distinct
colour × line style per arm, the legend outside the axes, labelled bands, the eval reward, the KL panel per arm
and the Pareto front of the last-k frontier."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import yaml

from rlhf_lab.tools import report, report_plots

ESTIMATORS = ("kl", "abs", "mse", "k3", "full", "none")
PLACEMENTS = ("reward", "loss")


def write_sweep(root: Path, steps: int = 10) -> Path:
    job = 0
    for a, estimator in enumerate(ESTIMATORS):
        for b, placement in enumerate(PLACEMENTS):
            for seed in range(3):
                folder = root / f"{job}_{estimator},placement={placement},seed={seed}"
                (folder / ".hydra").mkdir(parents=True)
                config = {"algorithm": {"name": "grpo"}, "kl": {"name": estimator, "placement": placement},
                          "trainer": {"steps": steps}, "seed": seed}
                (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
                rng = np.random.default_rng(job)
                lines = []
                for step in range(steps):
                    reward = 0.1 * (a + 1) * step / steps + 0.05 * b + 0.02 * rng.standard_normal()
                    exact = 0.01 * (a + 1) * (1 + b) * step / steps
                    lines.append({"step": step, "reward/mean": reward, "kl/exact": exact,
                                  "kl/estimate": exact * (1.2 if estimator == "abs" else 1.0), "time/step_s": 1.0})
                lines.append({"step": steps, "eval/reward/mean": 0.1 * a, "eval/kl/exact": 0.01})
                (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
                job += 1
    return root


@pytest.fixture
def figures(monkeypatch) -> dict[str, object]:
    """Every figure the report saves, by file name (kept open for inspection)."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    saved: dict[str, object] = {}
    original = Figure.savefig

    def keep(self, path, *args, **kwargs):
        self.canvas.draw()
        saved[Path(path).name] = self
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.setattr(plt, "close", lambda *args: None)
    return saved


def test_twelve_arms_three_seeds_have_distinct_styles_and_the_legend_outside(tmp_path: Path, figures) -> None:
    folder = write_sweep(tmp_path / "sweep")
    report.main([str(folder), "--ema", "0.5", "--band", "ci95", "--last-k", "3"])
    for name in report_plots.PLOT_FILES:
        assert (folder / name).read_bytes()[:4] == b"\x89PNG", name

    figure = figures["reward_vs_step.png"]
    (axes,) = figure.axes
    arm_lines = [line for line in axes.get_lines() if "(n=3)" in str(line.get_label())]
    assert len(arm_lines) == 12
    styles = {(line.get_color(), line.get_linestyle()) for line in arm_lines}
    assert len(styles) == 12  # colour × line style: no two arms look alike
    legend = axes.get_legend()
    renderer = figure.canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 >= axes.get_window_extent(renderer).x1  # outside, on the right
    assert "95% CI" in axes.get_title() and "EMA 0.5" in axes.get_title()

    assert "(n=3)" in str(figures["eval_reward_vs_step.png"].axes[0].get_lines()[0].get_label())
    panels = [a for a in figures["kl_estimate_vs_exact.png"].axes if a.get_lines()]
    assert len(panels) == 12 and all(len(a.get_lines()) == 2 for a in panels)

    frontier = figures["reward_vs_kl.png"].axes[0]
    assert "last 3 training steps" in frontier.get_title()
    front_lines = [line for line in frontier.get_lines() if str(line.get_label()).startswith("Pareto front")]
    assert len(front_lines) == 1 and len(front_lines[0].get_xdata()) >= 1


def test_pareto_front_and_styles_by_hand() -> None:
    points = [(0.1, 0.5), (0.2, 0.4), (0.3, 0.9), (math.nan, 1.0), (0.05, 0.2)]
    assert report_plots.pareto_front(points) == [4, 0, 2]  # (0.2, 0.4) is dominated by (0.1, 0.5)
    styles = {tuple(report_plots.arm_style(i).values()) for i in range(40)}
    assert len(styles) == 40
    np.testing.assert_allclose(report_plots.ema(np.array([0.0, 1.0, 1.0]), 0.5), [0.0, 0.5, 0.75])


def test_bad_plot_options_are_one_line(tmp_path: Path, capsys) -> None:
    folder = write_sweep(tmp_path / "sweep", steps=2)
    with pytest.raises(SystemExit) as stop:
        report.main([str(folder), "--ema", "1.5"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --ema 1.5 is out of range; must be in [0, 1)"


@pytest.mark.parametrize("arms", [12, 1])
def test_the_legend_clears_the_title_and_steps_are_whole_numbers(tmp_path: Path, figures, arms: int) -> None:
    folder = write_sweep(tmp_path / "sweep", steps=3)
    if arms == 1:  # one arm's jobs only: one row of panels, where a corner legend met the title
        for job in [p for p in folder.iterdir() if not p.name.startswith(("0_", "1_", "2_"))]:
            for path in sorted(job.rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
            job.rmdir()
    report.main([str(folder)])
    figure = figures["kl_estimate_vs_exact.png"]
    renderer = figure.canvas.get_renderer()
    title = figure._suptitle.get_window_extent(renderer)
    (legend,) = figure.legends
    box = legend.get_window_extent(renderer)
    assert not box.overlaps(title)
    panels = [a for a in figure.axes if a.get_lines()]
    assert len(panels) == arms
    for axes in panels:
        assert not box.overlaps(axes.get_window_extent(renderer))
    for name in ("kl_estimate_vs_exact.png", "reward_vs_step.png", "kl_exact_vs_step.png"):
        for axes in (a for a in figures[name].axes if a.get_lines()):
            ticks = [t for t in axes.get_xticks() if axes.get_xlim()[0] <= t <= axes.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (name, ticks)


def write_exact_sweep(root: Path, betas: tuple[float, ...]) -> Path:
    """Two arms × 2 seeds per β on the exact task: the exact metrics every step, π*'s per β."""
    job = 0
    for beta in betas:
        for arm in ("k1", "k3"):
            for seed in range(2):
                folder = root / f"{job}_kl={arm},coef={beta},seed={seed}"
                (folder / ".hydra").mkdir(parents=True)
                config = {"model": {"name": "exact"}, "kl": {"name": arm, "coef": beta}, "trainer": {"steps": 4},
                          "seed": seed}
                (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
                lines = [{"step": step, "reward/mean": 0.1 * step, "kl/exact": 0.01 * step,
                          "exact/kl_sequence": 0.05 * step + 0.01 * seed, "exact/reward": 0.1 * step + 0.02 * seed,
                          "exact/kl_optimal": 0.3 / beta, "exact/reward_optimal": 0.5 - 0.1 * beta}
                         for step in range(4)]
                (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
                job += 1
    return root


@pytest.mark.parametrize("betas", [(0.2,), (0.1, 0.2, 0.4)])
def test_the_exact_frontier_draws_the_optimum_not_a_pareto_front(tmp_path: Path, figures, betas) -> None:
    """On the exact task every arm is on some trade-off: the plot puts each arm's final exact point against π* (one
    β: its point and the line J = J*; several: π* at each β, joined), and draws no Pareto front among arms."""
    report.main([str(write_exact_sweep(tmp_path / "sweep", betas)), "--out", str(tmp_path / "out"), "--wandb", "off"])
    axes = figures["reward_vs_kl.png"].axes[0]
    labels = [line.get_label() for line in axes.get_lines()]
    assert not any("Pareto" in label for label in labels)
    assert axes.get_xlabel() == "exact KL per sequence, KL(π‖π_ref)"
    if len(betas) == 1:
        assert "π* (β = 0.2)" in labels and "J = J*: R − β·KL at the optimum" in labels
        line = next(line for line in axes.get_lines() if line.get_label().startswith("J = J*"))
        xs, ys = line.get_data()
        np.testing.assert_allclose(ys, (0.5 - 0.02) + 0.2 * (xs - 0.3 / 0.2))  # slope β through π*
    else:
        star = next(line for line in axes.get_lines() if line.get_label().startswith("π* at each β"))
        xs, ys = star.get_data()
        np.testing.assert_allclose(xs, sorted(0.3 / b for b in betas))  # π* per β, in order of KL
        np.testing.assert_allclose(ys, [0.5 - 0.1 * b for b in sorted(betas, reverse=True)])
