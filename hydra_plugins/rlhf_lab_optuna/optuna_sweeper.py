"""The sweeper class Hydra instantiates for ``hydra/sweeper=optuna`` and its structured config.

Keys (``hydra.sweeper.*``), as hydra-optuna-sweeper names them:

- ``params``: the search space, ``key: <override value>``; ``choice(a,b)`` or ``a,b`` (categorical),
  ``interval(lo,hi)`` (uniform float), ``tag(log,interval(lo,hi))`` (log-uniform), ``tag(int,interval(lo,hi))``
  (integers, ``tag(int,log,...)`` too), ``range(start,stop[,step])`` (integers, ``stop`` excluded as in Hydra;
  float steps become a categorical), a plain value (fixed). Sweep overrides on the command line
  (``'trainer.lr=tag(log,interval(1e-5,1e-3))'``) join the space the same way.
- ``sampler``: instantiated with Hydra (default ``optuna.samplers.TPESampler``; set ``sampler.seed`` to repeat a
  search). A study that already has N trials gets ``seed + N``, so resuming does not repeat the first trials' values.
- ``direction``: ``maximize`` | ``minimize``; ``storage``: an Optuna storage URL (``sqlite:///study.db``) so a
  study resumes; ``study_name``; ``n_trials``: trials this invocation adds; ``n_jobs``: trials launched at once
  (one launcher batch; the launcher decides how they run); ``max_failure_rate``: failed trials per batch
  tolerated before the sweep stops.

The task function must return the objective as a float. At the end the best trial is printed and written to
``<sweep dir>/optimization_results.yaml`` (``best_params``, ``best_value``, ``best_trial``, every trial).
"""

# No `from __future__ import annotations` here: Hydra executes plugin modules outside sys.modules, where
# dataclasses cannot resolve string annotations.
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.rlhf_lab_optuna.optuna_sweeper.OptunaSweeper"
    _recursive_: bool = False  # the sampler is built per sweep (its seed moves on when a study resumes)
    sampler: dict[str, Any] = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None})
    direction: str = "maximize"
    storage: str | None = None
    study_name: str | None = None
    n_trials: int = 20
    n_jobs: int = 1
    max_failure_rate: float = 0.0
    params: dict[str, Any] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="rlhf_lab_optuna", node=OptunaSweeperConf,
                             provider="rlhf_lab")


class OptunaSweeper(Sweeper):
    """Hydra's side of the sweep; the Optuna loop lives in :class:`._search.OptunaSearch`."""

    def __init__(self, **settings: Any) -> None:
        from hydra_plugins.rlhf_lab_optuna._search import OptunaSearch

        self.search = OptunaSearch(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.search.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self.search.sweep(arguments)
