"""The few places a multi-process run differs from one process (``torchrun``, torch.distributed).

Single-process runs see rank 0 of 1 and every function here is a no-op. Prompts are sharded by rank in
``data.prompt_indices``; metrics are averaged across ranks before logging; only rank 0 logs and writes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
