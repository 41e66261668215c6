"""A sweep's jobs that cannot fit, refused before the first one starts.

The memory check (:mod:`rlhf_lab.training.memory_check`) runs when a job starts, so a sweep whose seventh job
cannot fit would fail after six had run. ``rlhf-lab`` passes :func:`held_state_check` to
:func:`rlhf_lab.config.compose.compose`, which calls it on each job's composed config where the jobs run on this machine
(Hydra's basic launcher, the default, and joblib's local workers; Ray's and SLURM's jobs run on other machines, with
their own memory), and :func:`~rlhf_lab.config.sweep_jobs.check_jobs` names the job it refuses.
The refusal is the memory check's own quick one (:func:`~rlhf_lab.training.memory_check.refuse_held`: weights,
gradients, optimizer state and reference alone over the memory available), with the options the job's trainer
passes (``Trainer.memory_options``).

Cheap by construction: the model's size from this machine's files (its config on the meta device: no weights read,
nothing downloaded; a model only a download could size is skipped), ``trainer.precision=auto`` taken as the
precision that holds less (bf16-mixed: its reference in bfloat16) rather than measured, so no job is refused that
its run would start. Nothing is checked with ``trainer.skip_memory_check=true`` or where the memory available
cannot be read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_lab.errors import ConfigError


def held_state_check() -> Callable[[DictConfig], None]:
    """:func:`refuse_held_state` for the jobs of one sweep, their model sizes shared."""
    sizes: dict[str, Any] = {}
    return lambda cfg: refuse_held_state(cfg, sizes)


def held_precision(trainer_cfg: Any, device: Any) -> Any:
    """The run's precision without measuring anything: ``auto`` (measured on a CPU when the run starts) as bf16-mixed,
    whose held state is the smaller (float32 weights either way, the reference in bfloat16)."""
    from rlhf_lab.runtime.precision import Precision

    if trainer_cfg.precision == "auto" and trainer_cfg.get("dtype") is None:
        return Precision("bf16-mixed", device.type)
    return Precision.from_config(trainer_cfg, device, warn=False)


def refuse_held_state(cfg: DictConfig, sizes: dict[str, Any]) -> None:
    """The memory check's quick refusal, in its words, of a job whose held state is over the memory available here;
    ``sizes``: model sizes by model config, filled as jobs are checked."""
    import torch

    from rlhf_lab.models.loading import DTYPES
    from rlhf_lab.runtime import distributed
    from rlhf_lab.training import memory_check
    from rlhf_lab.training.launch import trainer_class
    from rlhf_lab.training.setup import resolve_device

    if cfg.trainer.get("skip_memory_check"):
        return
    try:
        device = resolve_device(cfg.trainer.device)
        processes = distributed.launched_processes()
        strategy = distributed.resolve_strategy(cfg.trainer.strategy, processes)
        precision = held_precision(cfg.trainer, device)
    except (ConfigError, RuntimeError):  # the run says why when it starts
        return
    if device.type == "cuda" and not torch.cuda.is_available():
        return
    key = OmegaConf.to_yaml(cfg.model)
    if key not in sizes:
        sizes[key] = memory_check.local_model_size(cfg.model)
    available = None if sizes[key] is None else memory_check.available_memory(device)
    if available is None:
        return
    options = trainer_class(cfg.algorithm.name).memory_options(cfg, precision, strategy, processes)
    estimate, rows = memory_check.run_estimate(cfg, sizes[key], DTYPES[precision.weights_dtype],
                                               precision.compute_dtype, device, **options)
    memory_check.refuse_held(cfg, estimate, rows, available, device)
