"""The trainer's side of the continuous engine for real (``generation.continuous=true`` with
``generation=vllm_server``): groups launched on ``rlhf-lab serve --engine hf``'s stream
(:mod:`rlhf_lab.generation.serve_groups`), a bounded buffer of the completed ones, taken earliest completed first.

:class:`ServedGroups` keeps what :class:`~rlhf_lab.generation.continuous.ContinuousEngine` keeps for the simulator,
with the same methods, so the rollout worker drives either (:meth:`RolloutWorker.take_groups`): S =
``generation.engine_groups`` groups launched and not yet taken, the data's prompts in order with their seeds; a step
takes B = ``trainer.prompts_per_step`` of the completed ones and launches B more at once, before it trains. The
server decodes while the trainer trains and takes each version of the weights between two of its ticks (the rollout
worker publishes one after every update), so a long group launched early is trained late, over several versions,
and short ones launched after it overtake it: the same history the simulator scripts, on the wall clock.

A checkpoint first takes every group launched (the server finishes those in progress) and holds them, completed,
with their samples and versions (:meth:`state`); a resumed run trains on them first, in the order they completed,
and launches from the prompt where the stopped run was, the server's clock going on from the checkpoint's. A server
that stops answering stops the run in one line (what it wrote is kept; resume it against a server started again).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.backend import encode_prompts
from rlhf_lab.generation.rollout import Samples, concat_rollouts

WAIT_S = 30.0  # the seconds one take request waits at the server before it is asked again


@dataclass
class ServedGroup:
    """One group launched on the server: where it comes from and, once taken, its samples."""

    index: int  # its place in the prompt stream (the server's key)
    prompt: str
    name: str
    seed: int
    prompt_ids: list[int]
    rollout: Samples | None = None  # its samples, each token's version with them, once completed and taken
    launched: int = -1  # the server's tick it was launched at, and completed at
    completed: int = -1


class ServedGroups:
    """The continuous engine's client (see the module's text) over the ``vllm_server`` engine ``engine``."""

    def __init__(self, engine: Any, group_size: int, groups: int) -> None:
        self.engine, self.group_size, self.capacity = engine, group_size, groups
        self.every = 0  # the worker's ticks while the trainer updates: none here, the server keeps its own clock
        self.source: Any = None
        self.formatted: Any = lambda prompt: prompt
        self.launches = 0
        self.out: list[ServedGroup] = []  # launched on the server and not taken, in launch order
        self.held: list[ServedGroup] = []  # taken from the server and not yet trained on, oldest completed first
        self.opened = False
        self.waited, self.buffered, self.clock = 0, 0, 0
        health = engine.health()
        if not health.get("groups"):
            raise ConfigError(f"generation.continuous=true: rlhf-lab serve at {engine.url} runs no stream of groups "
                              "(its engine is vLLM's); start it with --engine hf, or set generation.continuous=false "
                              "(generation.max_staleness batches in flight)")

    # ------------------------------------------------------------------------------------------ the engine
    def fill(self) -> None:
        """Launch groups from the prompt stream until S are launched and not yet trained on."""
        if not self.opened:
            self._open()
        new = []
        while len(self.out) + len(self.held) + len(new) < self.capacity:
            prompt, name, seed = self.source(self.launches)
            ids = encode_prompts(self.engine.tokenizer, [self.formatted(prompt)])[0]
            new.append(ServedGroup(self.launches, prompt, name, seed, ids))
            self.launches += 1
        self._submit(new)

    def take(self, count: int) -> list[ServedGroup]:
        """The ``count`` groups that completed first (those held by a checkpoint first), waiting at the server until
        that many are in; then as many new ones launched."""
        self.fill()
        taken, self.held = self.held[:count], self.held[count:]
        kept = len(taken)
        self.waited, self.buffered = 0, kept
        if len(taken) < count:
            taken += self._taken({"count": count - len(taken)})
            self.buffered += kept
        self.fill()
        return taken

    def again(self, groups: list[ServedGroup]) -> list[ServedGroup]:
        """The prompts of ``groups`` sampled again from now (a staleness cap's ``wait``), each from its own seed as
        before, launched at once beside the S; the trainer waits for them."""
        fresh = [ServedGroup(g.index, g.prompt, g.name, g.seed, g.prompt_ids) for g in groups]
        self._submit(fresh)
        waited, buffered = self.waited, self.buffered  # the step's take's, the wait for these added
        taken = {g.index: g for g in self._taken({"keys": [g.index for g in fresh]})}
        self.waited, self.buffered = self.waited + waited, buffered
        return [taken[g.index] for g in fresh]

    def run(self, ticks: int) -> None:
        """Nothing: the server decodes on its own while the trainer updates."""

    def samples(self, groups: list[ServedGroup]) -> Samples:
        """The groups' samples as one batch, each token's version with it."""
        return concat_rollouts([group.rollout for group in groups], self.engine.tokenizer.pad_token_id)

    def metrics(self) -> dict[str, float]:
        """``async/wait_ticks`` (the server's ticks the last take waited), ``async/buffered_groups`` (completed groups
        waiting when it came), ``async/clock_ticks`` (the server's ticks so far)."""
        return {"async/wait_ticks": float(self.waited), "async/buffered_groups": float(self.buffered),
                "async/clock_ticks": float(self.clock)}

    # ------------------------------------------------------------------------------------------ the server
    def _open(self) -> None:
        settings = self.engine.settings
        self.engine.post("/groups/open", {
            "group_size": self.group_size, "max_new_tokens": settings.max_new_tokens,
            "temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k,
            "max_prompt_tokens": settings.max_prompt_tokens, "stop": list(settings.stop),
            "partial": bool(self.engine.partial), "clock": self.clock})
        self.opened = True

    def _submit(self, groups: list[ServedGroup]) -> None:
        if not groups:
            return
        self.engine.post("/groups/submit", {"keys": [g.index for g in groups], "seeds": [g.seed for g in groups],
                                            "prompt_ids": [g.prompt_ids for g in groups]})
        self.out.extend(groups)

    def _taken(self, ask: dict[str, Any]) -> list[ServedGroup]:
        """The groups the server gives for ``ask`` (a count, or keys), asked again until they are all in."""
        while True:
            reply = self.engine.post("/groups/take", {**ask, "wait_s": WAIT_S})
            self.clock = int(reply["clock"])
            if reply["complete"]:
                break
        self.waited, self.buffered = int(reply["waited_ticks"]), int(reply["buffered"])
        launched = {g.index: g for g in self.out}
        taken = []
        for served in reply["groups"]:
            group = launched[served["key"]]
            self.out.remove(group)
            group.rollout = self.engine.rollout([group.prompt_ids], served, self.group_size)
            group.launched, group.completed = int(served["launched"]), int(served["completed"])
            taken.append(group)
        return taken

    # ------------------------------------------------------------------------------------------ checkpoints
    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Every group launched, completed (the server finishes those in progress) and held, with its samples; and
        where the prompt stream is."""
        if self.out:
            self.held += self._taken({"count": len(self.out)})
        tensors: dict[str, Tensor] = {}
        groups = []
        for number, group in enumerate(self.held):
            for field_ in fields(group.rollout):
                value = getattr(group.rollout, field_.name)
                if isinstance(value, Tensor):
                    tensors[f"group{number}.{field_.name}"] = value.detach().cpu().contiguous()
            groups.append({"index": group.index, "prompt": group.prompt, "name": group.name, "seed": group.seed,
                           "prompt_ids": group.prompt_ids, "launched": group.launched, "completed": group.completed,
                           "prompt_width": group.rollout.prompt_width})
        return tensors, {"served": True, "launches": self.launches, "clock": self.clock, "groups": groups}

    def load_state(self, tensors: dict[str, Tensor], plain: dict[str, Any]) -> None:
        """:meth:`state` read back: the groups held are trained on first; the prompt stream goes on after them."""
        if not plain.get("served"):
            raise ConfigError("the checkpoint's continuous engine is the simulator's (generation=hf); resume it with "
                              "generation=hf, or start this run afresh")
        self.launches, self.clock = int(plain["launches"]), int(plain["clock"])
        device = self.engine.device
        self.held, self.out = [], []
        for number, entry in enumerate(plain["groups"]):
            own = {name.split(".", 1)[1]: value.to(device) for name, value in tensors.items()
                   if name.startswith(f"group{number}.")}
            rollout = Samples(prompt_width=int(entry["prompt_width"]), group_size=self.group_size, **own)
            self.held.append(ServedGroup(int(entry["index"]), entry["prompt"], entry["name"], int(entry["seed"]),
                                         list(entry["prompt_ids"]), rollout, int(entry["launched"]),
                                         int(entry["completed"])))


def continuous_engine(cfg: Any, engine: Any, version: Any) -> Any:
    """``generation.continuous``'s engine: the simulator over the hf engine (``generation=hf``), or the client of a
    server's stream of groups (``generation=vllm_server``); None where it is off."""
    from rlhf_lab.generation.continuous import ContinuousEngine, continuous_settings
    from rlhf_lab.generation.server import VLLMServerGeneration

    settings = continuous_settings(cfg)
    if settings is None:
        return None
    groups, every, partial = settings
    if isinstance(engine, VLLMServerGeneration):  # a server's client
        return ServedGroups(engine, int(cfg.algorithm.group_size), groups)
    return ContinuousEngine(engine, int(cfg.algorithm.group_size), groups, every, partial, version=version)
