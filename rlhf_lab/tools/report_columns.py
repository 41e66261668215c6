"""The report's per-job columns (``rlhf-lab report``): what a table cell, a plot and an experiment's claim
(:mod:`rlhf_lab.tools.claims`) may name. A leaf: the config's claim check reads it before any job starts."""

from __future__ import annotations

from rlhf_lab.tools.report_exact import EXACT_METRICS, LENGTH_METRICS, MODE_METRICS

# (column, markdown header); eval_reward is added only when some job has eval lines.
METRICS = (
    ("final_reward", "final reward"),
    ("best_reward", "best reward"),
    ("final_kl_exact", "final KL (exact, per token)"),
    ("kl_estimate_minus_exact", "KL est − exact (per token)"),
    ("step_time_s", "s/step"),
    ("eval_reward", "eval reward"),
    ("eval_kl_exact", "eval KL (exact, per token)"),
    *((column, header) for column, header, _ in EXACT_METRICS),
    ("diverged", "diverged"),  # share of seeds that ended further from π* than they started
    *((column, header) for column, header, _ in MODE_METRICS),
    *((column, header) for column, header, _ in LENGTH_METRICS),
)
COLUMNS = tuple(column for column, _ in METRICS)
