"""Each step's prompts, and the batch generated one step ahead (``generation.max_staleness``).

``max_staleness=0`` (the default): a step samples with the weights it trains, and the engine gets the new weights
right after the update. ``max_staleness=1`` (one-step off-policy, as verl's and TRL's asynchronous trainers): as
soon as step t's batch is in, the engine takes π_θ(t) and starts on step t+1's batch, which it samples while step t
scores and trains. An engine on devices of its own (``generation=vllm_server``) works in parallel with the trainer;
the colocated ones (``hf``, ``vllm``) sample the batch right away, so the run learns the same way with no overlap
(for comparing staleness on one machine). Step t+1 then trains on samples of the policy one update behind: its
π_old is the trainer's own pass (``generation.logprobs=auto`` rescores), the sampler's log-probs are kept, and
``algorithm.tis_cap`` corrects for the difference (``rollout/is_weight_mean``, ``rollout/logprob_diff_*``).

A checkpoint holds the batch in flight (every rank's, ``ahead.safetensors``), so a resumed run trains on the same
samples as one that was never stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor, nn

from rlhf_lab.data.prompts import prompt_indices
from rlhf_lab.generation.rollout import Rollout
from rlhf_lab.runtime import distributed
from rlhf_lab.training.evaluation import rng_key
from rlhf_lab.training.records import StepTimer
from rlhf_lab.training.sampling import refill_indices

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


def refill_source(cfg: Any, train: list[str], step: int) -> Callable[[int, int], tuple[list[str], list[str], list[int]]]:
    """Further prompts for dynamic sampling's refill rounds of ``step`` (this rank's own stream)."""

    def refill(round_: int, count: int) -> tuple[list[str], list[str], list[int]]:
        indices = refill_indices(step, round_ * distributed.world_size() + distributed.rank(), count, len(train),
                                 cfg.seed)
        offset = distributed.rank() * cfg.trainer.prompts_per_step  # splits 2, 3, …: refill rounds
        keys = [rng_key(cfg.seed, 1 + round_, step, offset + j) for j in range(count)]
        return [train[i] for i in indices], [f"train prompt {i}" for i in indices], keys

    return refill


def stale(cfg: Any) -> bool:
    """Whether a step trains on samples generated one update earlier (``generation.max_staleness=1``)."""
    return int((cfg.get("generation") or {}).get("max_staleness", 0)) > 0


class Lookahead:
    """When the engine gets the policy's weights, and the batch it samples ahead (see the module's text).

    The trainer calls :meth:`after_update` after every optimizer step, :meth:`launch` once a step's batch is in
    (through :meth:`ExperienceMaker.make`'s ``then``), and :meth:`settle` before an evaluation or a checkpoint.
    """

    def __init__(self, experience: Any, policy: nn.Module, enabled: bool) -> None:
        self.experience, self.policy, self.enabled = experience, policy, enabled
        self.engine_current = True  # the engine holds the policy's current weights

    def sync(self, timer: StepTimer | None = None) -> None:
        """The policy's current weights to the engine, where it holds older ones."""
        if self.engine_current:
            return
        timer = timer or StepTimer()
        with timer.phase("sync_weights"):
            self.experience.engine.sync_weights(self.policy)
        self.engine_current = True

    def after_update(self, timer: StepTimer) -> None:
        """The engine takes the new weights now, or (``max_staleness=1``) once the batch it samples is in."""
        self.engine_current = False
        if not self.enabled:
            self.sync(timer)

    def launch(self, cfg: Any, train: list[str], step: int, timer: StepTimer) -> None:
        """Step ``step``'s batch started with the current weights (only under ``max_staleness=1``, only for a
        step the run will train)."""
        if not self.enabled or step >= cfg.trainer.steps:
            return
        self.sync(timer)
        batch = step_batch(cfg, train, step)
        with timer.phase("generate"):
            self.experience.generate_ahead(batch.prompts, cfg.algorithm.group_size, batch.keys)

    def settle(self) -> None:
        """The batch in flight is in, and the engine holds the current weights (it samples the evaluation)."""
        self.experience.hold_ahead()
        self.sync()

    # ------------------------------------------------------------------------ checkpoints
    def state(self) -> list[dict[str, Any] | None]:
        """Every rank's batch in flight (after :meth:`settle`), as plain fields and CPU tensors, for rank 0 to write."""
        return distributed.gather_objects([_rollout_state(self.experience.held_ahead())])

    def load_state(self, states: list[dict[str, Any] | None] | None) -> None:
        """Resume: this rank's batch in flight, which the next step trains on (nothing when the checkpoint has none
        or ``max_staleness`` is now 0: that step samples afresh)."""
        if not self.enabled or not states or len(states) != distributed.world_size():
            return
        held = states[distributed.rank()]
        if held is not None:
            key, fields_ = held["key"], held["rollout"]
            rollout = Rollout(**{k: v.to(self.experience.device) if isinstance(v, Tensor) else v
                                 for k, v in fields_.items()})
            self.experience.ahead = ((tuple(key[0]), int(key[1]), tuple(key[2])), lambda: rollout)


def _rollout_state(held: tuple[tuple[Any, ...], Rollout] | None) -> dict[str, Any] | None:
    """A batch just generated: its tensors (on the CPU) and sizes; what later passes add to it is not there yet."""
    if held is None:
        return None
    key, rollout = held
    kept: dict[str, Any] = {}
    for field_ in fields(rollout):
        value = getattr(rollout, field_.name)
        if isinstance(value, Tensor):
            kept[field_.name] = value.detach().cpu()
        elif isinstance(value, int) and not isinstance(value, bool):
            kept[field_.name] = value
    return {"key": [list(key[0]), key[1], list(key[2])], "rollout": kept}


def encode_ahead(states: list[dict[str, Any] | None]) -> tuple[dict[str, Tensor], list[Any]]:
    """The ranks' batches in flight as tensors (``ahead.safetensors``) and JSON (in ``trainer_state.json``)."""
    tensors: dict[str, Tensor] = {}
    plain: list[Any] = []
    for rank, state in enumerate(states):
        if state is None:
            plain.append(None)
            continue
        entry: dict[str, Any] = {"key": state["key"], "tensors": [], "values": {}}
        for name, value in state["rollout"].items():
            if isinstance(value, Tensor):
                tensors[f"rank{rank}.{name}"] = value.contiguous()
                entry["tensors"].append(name)
            else:
                entry["values"][name] = value
        plain.append(entry)
    return tensors, plain


def decode_ahead(tensors: dict[str, Tensor], plain: list[Any] | None) -> list[dict[str, Any] | None] | None:
    """:func:`encode_ahead` read back."""
    if plain is None:
        return None
    states: list[dict[str, Any] | None] = []
    for rank, entry in enumerate(plain):
        if entry is None:
            states.append(None)
            continue
        rollout = dict(entry["values"])
        rollout.update({name: tensors[f"rank{rank}.{name}"] for name in entry["tensors"]})
        states.append({"key": entry["key"], "rollout": rollout})
    return states


