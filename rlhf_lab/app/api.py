"""The Python API: compose a run's config and train it from a notebook or a script, as the CLI does.

    import rlhf_lab
    cfg = rlhf_lab.compose(["model=tiny", "trainer.steps=2"])     # the validated config a job gets
    summary = rlhf_lab.train(["model=tiny", "trainer.steps=2"])     # trains; returns summary.json's content
    summary = rlhf_lab.train(cfg, run_dir="outputs/notebook/run1")  # a (possibly edited) composed config

Overrides are the command line's (``group=option``, ``key=value``, ``hydra.searchpath=[pkg://my_pkg.conf]``,
``plugins=[my_pkg]``); one job only (a sweep is ``rlhf-lab -m``). The run folder gets ``.hydra/config.yaml`` and
``.hydra/overrides.yaml`` like a CLI run, so ``rlhf-lab report`` and ``rlhf-lab eval`` read it.
"""

from __future__ import annotations

import time
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


def train(overrides: list[str] | tuple[str, ...] | DictConfig = (), run_dir: str | Path | None = None) -> dict[str, Any]:
    """Train one run and return its summary. ``overrides``: command-line overrides, or a composed config.

    ``run_dir``: the run folder; default ``trainer.output_dir`` (or the folder of a resumed checkpoint), else
    ``outputs/<experiment_name>/<time>`` under the working folder, as the CLI would choose.
    """
    from rlhf_lab.app.cli import run_folder
    from rlhf_lab.config import validate
    from rlhf_lab.training import run

    if isinstance(overrides, DictConfig):
        cfg, lines = overrides, []
        validate(cfg)
    else:
        lines = list(overrides)
        _single_job(lines)
        cfg = compose(lines)
    folder = Path(run_dir) if run_dir is not None else run_folder(cfg)
    if folder is None:
        folder = Path("outputs") / str(cfg.experiment_name) / time.strftime("%Y-%m-%d_%H-%M-%S")
    hydra_dir = folder / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    (hydra_dir / "overrides.yaml").write_text("".join(f"- {line}\n" for line in lines) or "[]\n", encoding="utf-8")
    return run(cfg, folder)
