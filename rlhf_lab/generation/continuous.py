"""The continuous asynchronous simulator (``generation.continuous=true``): an engine that never stops decoding, a
buffer of completed groups the trainer takes from, and a scripted clock in decode ticks, exact on one CPU.

An asynchronous trainer's engine (AReaL, PipelineRL, prime-rl, verl's separate mode) keeps a fixed number of prompt
groups launched and not yet trained on: each decodes from the moment it is launched; a group whose samples have all
ended goes to the buffer, and a new prompt takes its place; the trainer takes the groups that completed first. A
long group launched early is therefore trained late, over several weight versions, and a short one launched after
it overtakes it. The fixed-lag simulator (:mod:`rlhf_lab.generation.inflight`) cannot show this: there every batch
starts in its own step.

The clock. One tick is one decode step of every group in progress. The engine keeps ``generation.engine_groups`` (S)
groups launched and not yet taken (decoding, or waiting in the buffer); the trainer takes ``trainer.prompts_per_step``
(B ≤ S) groups, the earliest completed first, waiting tick by tick where fewer are in; its update takes
``generation.update_every_tokens`` (N) ticks, while the engine goes on with the weights it has; then the new version
lands. Under ``generation.weight_updates=in_flight`` a group in progress keeps the key/value cache the older weights
wrote; under ``partial`` it is recomputed from the group's tokens so far with the new weights. Every token carries
the version that sampled it. With S = B and N ≥ ``trainer.max_new_tokens`` every batch is sampled one version behind:
the fixed-lag simulator's ``max_staleness=1`` (tested equal); with N = 0 every batch is on-policy.

Prompts come in the data's order (the n-th launched is the prompt the synchronous run's step n // B would take at
n % B), each group decoded by :class:`~rlhf_lab.generation.decode.Decoding` with its own seeded stream (the seed
``trainer.seed_per_prompt`` gives that prompt): a group's samples depend on the weights at each of its ticks alone,
never on the groups beside it. A checkpoint holds every group launched and not yet taken, with its tokens, its
stream's state and its key/value cache, so a resumed run goes on exactly as one never stopped.

The same engine runs for real on ``rlhf-lab serve --engine hf``, ticking on the wall clock
(:mod:`rlhf_lab.generation.serve_groups`; the trainer's side: :mod:`rlhf_lab.generation.served_groups`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.backend import Prompt, check_prompt_lengths, encode_prompts
from rlhf_lab.generation.decode import Decoding
from rlhf_lab.generation.kv_cache import decode_cache
from rlhf_lab.generation.rollout import Samples, concat_rollouts
from rlhf_lab.generation.seeded import SeededDraws

# ``source(n)`` -> (prompt, name, seed) of the n-th group launched; ``formatted(prompt)``: what the engine reads.
Source = Callable[[int], tuple[str, str, int]]


@dataclass
class Group:
    """One prompt group launched: where it comes from, its decode, and the version of each of its steps' tokens."""

    index: int  # its place in the prompt stream (the n-th launched; a group sampled again keeps it)
    prompt: str
    name: str
    seed: int
    launched: int  # the tick it was launched at
    decoding: Decoding
    draws: SeededDraws
    prompt_ids: Tensor  # [G, P]
    prompt_mask: Tensor  # [G, P]
    versions: list[int] = field(default_factory=list)  # the version that sampled each step's tokens
    completed: int = -1  # the tick its last sample ended at (-1: decoding)


def continuous_settings(cfg: Any) -> tuple[int, int, bool] | None:
    """(engine groups, ticks per update, partial) of ``generation.continuous=true``; None where it is off."""
    generation = cfg.get("generation") or {}
    if not generation.get("continuous", False):
        return None
    groups = generation.get("engine_groups") or 2 * int(cfg.trainer.prompts_per_step)
    return int(groups), int(generation.get("update_every_tokens", 0)), generation.get("weight_updates") == "partial"


