"""A W&B sweep file from a Hydra sweep: ``rlhf-lab wandb sweep [OPTIONS] OVERRIDES`` (then ``wandb sweep FILE`` and
``wandb agent ID``).

The search space is what ``rlhf-lab -m OVERRIDES`` would sweep: the experiment's ``hydra.sweeper.params`` (the
basic sweeper's lists or Optuna's search space) and the command line's sweeps, parsed by Hydra's own override
parser. Each key becomes one W&B parameter named as Hydra spells it (``kl.placement``, ``+kl_arm``):

- ``a,b,c``, ``choice(...)``, ``range(...)``, ``glob(...)``  -> ``values: [...]``;
- ``interval(lo, hi)`` -> ``min``/``max``: ``log_uniform_values`` under ``tag(log, ...)``, ``int_uniform``
  under ``tag(int, ...)`` (as Hydra's Optuna sweeper reads the tags), else ``uniform``;
- a single value (``model=tiny``) -> ``value: ...``.

The agent runs ``rlhf-lab hydra.mode=RUN key=value ...`` (``${args_no_hyphens}``): one plain run per W&B run, in
its own run folder, whose W&B run is the agent's (:func:`rlhf_lab.trackers.wandb_run.run_id`). The method is
``grid`` when every parameter is a list, else ``bayes``; the metric is the config's ``optimized_metric`` (else
``exact/gap`` on the exact task, ``eval/reward/mean`` elsewhere), minimised when it is a gap, a loss or a KL.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlhf_lab.errors import ToolError

METHODS = ("grid", "random", "bayes")
GOALS = ("minimize", "maximize")
COMMAND = ["${env}", "rlhf-lab", "hydra.mode=RUN", "${args_no_hyphens}"]
MINIMIZED = ("gap", "loss", "kl")  # metric names containing these are minimised by default


def _plain(value: Any) -> Any:
    """A Hydra-parsed value as YAML writes it (floats short, containers plain)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return value


def parameter(override: Any) -> dict[str, Any]:
    """One W&B sweep parameter from one parsed Hydra override (see the module docstring)."""
    from hydra.core.override_parser.types import IntervalSweep

    if not override.is_sweep_override():
        return {"value": _plain(override.value())}
    sweep = override.value()
    if isinstance(sweep, IntervalSweep):
        from rlhf_lab.config.validate_sweep import check_interval

        start, end = sweep.start, sweep.end
        check_interval(override.key_or_group, start, end)
        if "log" in sweep.tags:
            return {"distribution": "log_uniform_values", "min": _plain(float(start)), "max": _plain(float(end))}
        if "int" in sweep.tags:
            return {"distribution": "int_uniform", "min": int(start), "max": int(end)}
        return {"distribution": "uniform", "min": _plain(float(start)), "max": _plain(float(end))}
    return {"values": [_plain(value) for value in override.sweep_iterator()]}


def search_space(overrides: list[str]) -> tuple[dict[str, dict[str, Any]], Any]:
    """(W&B parameters, (the first job's config, Hydra's config)) of ``rlhf-lab -m OVERRIDES``; a bad override is
    one line. An ``interval`` on the command line is checked at its low end (the key exists, the type fits)."""
    from rlhf_lab.config.compose import CONF_DIR, _hydra_compose, check_overrides, compose, normalize_overrides
    from rlhf_lab.config.sweep_jobs import expand_globs, is_interval, parse_overrides, search_paths

    overrides = normalize_overrides(list(overrides))
    paths = search_paths(overrides)
    overrides = expand_globs(overrides, CONF_DIR, paths)
    checked = [low_end(o, paths) if is_interval(o) else o for o in overrides]
    # Every job checked as the CLI would, with its one-line errors; an Optuna study of the same name (another search's
    # database under outputs/) is no concern of a W&B sweep: not opened.
    cfg = compose(checked, study=False)
    hydra_cfg = _hydra_compose(check_overrides(checked), return_hydra_config=True)
    params = OmegaConf.select(hydra_cfg, "hydra.sweeper.params")
    params = OmegaConf.to_container(params, resolve=False) if params is not None else {}
    lines = {str(key): f"{key}={value}" for key, value in params.items()}
    given: dict[str, str] = {}
    for override in overrides:  # the command line's value for a key replaces the experiment's, in its place
        if "=" in override and not override.startswith(("hydra.", "hydra/", "+hydra")):
            key = override.partition("=")[0].lstrip("+~")
            if key in given:  # one would silently drop the other
                raise ToolError(f"{key} is given twice ({given[key]!r} and {override!r}); keep one")
            given[key] = lines[key] = override
    space = {}
    for override in parse_overrides(list(lines.values()), str(CONF_DIR), paths):
        prefix = "+" if override.input_line.startswith("+") and not override.input_line.startswith("++") else ""
        space[prefix + override.key_or_group] = parameter(override)
    return space, (cfg, hydra_cfg)


