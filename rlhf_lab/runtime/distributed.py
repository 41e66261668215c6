"""Where a multi-process run differs from one process: torch.distributed set-up, wrapping, and reductions.

One run scales over N processes launched by ``torchrun`` (or ``accelerate launch``), which set ``RANK``,
``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``. ``trainer.strategy``:

- ``single``: one process, no process group;
- ``ddp``: the policy (and an algorithm's trainable modules) wrapped in ``DistributedDataParallel``:
  gradients are averaged across ranks at every backward;
- ``fsdp``: torch's FSDP2 ``fully_shard`` with each transformer block as a unit, then the whole model:
  parameters, gradients and optimizer state are sharded; works in one process too;
- ``auto``: ``ddp`` under a multi-process launch, else ``single``.

Single-process runs see rank 0 of 1 and every reduction here is the identity, computed exactly as the
plain local expression (so one-process numbers do not move); the masked reductions over every rank's rows are
:mod:`rlhf_lab.masked`'s, with ``across_ranks=True``. Prompt groups are never split across ranks
(``data.prompt_indices`` gives each rank a contiguous block of whole prompts); statistics over the batch
are reduced here so N processes compute what one process computes on the whole batch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from rlhf_lab.errors import ConfigError

STRATEGIES = ("auto", "single", "ddp", "fsdp")
LAUNCH_HINT = "launch with torchrun --nproc_per_node=N -m rlhf_lab ... (or accelerate launch)"


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return rank() == 0


def launched_processes() -> int:
    """How many processes the launcher started (``WORLD_SIZE`` from torchrun / accelerate), 1 otherwise."""
    if is_distributed():
        return world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launched_by_torchrun() -> bool:
    """Whether a launcher started this process as a rank (``torchrun --nproc_per_node 1`` included)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


def resolve_strategy(strategy: str, processes: int | None = None) -> str:
    """The strategy a run uses: ``auto`` picks ``ddp`` under a multi-process launch, else ``single``.

    ``ddp`` needs a launch by torchrun (one process is allowed: its collectives run, on one rank); ``single``
    refuses a multi-process launch (each rank would train its own model).
    """
    processes = launched_processes() if processes is None else processes
    if strategy not in STRATEGIES:
        raise ConfigError(f"trainer.strategy={strategy!r} is not valid; choose from: {', '.join(STRATEGIES)}")
    if strategy == "auto":
        return "ddp" if processes > 1 else "single"
    if strategy == "ddp" and processes < 2 and not launched_by_torchrun():
        raise ConfigError(f"trainer.strategy=ddp needs a multi-process launch (WORLD_SIZE={processes}); {LAUNCH_HINT}")
    if strategy == "single" and processes > 1:
        raise ConfigError(
            f"trainer.strategy=single, but launched as {processes} processes (WORLD_SIZE={processes}): each "
            "would train its own model; use trainer.strategy=ddp|fsdp|auto or run without torchrun"
        )
    return strategy


def setup(strategy: str, device: torch.device, timeout_s: float = 600.0) -> None:
    """Start the process group a strategy needs (idempotent); ``fsdp`` in one process gets a group of one.

    ``timeout_s`` (``trainer.collective_timeout_s``) bounds how long a rank waits for the others, at the
    rendezvous and in every collective: a peer that never comes (launcher variables left over from another job) or
    stops taking part ends in an error, not a hang. A rendezvous nobody joins is a one-line error."""
    if strategy == "single" or is_distributed():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(seconds=timeout_s)
    if not (launched_processes() > 1 or launched_by_torchrun()):  # FSDP in one process: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    try:
        dist.init_process_group(backend, timeout=timeout)
    except dist.DistError as error:  # the store's timeout (rank 0) or its address unreachable (the others)
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise ConfigError(
            f"rank {os.environ.get('RANK')} of WORLD_SIZE={launched_processes()} waited "
            f"trainer.collective_timeout_s={timeout_s:g} for the other processes at MASTER_ADDR:MASTER_PORT={address} "
            f"in vain ({str(error).splitlines()[0][:120]}); unset the launcher's variables for one process, or "
            f"{LAUNCH_HINT}"
        ) from None


def barrier() -> None:
    """Every rank waits here for every other (e.g. while rank 0 writes a checkpoint); nothing in one process."""
    if not _single():
        dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)


def teardown() -> None:
    if is_distributed():
        dist.destroy_process_group()


