"""The Optuna part of ``rlhf-lab report``: a search folder's ``optimization_results.yaml`` as markdown lines.

``hydra/sweeper=optuna`` (hydra_plugins/rlhf_lab_optuna) writes that file into the sweep folder: the best trial
(number, value, parameters, folder) and every trial. The report puts the best trial first, then every trial by
objective value (best first for ``direction: maximize``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OPTUNA_RESULTS = "optimization_results.yaml"


def _params_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                     for key, value in params.items())


def optuna_section(folder: Path) -> list[str]:
    """Markdown lines for an Optuna search's results (best trial first, then every trial), or [] if none."""
    path = Path(folder) / OPTUNA_RESULTS
    if not path.is_file():
        return []
    import yaml

    try:
        results = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        return [f"(could not read {path.name}: {error})", ""]
    direction = results.get("direction", "maximize")
    lines = [
        "## Optuna search",
        "",
        f"Study `{results.get('study_name')}` ({results.get('storage') or 'in memory'}), {direction}, "
        f"{results.get('n_complete', 0)} of {results.get('n_trials', 0)} trials complete.",
    ]
    if "best_value" in results:
        lines.append(f"**Best trial {results.get('best_trial')}: value {results['best_value']:.6g}** with "
                     f"{_params_text(results.get('best_params') or {})} ({results.get('best_job_dir')})")
    trials = [t for t in results.get("trials") or [] if isinstance(t, dict)]
    done = sorted((t for t in trials if t.get("value") is not None), key=lambda t: t["value"],
                  reverse=direction == "maximize")
    rows = done + [t for t in trials if t.get("value") is None]
    if rows:
        lines += ["", "| trial | state | value | parameters |", "| ---: | --- | ---: | --- |"]
        for trial in rows:
            value = "" if trial.get("value") is None else f"{trial['value']:.6g}"
            lines.append(f"| {trial.get('number')} | {trial.get('state')} | {value} | "
                         f"{_params_text(trial.get('params') or {})} |")
    return [*lines, ""]
