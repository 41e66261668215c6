"""Each step's prompts, and the checkpoint form of the batch generated one step ahead (``generation.max_staleness``).

The rollout worker (:mod:`rlhf_lab.generation.worker`) holds that batch and decides when the engine takes weights.
Under ``max_staleness=1`` step t+1 trains on samples of the policy one update behind: its π_old is the trainer's own
pass (``generation.logprobs=auto`` rescores), the sampler's log-probs are kept, and ``algorithm.tis_cap`` corrects
for the difference (``rollout/is_weight_mean``, ``rollout/logprob_diff_*``). A checkpoint holds the batch in flight
(every rank's, ``ahead.safetensors``), so a resumed run trains on the same samples as one that was never stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from rlhf_lab.data.prompts import prompt_indices
from rlhf_lab.runtime import distributed
from rlhf_lab.step.sampling import refill_indices


def rng_key(seed: int, split: int, step: int, position: int) -> int:
    """The generator seed of one prompt group under ``trainer.seed_per_prompt`` (split 0 train, 1 eval)."""
    return (((seed * 1_000_003 + split) * 1_000_033 + step) * 1_000_037 + position) % 2**62


AHEAD_FILE = "ahead.safetensors"  # in a checkpoint: the ranks' batches in flight (their plain fields: trainer_state)


@dataclass(frozen=True)
class StepBatch:
    """This rank's prompts of one training step, their names (for errors) and their generators' keys."""

    prompts: list[str]
    names: list[str]
    keys: list[int]


def step_batch(cfg: Any, train: list[str], step: int) -> StepBatch:
    """The prompts step ``step`` trains on, on this rank (each rank its own, every step the same on a re-run)."""
    indices = prompt_indices(step, cfg.trainer.prompts_per_step, len(train), cfg.seed, rank=distributed.rank(),
                             world_size=distributed.world_size())
    first = distributed.rank() * len(indices)  # this rank's first position among the step's prompts
    return StepBatch([train[i] for i in indices], [f"train prompt {i}" for i in indices],
                     [rng_key(cfg.seed, 0, step, first + j) for j in range(len(indices))])


def continuous_source(cfg: Any, train: list[str]) -> Callable[[int], tuple[str, str, int]]:
    """The continuous simulator's prompt stream (``generation.continuous``): the n-th group launched is the prompt
    step n // B of a synchronous run takes at place n % B, with its seed (B = ``trainer.prompts_per_step``)."""
    per_step = int(cfg.trainer.prompts_per_step)

    def source(n: int) -> tuple[str, str, int]:
        batch = step_batch(cfg, train, n // per_step)
        return batch.prompts[n % per_step], batch.names[n % per_step], batch.keys[n % per_step]

    return source


def refill_source(cfg: Any, train: list[str], step: int) -> Callable[[int, int], tuple[list[str], list[str], list[int]]]:
    """Further prompts for dynamic sampling's refill rounds of ``step`` (this rank's own stream)."""

    def refill(round_: int, count: int) -> tuple[list[str], list[str], list[int]]:
        indices = refill_indices(step, round_ * distributed.world_size() + distributed.rank(), count, len(train),
                                 cfg.seed)
        offset = distributed.rank() * cfg.trainer.prompts_per_step  # splits 2, 3, …: refill rounds
        keys = [rng_key(cfg.seed, 1 + round_, step, offset + j) for j in range(count)]
        return [train[i] for i in indices], [f"train prompt {i}" for i in indices], keys

    return refill


def staleness(cfg: Any) -> int:
    """``generation.max_staleness``: how many updates before its step a batch is sampled (0: on-policy, and under
    ``generation.simulate_staleness``, where each step samples in its own step with weights of k updates before)."""
    generation = cfg.get("generation") or {}
    return 0 if generation.get("simulate_staleness", False) else int(generation.get("max_staleness", 0))


def sampled_behind(cfg: Any) -> bool:
    """Whether a training batch is sampled by weights older than those of its scoring pass: sampled ahead
    (``generation.max_staleness``), with past weights (``generation.simulate_staleness``) or by the continuous
    simulator's engine (``generation.continuous``)."""
    generation = cfg.get("generation") or {}
    return int(generation.get("max_staleness", 0)) > 0 or bool(generation.get("continuous", False))


def encode_ahead(states: list[list[dict[str, Any]]]) -> tuple[dict[str, Tensor], list[Any]]:
    """The ranks' batches in flight as tensors (``ahead.safetensors``) and JSON (in ``trainer_state.json``)."""
    tensors: dict[str, Tensor] = {}
    plain: list[Any] = []
    for rank, batches in enumerate(states):
        entries = []
        for index, state in enumerate(batches):
            entry: dict[str, Any] = {"key": state["key"], "version": state["version"], "tensors": [], "values": {}}
            for name, value in state["rollout"].items():
                if isinstance(value, Tensor):
                    tensors[f"rank{rank}.{index}.{name}"] = value.contiguous()
                    entry["tensors"].append(name)
                else:
                    entry["values"][name] = value
            entries.append(entry)
        plain.append(entries)
    return tensors, plain


def decode_ahead(tensors: dict[str, Tensor], plain: list[Any] | None) -> list[list[dict[str, Any]]] | None:
    """:func:`encode_ahead` read back (a checkpoint of one batch per rank, written before several could be in
    flight, too)."""
    if plain is None:
        return None
    states: list[list[dict[str, Any]]] = []
    for rank, entries in enumerate(plain):
        batches = []
        single = isinstance(entries, dict) or entries is None  # the earlier layout: one batch or none per rank
        for index, entry in enumerate([entries] if isinstance(entries, dict) else entries or []):
            prefix = f"rank{rank}." if single else f"rank{rank}.{index}."
            rollout = dict(entry["values"])
            rollout.update({name: tensors[prefix + name] for name in entry["tensors"]})
            batches.append({"key": entry["key"], "rollout": rollout,
                            **({"version": entry["version"]} if "version" in entry else {})})
        states.append(batches)
    return states
