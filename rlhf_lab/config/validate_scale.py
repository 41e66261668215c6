"""Scale-out settings: strategy against the launch, precision against the device, the batch against the ranks.

Checked before any model loads: ``trainer.strategy`` (``ddp`` needs a multi-process launch), the precision
(``fp16-mixed`` needs CUDA; the deprecated ``trainer.dtype`` maps onto it), and that the global batch splits
into whole prompt groups per rank, with mini-batches that split evenly across ranks.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlhf_lab.config.validate_values import at_least
from rlhf_lab.errors import ConfigError
from rlhf_lab.models.recompute import check_config as check_recompute
from rlhf_lab.runtime import distributed
from rlhf_lab.runtime.precision import check_device, resolve_precision


def planned_device(name: str) -> torch.device:
    """The device a run will use (``auto``: CUDA when available)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def check_launch_environment(environ: Any = None) -> None:
    """The launcher's variables must describe a launch: ``WORLD_SIZE`` above 1 needs the rank, the rendezvous
    address and the ``LOCAL_RANK`` a launcher sets with it (else torch.distributed traces back, or the process waits
    for peers that never come), and a ``RANK`` other than 0 needs a world of more than one process (else the process
    would act as a non-zero rank of nothing: no run lock, no files). torchrun's own launch is not second-guessed."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in environ:
        return
    given = " ".join(f"{key}={environ[key]}" for key in LAUNCH_VARIABLES if key in environ)
    fix = "unset them for one process, or launch with torchrun --nproc_per_node=N -m rlhf_lab"
    try:
        world, rank = int(environ.get("WORLD_SIZE", "1") or 1), int(environ.get("RANK", "0") or 0)
    except ValueError:
        raise ConfigError(f"{given}: the launcher's variables are not numbers; {fix}") from None
    if world > 1 and not ("RANK" in environ and "MASTER_ADDR" in environ):
        raise ConfigError(f"{given} names {world} processes, but no launcher started this one (RANK and "
                          f"MASTER_ADDR unset); {fix}")
    if world > 1 and "LOCAL_RANK" not in environ:
        raise ConfigError(f"{given} names {world} processes, but no launcher started this one (LOCAL_RANK unset: "
                          f"left over from another job?), and it would wait for the others at the rendezvous; {fix}")
    if rank != 0 and world <= 1:
        raise ConfigError(f"{given} makes this process rank {rank} of a single-process world; {fix}")


def check_budget(cfg: Any) -> None:
    """A token budget set below the longest row the config admits (``data.max_prompt_tokens`` +
    ``trainer.max_new_tokens``) is refused before anything loads: the run would stop at the first step that samples
    such a row (on one rank of several: the others left waiting)."""
    budget = cfg.trainer.get("max_tokens_per_micro_batch")
    prompt, response = cfg.get("data", {}).get("max_prompt_tokens"), cfg.trainer.get("max_new_tokens")
    if not budget or prompt is None or response is None:
        return
    longest = int(prompt) + int(response)
    if budget < longest:
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget} is smaller than the longest row a step may "
                          f"sample ({longest} tokens: data.max_prompt_tokens={prompt} + trainer.max_new_tokens="
                          f"{response}); raise it to at least {longest}, or set it to 0 (micro-batches by rows) or "
                          "null (the device's default)")


def check_scale(cfg: Any) -> None:
    check_launch_environment()
    trainer, algorithm = cfg.trainer, cfg.algorithm
    device = planned_device(trainer.device)
    if trainer.precision != "auto" or trainer.dtype is not None:  # auto never needs CUDA; resolved (measured) later
        check_device(resolve_precision(trainer.precision, trainer.dtype, warn=False, device=device), device)
    at_least("trainer.logprob_chunk", trainer.logprob_chunk, 0)
    at_least("trainer.lm_head_chunk", trainer.lm_head_chunk, 1)
    at_least("trainer.max_tokens_per_micro_batch", trainer.max_tokens_per_micro_batch, 0)
    check_budget(cfg)
    check_recompute(trainer)
    strategy = distributed.resolve_strategy(trainer.strategy)
    if strategy == "fsdp" and cfg.model.lora.enabled:
        raise ConfigError("trainer.strategy=fsdp with model.lora.enabled=true is not supported yet; "
                          "use trainer.strategy=ddp for LoRA (the adapter is small: replicate it)")
    if strategy == "fsdp" and algorithm.get("critic") == "separate":
        raise ConfigError("trainer.strategy=fsdp with algorithm.critic=separate is not supported yet; "
                          "use algorithm.critic=shared or trainer.strategy=ddp")
    ranks = distributed.launched_processes()
    if ranks == 1:
        return
    if trainer.prompts_per_step % ranks:
        raise ConfigError(
            f"trainer.prompts_per_step={trainer.prompts_per_step} does not split into whole prompt groups over "
            f"{ranks} processes; use a multiple of {ranks}"
        )
    samples = trainer.prompts_per_step * algorithm.group_size
    if algorithm.mini_batch_size and algorithm.mini_batch_size % ranks:
        raise ConfigError(
            f"algorithm.mini_batch_size={algorithm.mini_batch_size} (samples per update, all processes) does not "
            f"split evenly over {ranks} processes"
        )
    per_rank = (algorithm.mini_batch_size or samples) // ranks
    if trainer.micro_batch_size and per_rank % trainer.micro_batch_size:
        raise ConfigError(
            f"trainer.micro_batch_size={trainer.micro_batch_size} does not divide the {per_rank} samples of a "
            f"mini-batch on each of {ranks} processes"
        )
