"""The sharded part of an FSDP run's checkpoint: ``step_N/sharded/``, through ``torch.distributed.checkpoint``.

Every rank writes the part of the policy, of the algorithm's modules and of the optimizer it holds, and on resume
reads back its own part, however the state is sharded now (another process count, or one process): no rank holds,
or reads, the whole state. :mod:`rlhf_lab.training.checkpoint` stages the folder, seals it and renames it into place.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

SHARDED_FOLDER = "sharded"


def _container(policy: nn.Module, modules: dict[str, nn.Module]) -> nn.Module:
    """The policy and the algorithm's modules under one root, so their keys are the same in every strategy."""
    return nn.ModuleDict({"policy": policy, **modules})


def save_sharded(folder: Path, policy: nn.Module, modules: dict[str, nn.Module],
                 optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its part of the model and optimizer states into ``folder/sharded`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(_container(policy, modules), optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(Path(folder) / SHARDED_FOLDER))


def load_sharded(folder: Path, policy: nn.Module, modules: dict[str, nn.Module],
                 optimizer: torch.optim.Optimizer) -> None:
    """Each rank reads its part of ``folder/sharded`` into the live (sharded or whole) model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    container = _container(policy, modules)
    model_state, optimizer_state = get_state_dict(container, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(Path(folder) / SHARDED_FOLDER))
    set_state_dict(container, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
