"""The Python API: compose a run's config and train it from a notebook or a script, as the CLI does.

    import rlhf_lab
    cfg = rlhf_lab.compose(["model=tiny", "trainer.steps=2"])     # the validated config a job gets
    summary = rlhf_lab.train(["model=tiny", "trainer.steps=2"])     # trains; returns summary.json's content
    summary = rlhf_lab.train(cfg, run_dir="outputs/notebook/run1")  # a (possibly edited) composed config

As TRL's trainers take them, a reward function (or a list) and ``datasets.Dataset`` splits go beside the overrides:

    from datasets import Dataset
    def brevity(prompts, responses, **columns):                      # one float per response
        return [-len(r) / 100 for r in responses]
    rows = Dataset.from_list([{"prompt": "Say hi."}, {"prompt": "Name a colour."}])
    summary = rlhf_lab.train(["model=tiny", "trainer.steps=2"], reward_funcs=brevity, train_dataset=rows)

They become overrides the run folder records (:mod:`rlhf_lab.app.api_inputs`): ``reward=python`` (``composite`` for
several), ``data=local`` over the datasets saved in ``RUN/data``.

Overrides are the command line's (``group=option``, ``key=value``, ``hydra.searchpath=[pkg://my_pkg.conf]``,
``plugins=[my_pkg]``); one job only (a sweep is ``rlhf-lab -m``). The run folder gets ``.hydra/config.yaml`` and
``.hydra/overrides.yaml`` like a CLI run, so ``rlhf-lab report`` and ``rlhf-lab eval`` read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_lab.errors import ConfigError


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The validated config of one job (:func:`rlhf_lab.config.compose.compose`); one-line ``ConfigError``."""
    from rlhf_lab.config.compose import compose as compose_config

    return compose_config(list(overrides))


def _single_job(overrides: list[str]) -> None:
    from rlhf_lab.config.validate_sweep import sweep_values

    for override in overrides:
        if "=" in override and not override.startswith(("hydra.", "+hydra.")) and sweep_values(override):
            raise ConfigError(f"{override} is a sweep; rlhf_lab.train runs one job (sweep with: rlhf-lab -m ...)")


def train(overrides: list[str] | tuple[str, ...] | DictConfig = (), run_dir: str | Path | None = None, *,
          reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None, train_dataset: Any = None,
          eval_dataset: Any = None) -> dict[str, Any]:
    """Train one run and return its summary. ``overrides``: command-line overrides, or a composed config.

    ``run_dir``: the run folder; default ``trainer.output_dir`` (or the folder of a resumed checkpoint), else
    ``outputs/<experiment_name>/<time>`` under the working folder, as the CLI would choose. ``reward_funcs``: a
    function ``fn(prompts, responses, **columns) -> floats`` or a list of them (summed); ``train_dataset`` /
    ``eval_dataset``: ``datasets.Dataset`` splits with a ``prompt`` or ``messages`` column (see the module).
    """
    from rlhf_lab.app.api_inputs import data_overrides, reward_overrides
    from rlhf_lab.app.cli import run_folder
    from rlhf_lab.config import validate
    from rlhf_lab.training import run

    given = reward_funcs is not None or train_dataset is not None or eval_dataset is not None
    if isinstance(overrides, DictConfig):
        if given:
            raise ConfigError("reward_funcs, train_dataset and eval_dataset go with overrides (a list), not a composed "
                              "config")
        cfg, lines = overrides, []
        validate(cfg)
    else:
        if eval_dataset is not None and train_dataset is None:
            raise ConfigError("eval_dataset needs a train_dataset")
        lines = list(overrides) + (reward_overrides(reward_funcs) if reward_funcs is not None else [])
        _single_job(lines)
        cfg = compose(lines)
    folder = Path(run_dir) if run_dir is not None else run_folder(cfg)
    if folder is None:
        folder = Path("outputs") / str(cfg.experiment_name) / time.strftime("%Y-%m-%d_%H-%M-%S")
    if train_dataset is not None:  # saved in the run folder, then read as data=local
        lines += data_overrides(folder, train_dataset, eval_dataset)
        cfg = compose(lines)
    hydra_dir = folder / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    (hydra_dir / "overrides.yaml").write_text("".join(f"- {line}\n" for line in lines) or "[]\n", encoding="utf-8")
    return run(cfg, folder)
