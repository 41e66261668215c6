"""The number a run returns to a hyperparameter search (``hydra/sweeper=optuna``), read from its summary.

``optimized_metric`` (top-level, default null) names a ``summary.json`` key, e.g. ``eval/reward/mean`` (the final
evaluation's mean reward). With ``kl_budget`` set, the objective is that value minus
``kl_budget_penalty × max(0, eval/kl/exact − kl_budget)``: the exact per-token KL(π‖π_ref) of the final
evaluation costs nothing inside the budget and ``kl_budget_penalty`` per nat above it, so a search maximizing it
finds the most reward at that KL. With ``optimized_metric`` null the run returns its whole summary (no search).
"""

from __future__ import annotations

import math
from typing import Any

from rlhf_lab.errors import ConfigError

KL_METRIC = "eval/kl/exact"


def check_objective(cfg: Any) -> None:
    """Validate the objective keys at start (one line each)."""
    metric, budget = cfg.get("optimized_metric"), cfg.get("kl_budget")
    if metric is not None and not str(metric).strip():
        raise ConfigError("optimized_metric='' names no summary key; use e.g. optimized_metric=eval/reward/mean")
    if budget is not None and metric is None:
        raise ConfigError(f"kl_budget={budget} needs optimized_metric (e.g. optimized_metric=eval/reward/mean)")
    if budget is not None and not budget >= 0:
        raise ConfigError(f"kl_budget={budget} must be >= 0 (nats per token of {KL_METRIC})")
    penalty = cfg.get("kl_budget_penalty", 0.0)
    if not (penalty >= 0 and math.isfinite(penalty)):
        raise ConfigError(f"kl_budget_penalty={penalty} must be a finite number >= 0")


def objective(summary: dict[str, Any], cfg: Any) -> float:
    """The summary's ``optimized_metric``, less the KL-budget penalty; ConfigError naming the keys if absent."""
    metric, budget = str(cfg.optimized_metric), cfg.get("kl_budget")
    needed = [metric] + ([KL_METRIC] if budget is not None else [])
    for key in needed:
        if key not in summary:
            numeric = sorted(k for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool))
            raise ConfigError(f"optimized_metric: {key!r} is not in this run's summary.json; numeric keys: "
                              f"{', '.join(numeric)}")
    value = float(summary[metric])
    if budget is not None:
        value -= float(cfg.kl_budget_penalty) * max(0.0, float(summary[KL_METRIC]) - float(budget))
    return value