def wrap(module: nn.Module, strategy: str, device: torch.device, compute_dtype: torch.dtype | None = None) -> nn.Module:
    """``module`` as the strategy trains it: DDP-wrapped, FSDP2-sharded in place (:func:`shard`), or unchanged."""
    if strategy == "ddp" and any(p.requires_grad for p in module.parameters()):
        device_ids = [device.index or 0] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
    if strategy == "fsdp":
        shard(module, compute_dtype)
    return module


def shard(module: nn.Module, compute_dtype: torch.dtype | None = None, offload: bool = False) -> nn.Module:
    """FSDP2's ``fully_shard`` of each transformer block, then of the whole module, in place: each rank keeps its
    shard of every parameter (moved to the mesh's device block by block, so no rank ever holds the whole model
    there). ``compute_dtype`` (a mixed precision's bfloat16): the weights are gathered in it for the forward pass
    and the gradients reduced in float32 (``MixedPrecisionPolicy``); None: gathered as stored. ``offload``: the
    shards stay in host memory and each block's are copied to the device for its pass (``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy() if compute_dtype is None else \
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    where = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for block in transformer_blocks(module):
        fully_shard(block, mp_policy=policy, offload_policy=where)
    fully_shard(module, mp_policy=policy, offload_policy=where)
    return module


def on_meta(module: nn.Module) -> bool:
    """Whether ``module`` has a parameter or buffer on the meta device (built without its weights)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def load_from_rank0(module: nn.Module, state: dict[str, Tensor] | None, device: torch.device) -> None:
    """Every rank's (sharded) ``module`` takes rank 0's whole ``state`` (its ``state_dict()`` before sharding; None
    on the other ranks), so only rank 0 ever reads the weights; a collective. A rank that built ``module`` on the meta
    device allocates its shards first (``to_empty``). One tensor at a time is broadcast whole and each rank keeps its
    shard of it (``distribute_tensor`` without communication): no rank holds more than one whole tensor at once, and
    shards kept in host memory (FSDP's CPU offload) take theirs the same way. The buffers no state dict holds
    (rotary frequencies) are broadcast too."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if on_meta(module):
        module.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            whole = state[name].to(collective_device(), tensor.dtype) if is_main_process() else \
                torch.empty(tensor.shape, dtype=tensor.dtype, device=collective_device())
            dist.broadcast(whole, src=0)
            if isinstance(tensor, DTensor):
                local = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(local.to_local())
            else:
                tensor.copy_(whole)
        for buffer in module.buffers():
            moved = buffer.to(collective_device())
            dist.broadcast(moved, src=0)
            buffer.copy_(moved)


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM (looking through a peft wrapper): FSDP2's sharding units."""
    blocks = []
    for name, child in module.named_modules():
        if name.endswith("layers") and isinstance(child, nn.ModuleList):
            blocks.extend(child)
    return blocks


def sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` holds its values as a tensor subclass (FSDP2's DTensor shards, say) rather than as one
    plain tensor: code that reads or re-lays weights whole (stacking, packing, inference-mode gathers) skips it. A
    fake tensor (the planner's, :mod:`rlhf_lab.planner`) stands for a plain one: the planned step takes the plain
    tensor's paths (the chunked LM head among them)."""
    data = tensor.data
    return type(data) is not torch.Tensor and not isinstance(data, FakeTensor)


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def no_sync(modules: Sequence[nn.Module], skip: bool) -> AbstractContextManager:
    """Skip the gradient reduction in this backward (every micro-batch of a mini-batch but the last): DDP's
    all-reduce (``no_sync``), FSDP2's reduce-scatter (``set_requires_gradient_sync(False)``: the micro-batches'
    gradients accumulate unsharded, and the last backward reduces them once)."""
    stack = ExitStack()
    if skip:
        for module in modules:
            if isinstance(module, nn.parallel.DistributedDataParallel):
                stack.enter_context(module.no_sync())
            elif hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 module (fully_shard)
                module.set_requires_gradient_sync(False)
                stack.callback(module.set_requires_gradient_sync, True)
    return stack


# ------------------------------------------------------------------------------------------ reductions
# Every collective of the package is one of these. NCCL takes only tensors on the process's GPU, gloo CPU tensors:
# each helper moves its input to :func:`collective_device` and its result back to where the input was.


def collective_device() -> torch.device:
    """Where this process's collectives take their tensors: its GPU under NCCL, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _single() -> bool:
    """No process group: every reduction is the local value. With one (one rank included: a 1-GPU torchrun run
    exercises its NCCL collectives) they run."""
    return not is_distributed()


def _reduce(values: Tensor, op: Any) -> Tensor:
    """``op`` over ranks of ``values``, on the collective device; a new tensor on ``values``' device."""
    reduced = values.detach().to(collective_device(), copy=True)
    dist.all_reduce(reduced, op=op)
    return reduced.to(values.device)


def all_reduce_sum(values: Tensor) -> Tensor:
    """Σ over ranks of ``values`` (a new tensor; the identity in one process)."""
    return values if _single() else _reduce(values, dist.ReduceOp.SUM)


def all_reduce_flags(flag: bool) -> bool:
    """True when ``flag`` is true on every rank (e.g. every rank's loss is finite)."""
    return bool(all_reduce_sum(torch.tensor([0.0 if flag else 1.0]))[0] == 0)


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on some rank (e.g. some rank still decodes)."""
    return not all_reduce_flags(not flag)


def sum_dict(values: dict[str, float]) -> dict[str, float]:
    """Σ over ranks of each value of a dict with the same keys on every rank (one collective)."""
    if _single() or not values:
        return values
    keys = sorted(values)
    totals = all_reduce_sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    return {**values, **{k: float(v) for k, v in zip(keys, totals.tolist())}}


def gather_rows(values: Tensor) -> Tensor:
    """Every rank's rows concatenated in rank order ([B, ...] each, the same shape on every rank)."""
    if _single():
        return values
    local = values.detach().to(collective_device()).contiguous()
    pieces = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(pieces, local)
    return torch.cat(pieces).to(values.device)


def gather_objects(items: list[Any], group: Any = None) -> list[Any]:
    """Every rank's list concatenated in rank order (picklable objects: texts, floats; torch moves them through
    the backend's device itself); within ``group`` (from :func:`rank_groups`) where given."""
    if _single():
        return items
    size = world_size() if group is None else dist.get_world_size(group)
    gathered: list[list[Any]] = [[] for _ in range(size)]
    dist.all_gather_object(gathered, items, group=group)
    return [item for part in gathered for item in part]


def rank_groups(size: int) -> Any:
    """This rank's process group among consecutive groups of ``size`` ranks (every rank creates every group, as
    torch requires)."""
    groups = [dist.new_group(list(range(first, first + size))) for first in range(0, world_size(), size)]
    return groups[rank() // size]


def mean(values: Tensor) -> Tensor:
    """Mean of ``values`` over every rank's entries (``values.mean()`` in one process)."""
    if _single():
        return values.mean()
    totals = all_reduce_sum(torch.stack([values.sum().double(), values.new_tensor(values.numel()).double()]))
    return (totals[0] / totals[1]).to(values.dtype)


def maximum(value: Tensor) -> float:
    """The largest of every rank's scalar ``value``."""
    if _single():
        return float(value)
    return float(_reduce(value.detach().double().reshape(1), dist.ReduceOp.MAX)[0])


def minimum(value: Tensor) -> float:
    """The smallest of every rank's scalar ``value``."""
    return -maximum(-value)


def mean_across_ranks(metrics: dict[str, Any]) -> dict[str, Any]:
    """Average numeric metrics over ranks (identity in a single process)."""
    if _single():
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool))
    totals = sum_dict({k: float(metrics[k]) for k in keys})
    means = {k: totals[k] / world_size() for k in keys}
    # A count the ranks agree on (the step, say) stays an integer.
    return {**metrics, **{k: int(v) if isinstance(metrics[k], int) and v == metrics[k] else v for k, v in means.items()}}


# ------------------------------------------------------------------------------- FSDP checkpoint state
def full_model_state(module: nn.Module) -> dict[str, Tensor]:
    """The whole (unsharded) state dict of an FSDP-sharded module on the CPU; a collective: every rank calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A tied parameter (lm_head = embeddings) is one tensor saved once, as an unsharded model saves it.
    seen: set[int] = set()
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            state.pop(name, None)
        seen.add(id(parameter))
    return state


def load_full_model_state(module: nn.Module, state: dict[str, Tensor]) -> Any:
    """Load a whole state dict into a (possibly FSDP-sharded) module; returns (missing, unexpected) keys."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    return set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))


def _parameter_names(container: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in its groups' order (the id format's indices)."""
    names = {id(p): name for name, p in container.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def load_full_optimizer_state(modules: dict[str, nn.Module], optimizer: torch.optim.Optimizer,
                              state: dict[str, Any]) -> None:
    """Load an optimizer state in ``state_dict()``'s format into the optimizer of sharded modules."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    container = nn.ModuleDict(modules)
    names = _parameter_names(container, optimizer)
    by_name = {"state": {names[int(i)]: value for i, value in state["state"].items()},
               "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(container, optimizer, optim_state_dict=by_name,
                             options=StateDictOptions(full_state_dict=True))
