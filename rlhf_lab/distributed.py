"""The few places a multi-process run differs from one process (``torchrun``, torch.distributed).

Single-process runs see rank 0 of 1 and every function here is a no-op. Prompts are sharded by rank in
``data.prompt_indices``; metrics are averaged across ranks before logging; only rank 0 logs and writes.

Gradients are not yet synchronised across processes, so N processes would train N different models:
:func:`refuse_multi_process` stops such a launch at start until multi-process training exists.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rlhf_lab.errors import ConfigError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return rank() == 0


def mean_across_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Average numeric metrics over ranks (identity in a single process)."""
    if not is_distributed():
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, int | float))
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    averaged = dict(metrics)
    averaged.update({k: (v / world_size()).item() for k, v in zip(keys, values)})
    return averaged


def launched_processes() -> int:
    """How many processes the launcher started (``WORLD_SIZE`` from torchrun / accelerate), 1 otherwise."""
    if is_distributed():
        return world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def refuse_multi_process() -> None:
    """A one-line error for a launch of more than one process: training does not synchronise gradients yet."""
    processes = launched_processes()
    if processes > 1:
        raise ConfigError(
            f"launched as {processes} processes (WORLD_SIZE={processes}), but rlhf_lab trains in one process "
            "only for now: gradients are not synchronised across ranks; run without torchrun / accelerate launch"
        )