class ContinuousEngine:
    """The simulator's engine (see the module's text) over the hf engine ``engine``'s policy, precision and draws.

    ``version()``: the policy's updates now (the rollout worker's); ``source``/``formatted``: the prompt stream."""

    def __init__(self, engine: Any, group_size: int, groups: int, every: int, partial: bool,
                 version: Callable[[], int]) -> None:
        self.engine, self.group_size, self.capacity = engine, group_size, groups
        self.every, self.partial, self.version = every, partial, version
        self.settings = engine.settings  # what every group samples with (a server's stream: its client's)
        self.source: Source | None = None
        self.formatted: Callable[[str], Prompt] = lambda prompt: prompt
        self.running: list[Group] = []  # decoding, in launch order
        self.buffer: list[Group] = []  # completed, oldest first
        self.clock = 0  # ticks so far
        self.launches = 0  # the next group's place in the prompt stream
        self.seen = 0  # the version of the last tick's tokens (a newer one has landed since where they differ)
        self.waited = 0  # ticks the trainer waited for its last batch
        self.buffered = 0  # completed groups waiting when the trainer last took

    # ------------------------------------------------------------------------------------------ the engine
    def fill(self) -> None:
        """Launch groups from the prompt stream until S are launched and not yet taken."""
        while len(self.running) + len(self.buffer) < self.capacity:
            prompt, name, seed = self.source(self.launches)
            self.running.append(self.launch(self.launches, prompt, name, seed))
            self.launches += 1

    def launch(self, index: int, prompt: str, name: str, seed: int) -> Group:
        """A group decoding from this tick (its prompt goes through the model at its first step)."""
        engine, settings = self.engine, self.settings
        ids = encode_prompts(engine.tokenizer, [self.formatted(prompt)])
        if len(ids[0]) > settings.max_prompt_tokens:
            check_prompt_lengths([len(ids[0])], settings.max_prompt_tokens)
        prompt_ids = torch.tensor(ids, dtype=torch.long, device=engine.device).repeat(self.group_size, 1)
        prompt_mask = torch.ones_like(prompt_ids)
        draws = SeededDraws(engine.hardware.sample, [seed], self.group_size, engine.device)
        return Group(index, prompt, name, seed, self.clock, self.decoding(prompt_ids, prompt_mask, draws), draws,
                     prompt_ids, prompt_mask)

    def decoding(self, prompt_ids: Tensor, prompt_mask: Tensor, draws: SeededDraws) -> Decoding:
        from rlhf_lab.generation.hf import stop_strings

        engine, settings = self.engine, self.settings
        tokenizer = engine.tokenizer
        stopped = stop_strings(tokenizer, settings.stop, prompt_width=prompt_ids.shape[1]) if settings.stop else None
        return Decoding(engine.policy, prompt_ids, prompt_mask, decode_cache(settings.max_new_tokens), 0,
                        settings.max_new_tokens, settings.temperature, settings.top_p, settings.top_k,
                        tokenizer.eos_token_id, tokenizer.pad_token_id, sample=draws, stopped=stopped)

    def tick(self) -> None:
        """One decode step of every group in progress with the weights of now; the groups that end go to the buffer,
        and new ones take their places."""
        version = self.version()
        landed, self.seen = version != self.seen, version
        engine, policy = self.engine, self.engine.policy
        was_training = policy.training
        policy.eval()
        with engine.precision.autocast(), engine.hardware.decode_weights(policy, rows=len(self.running) *
                                                                         self.group_size):
            for group in self.running:
                group.decoding.advance(recompute=self.partial and landed)
                group.versions.append(version)
        policy.train(was_training)
        self.clock += 1
        for group in [group for group in self.running if group.decoding.done]:
            group.completed = self.clock
            group.decoding.past_key_values = None  # its cache is not read again
            self.running.remove(group)
            self.buffer.append(group)
        self.fill()

    def run(self, ticks: int) -> None:
        """``ticks`` ticks: the engine decoding while the trainer updates."""
        for _ in range(ticks):
            self.tick()

    def take(self, count: int) -> list[Group]:
        """The ``count`` groups that completed first, ticking until that many are in (:attr:`waited`)."""
        self.fill()
        self.waited, self.buffered = 0, len(self.buffer)
        while len(self.buffer) < count:
            self.tick()
            self.waited += 1
        taken, self.buffer = self.buffer[:count], self.buffer[count:]
        self.fill()
        return taken

    def again(self, groups: list[Group]) -> list[Group]:
        """The prompts of ``groups`` sampled again from now (a staleness cap's ``wait``), each from its own seed as
        before, ticking until they end; the trainer waits (:attr:`waited`). They are launched at once, beside the S."""
        fresh = [self.launch(group.index, group.prompt, group.name, group.seed) for group in groups]
        self.running.extend(fresh)
        while any(group.completed < 0 for group in fresh):
            self.tick()
            self.waited += 1
        self.buffer = [group for group in self.buffer if all(group is not other for other in fresh)]
        return fresh

    def samples(self, groups: list[Group]) -> Samples:
        """The groups' samples as one batch, each token's version with it."""
        from rlhf_lab.generation.hf import decoded_samples

        parts = []
        for group in groups:
            rollout = decoded_samples(group.decoding.result(), group.prompt_ids, group.prompt_mask,
                                      self.engine.tokenizer.pad_token_id, self.group_size)
            steps = torch.tensor(group.versions, dtype=torch.long, device=rollout.response_mask.device)
            parts.append(replace(rollout, versions=steps[None, :] * (rollout.response_mask > 0).long()))
        return concat_rollouts(parts, self.engine.tokenizer.pad_token_id)

    def metrics(self) -> dict[str, float]:
        """``async/wait_ticks``, ``async/buffered_groups``, ``async/clock_ticks`` of the last batch taken."""
        return {"async/wait_ticks": float(self.waited), "async/buffered_groups": float(self.buffered),
                "async/clock_ticks": float(self.clock)}

    # ------------------------------------------------------------------------------------------ checkpoints
    def state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Every group launched and not yet taken (tensors, on the CPU) and the clock (plain fields)."""
        tensors: dict[str, Tensor] = {}
        groups = []
        for number, group in enumerate([*self.running, *self.buffer]):
            decoding = group.decoding
            own = {"sequences": decoding.sequences, "unfinished": decoding.unfinished, "lengths": decoding.lengths,
                   "prompt_mask": group.prompt_mask}
            if decoding.tokens:
                own.update(tokens=torch.stack(decoding.tokens, 1), logprobs=torch.stack(decoding.logprobs, 1),
                           entropies=torch.stack(decoding.entropies, 1))
            if decoding.past_key_values is not None and decoding.step:
                for layer_index, layer in enumerate(decoding.past_key_values.layers):
                    own[f"keys.{layer_index}"], own[f"values.{layer_index}"] = layer.keys, layer.values
            if group.draws.generators:
                own["stream"] = group.draws.generators[0].get_state()
            tensors.update({f"group{number}.{name}": value.detach().cpu().contiguous() for name, value in own.items()})
            groups.append({"index": group.index, "prompt": group.prompt, "name": group.name, "seed": group.seed,
                           "launched": group.launched, "completed": group.completed, "versions": group.versions,
                           "step": decoding.step, "done": decoding.done, "tensors": sorted(own)})
        plain = {"clock": self.clock, "launches": self.launches, "seen": self.seen, "running": len(self.running),
                 "groups": groups}
        return tensors, plain

    def load_state(self, tensors: dict[str, Tensor], plain: dict[str, Any]) -> None:
        """:meth:`state` read back: the groups go on from the very step, cache and stream they were at."""
        if plain.get("served"):
            raise ConfigError("the checkpoint's continuous engine is a server's stream of groups "
                              "(generation=vllm_server); resume it with that server, or start this run afresh")
        self.clock, self.launches, self.seen = int(plain["clock"]), int(plain["launches"]), int(plain["seen"])
        device = self.engine.device
        groups = []
        for number, entry in enumerate(plain["groups"]):
            own = {name: tensors[f"group{number}.{name}"] for name in entry["tensors"]}
            prompt_width = own["prompt_mask"].shape[1]
            prompt_ids = own["sequences"][:, :prompt_width].to(device)
            prompt_mask = own["prompt_mask"].to(device)
            draws = SeededDraws(self.engine.hardware.sample, [int(entry["seed"])], self.group_size, device)
            if "stream" in own:
                draws.generators[0].set_state(own["stream"])
            decoding = self.decoding(prompt_ids, prompt_mask, draws)
            step = int(entry["step"])
            decoding.step, decoding.done = step, bool(entry["done"])
            decoding.sequences = own["sequences"].to(device)
            decoding.unfinished, decoding.lengths = own["unfinished"].to(device), own["lengths"].to(device)
            if step:
                decoding.tokens = list(own["tokens"].to(device).unbind(1))
                decoding.logprobs = list(own["logprobs"].to(device).unbind(1))
                decoding.entropies = list(own["entropies"].to(device).unbind(1))
                decoding.step_ids = decoding.sequences[:, -1:]
                decoding.step_positions = decoding.next_position + step - 1
            if decoding.done:
                decoding.past_key_values = None
            elif step:
                cache = decode_cache(decoding.max_new_tokens - step)
                for layer_index in range(sum(name.startswith("keys.") for name in own)):
                    cache.update(own[f"keys.{layer_index}"].to(device), own[f"values.{layer_index}"].to(device),
                                 layer_index)
                decoding.past_key_values = cache
            groups.append(Group(int(entry["index"]), entry["prompt"], entry["name"], int(entry["seed"]),
                                int(entry["launched"]), decoding, draws, prompt_ids, prompt_mask,
                                [int(v) for v in entry["versions"]], int(entry["completed"])))
        running = int(plain["running"])
        self.running, self.buffer = groups[:running], groups[running:]


CONTINUOUS_FILE = "async_engine.safetensors"  # in a checkpoint: the continuous engine's groups (plain: trainer_state)


def continuous_files(engine: ContinuousEngine | None) -> tuple[dict[str, dict[str, Tensor]], dict[str, Any] | None]:
    """The checkpoint's tensor file and plain state of a continuous engine ({}, None without one)."""
    if engine is None:
        return {}, None
    tensors, plain = engine.state()
    return {CONTINUOUS_FILE: tensors}, plain
