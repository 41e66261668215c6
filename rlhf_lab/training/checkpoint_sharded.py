"""The sharded part of an FSDP run's checkpoint: ``step_N/sharded/``, through ``torch.distributed.checkpoint``.

Every rank writes the part of the policy, of the algorithm's modules and of the optimizer it holds (DCP's
``__<rank>_<i>.distcp`` files, and rank 0 the ``.metadata`` index), hashes only the files it wrote, and on resume
reads back its own part, however the state is sharded now (another process count, or one process): no rank holds,
or reads, the whole state. :mod:`rlhf_lab.training.checkpoint` stages the folder, seals it and renames it into place.
A checkpoint without the whole weights (``model/``, written at the end of a run) becomes a Hugging Face folder in one
process with :func:`export_sharded` (``rlhf-lab export``, ``rlhf-lab eval``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhf_lab.training.checkpoint_find import MODEL_FOLDER

SHARDED_FOLDER = "sharded"
SHARD_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's file name: __<writing rank>_<index>.distcp
TOKENIZER_FOLDER = "tokenizer"  # beside sharded/ when a checkpoint has no model/ folder to hold it


def _container(policy: nn.Module, modules: dict[str, nn.Module]) -> nn.Module:
    """The policy and the algorithm's modules under one root, so their keys are the same in every strategy."""
    return nn.ModuleDict({"policy": policy, **modules})


def save_sharded(folder: Path, policy: nn.Module, modules: dict[str, nn.Module],
                 optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank writes its part of the model (and, given ``optimizer``, of its state) into ``folder/sharded``
    (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    container = _container(policy, modules)
    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(container)}
    else:
        model_state, optimizer_state = get_state_dict(container, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
    dcp.save(state, checkpoint_id=str(Path(folder) / SHARDED_FOLDER))


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


def shard_writer(relative: str) -> int | None:
    """The rank that wrote checkpoint file ``relative`` (``sharded/__<rank>_<i>.distcp``); None for any other file."""
    parts = relative.split("/")
    match = SHARD_FILE.match(parts[-1]) if len(parts) == 2 and parts[0] == SHARDED_FOLDER else None
    return int(match.group(1)) if match else None


def hashed_by(relative: str, rank: int, world_size: int) -> bool:
    """Whether rank ``rank`` of ``world_size`` checks the digest of checkpoint file ``relative``: a rank's shard files
    by the rank that reads them (its own, at the process count that wrote them; spread over the ranks at another),
    the end-of-run export (``model/``: the whole policy, which a resume from the shards does not read) by rank 0
    alone, every other file (small: indices, JSON, the scheduler, the generators) by every rank."""
    writer = shard_writer(relative)
    if writer is None:
        return rank == 0 or not relative.startswith(f"{MODEL_FOLDER}/")
    return writer % world_size == rank


def own_shard_digests(folder: Path, rank: int) -> dict[str, str]:
    """sha256 of the shard files rank ``rank`` wrote into ``folder/sharded`` (relative path -> hex digest)."""
    from rlhf_lab.training.verify import file_digest

    files = sorted((Path(folder) / SHARDED_FOLDER).iterdir())
    return {f"{SHARDED_FOLDER}/{path.name}": file_digest(path) for path in files
            if shard_writer(f"{SHARDED_FOLDER}/{path.name}") == rank}


def export_sharded(folder: Path, config: dict[str, Any], out: Path) -> Path:
    """The policy of an FSDP checkpoint ``folder`` that has no ``model/``, as ``save_pretrained`` writes it (with
    its tokenizer), into ``out``: the run's model built from its ``config`` (``config.json``) in the precision the
    run recorded, and its shards read in this one process (DCP without a process group). Returns ``out``."""
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from rlhf_lab.models.loading import apply_lora, load_causal_lm, load_tokenizer
    from rlhf_lab.runtime.precision import WEIGHT_DTYPES
    from rlhf_lab.training.checkpoint_find import read_state

    model_cfg = OmegaConf.create(config["model"])
    tokenizer = load_tokenizer(model_cfg)
    dtype = WEIGHT_DTYPES.get(str((read_state(folder) or {}).get("precision")), "float32")
    policy = load_causal_lm(model_cfg, tokenizer, dtype, int(config.get("seed", 0)))
    if model_cfg.lora.enabled:
        policy = apply_lora(policy, model_cfg.lora)
    state = {"model": {f"policy.{name}": tensor for name, tensor in policy.state_dict().items()}}
    with warnings.catch_warnings():  # DCP says it assumes one process: what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, checkpoint_id=str(Path(folder) / SHARDED_FOLDER), no_dist=True)
    policy.load_state_dict({name.removeprefix("policy."): tensor for name, tensor in state["model"].items()})
    policy.save_pretrained(out, safe_serialization=True)
    saved_tokenizer = Path(folder) / TOKENIZER_FOLDER
    (AutoTokenizer.from_pretrained(str(saved_tokenizer)) if saved_tokenizer.is_dir() else tokenizer).save_pretrained(out)
    return Path(out)