def low_end(line: str, paths: tuple[str, ...] = ()) -> str:
    """``key=interval(lo, hi)`` -> ``key=lo`` (an integer under ``tag(int, ...)``), to check the key and its type."""
    from rlhf_lab.config.compose import CONF_DIR
    from rlhf_lab.config.sweep_jobs import parse_overrides

    (override,) = parse_overrides([line], str(CONF_DIR), paths)
    sweep = override.value()
    start = int(sweep.start) if "int" in sweep.tags else sweep.start
    return f"{line.partition('=')[0]}={start}"


def default_metric(cfg: Any, hydra_cfg: Any) -> tuple[str, str]:
    """The metric a sweep ranks by and its goal: ``optimized_metric`` (Optuna's direction if set), else the exact
    task's gap or the evaluation reward."""
    metric = cfg.get("optimized_metric") or ("exact/gap" if cfg.model.name == "exact" else "eval/reward/mean")
    direction = OmegaConf.select(hydra_cfg, "hydra.sweeper.direction", default=None)
    return metric, direction if isinstance(direction, str) and direction in GOALS else goal_of(metric)


def goal_of(metric: str) -> str:
    """``minimize`` for a gap, a loss or a KL, else ``maximize``."""
    return "minimize" if any(word in metric for word in MINIMIZED) else "maximize"


def sweep_config(overrides: list[str], method: str | None = None, metric: str | None = None,
                 goal: str | None = None, name: str | None = None) -> dict[str, Any]:
    """The W&B sweep configuration of ``rlhf-lab -m OVERRIDES`` (what ``wandb sweep FILE`` reads)."""
    if method is not None and method not in METHODS:
        raise ToolError(f"--method {method!r} is not valid; choose from: {', '.join(METHODS)}")
    if goal is not None and goal not in GOALS:
        raise ToolError(f"--goal {goal!r} is not valid; choose from: {', '.join(GOALS)}")
    space, (cfg, hydra_cfg) = search_space(overrides)
    default_name, default_goal = default_metric(cfg, hydra_cfg)
    sampled = any("distribution" in spec for spec in space.values())
    method = method or ("bayes" if sampled else "grid")
    if method == "grid" and sampled:
        keys = ", ".join(key for key, spec in space.items() if "distribution" in spec)
        raise ToolError(f"--method grid cannot enumerate the intervals of {keys}; use --method random or bayes")
    metric_name = metric or default_name
    return {
        "name": name or str(cfg.experiment_name),
        "method": method,
        "metric": {"name": metric_name, "goal": goal or (default_goal if metric is None else goal_of(metric))},
        "parameters": space,
        "command": list(COMMAND),
    }


def main(args: list[str]) -> None:
    import yaml

    parser = argparse.ArgumentParser(
        prog="rlhf-lab wandb sweep",
        description="Write a W&B sweep file for the sweep `rlhf-lab -m OVERRIDES` would run; then run "
                    "`wandb sweep FILE` and `wandb agent ID`. Each agent run is one plain rlhf-lab run.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, sweeps included (experiment=kl_ablation, "
                                                     "algorithm=grpo,rloo, 'kl.coef=interval(0.01,1)')")
    parser.add_argument("--out", type=Path, default=Path("sweep.yaml"), help="the file to write (sweep.yaml)")
    parser.add_argument("--method", help=f"{' | '.join(METHODS)} (default: grid, bayes with an interval)")
    parser.add_argument("--metric", help="the summary key to rank by (default: optimized_metric, else exact/gap "
                                         "or eval/reward/mean)")
    parser.add_argument("--goal", help=" | ".join(GOALS))
    parser.add_argument("--name", help="the sweep's name (default: experiment_name)")
    options = parser.parse_args(args)
    check_out(options.out, "sweep.yaml")
    config = sweep_config(options.overrides, options.method, options.metric, options.goal, options.name)
    write_out(options.out, yaml.safe_dump(config, sort_keys=False))
    count = 1
    for spec in config["parameters"].values():
        count *= len(spec.get("values", [1]))
    runs = f"{count} runs" if config["method"] == "grid" else "sampled runs"
    print(f"wrote {options.out} ({config['method']}, {runs}, ranked by {config['metric']['name']} "
          f"{config['metric']['goal']}); start it with: wandb sweep {options.out}")


def write_out(out: Path, text: str) -> None:
    """``text`` into ``out`` (its folder made if missing); a place that cannot be written is one line."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    except OSError as error:
        raise ToolError(f"--out {str(out)!r} cannot be written ({error.strerror or type(error).__name__}); give a "
                        "path you can write") from None


def check_out(out: Path, example: str) -> None:
    """``--out`` names a file to write: not a folder, and inside a folder (made if missing), not under a file."""
    if out.is_dir():
        raise ToolError(f"--out {str(out)!r} is a folder; give a file name such as {example}")
    parent = next((folder for folder in out.parents if folder.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ToolError(f"--out {str(out)!r}: {str(parent)!r} is a file, not a folder; give a path in a folder")
