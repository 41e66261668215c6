"""The rollout worker: the one owner of a generation engine's lifecycle (wake, weights, sampling, sleep) and of the
batches it samples ahead of their steps.

The trainer tells it two things: "the policy has new weights" (:meth:`RolloutWorker.weights_updated`, after every
optimizer step) and "give me samples" (:meth:`RolloutWorker.generate`, or a batch started early with
:meth:`RolloutWorker.launch` and taken with :meth:`RolloutWorker.take`). Everything else is decided here, in one
order for every engine (``hf``, ``vllm``, ``vllm_server``), the order TRL's colocate mode and verl's hybrid engine
use with vLLM's sleep mode:

1. ``torch.cuda.empty_cache()``, so the trainer's cached blocks do not stop the engine re-mapping its memory;
2. ``wake_up(tags=["weights"])``;
3. the policy's weights loaded where the engine holds older ones, and always after a level-2 sleep (which
   discarded them);
4. ``torch.cuda.empty_cache()`` again (the load's gathered tensors), then ``wake_up(tags=["kv_cache"])``;
5. sampling (one call, or a whole multi-turn batch inside :meth:`RolloutWorker.awake`), with the weight-sync canary
   of a load (:mod:`rlhf_lab.generation.sync_check`): its probe one more request of the first call where the engine
   takes one, else sampled in a call of its own before the engine sleeps;
6. ``sleep(level)``: level 2 for full fine-tuning (the weights change, no host copy is worth keeping), level 1
   under LoRA (the base weights never change; the adapter is sent again as a new request).

Weights are never written into a sleeping engine: what vLLM's level-1 wake restores is its backup of the weights it
had, so a write while asleep is lost (or faults on a GPU). An engine that does not sleep (``hf``, a CPU engine, a
server with devices of its own) skips steps 1, 2, 4 and 6; ``hf`` samples with the policy's own weights and has
none to load.

``generation.max_staleness=k`` (off-policy by k updates, as verl's and prime-rl's asynchronous trainers): as soon as
step t's batch is in, the worker starts step t+k's with the policy's weights of that moment (t updates), so every
step s trains on samples of the weights of max(s−k, 0) updates. An engine on devices of its own samples them while
the trainer trains; the colocated ones sample them at once and hold them, so the run learns the same way with no
overlap: the lag is exact and reproducible on one CPU, with no copy of old weights kept (k batches are held
instead). A checkpoint holds the batches in flight (:meth:`state`), so a resumed run trains on the same samples as
one that was never stopped. ``generation.simulate_staleness`` keeps the last k policies' weights instead
(:mod:`rlhf_lab.generation.staleness`): each step samples its own prompts, in its own step, with the weights of
max(t − k, 0) updates (:meth:`RolloutWorker.lagging`), and with ``generation.weight_updates`` newer versions land
while it decodes (:mod:`rlhf_lab.generation.inflight`). Every batch handed out carries each token's version
(``Samples.versions``: the updates of the weights that sampled it).

For real, a server that takes weights between its decode steps (``rlhf-lab serve``, either engine, under
``generation.weight_updates=in_flight`` or ``partial``) gets each version at once, labelled with the policy's updates
(:meth:`RolloutWorker.weights_updated`): it lands in the batches the server is sampling ahead, and the server reports
each token's version. ``generation.staleness_cap`` then drops, or samples again, the groups of a batch taken whose
oldest token is too old (:meth:`RolloutWorker.take`). Under ``generation.continuous`` it takes groups, not batches
(:meth:`RolloutWorker.take_groups`): the simulator's, or a server's (:mod:`rlhf_lab.generation.served_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.generation.backend import GenerationBackend, Prompt, SamplingSettings
from rlhf_lab.generation.continuous import ContinuousEngine, Group
from rlhf_lab.generation.inflight import InflightSchedule, StalenessCap, batch_versions
from rlhf_lab.generation.rollout import Samples
from rlhf_lab.generation.staleness import SnapshotRing
from rlhf_lab.generation.sync_check import SyncCheck
from rlhf_lab.runtime import distributed

AheadKey = tuple[Any, ...]  # (prompts, group size, generator keys) of a batch started early


class RolloutWorker:
    """Drives one engine through wake, weights, sampling and sleep (see the module's text).

    ``policy``: the module whose weights the engine samples with (unwrapped from DDP/FSDP's wrappers' callers).
    ``sync_check``: the canary run after every weight load (None: no engine with weights of its own, or off).
    ``ring``: the past weights a training batch samples with (``generation.simulate_staleness``; None: the current).
    """

    def __init__(self, engine: GenerationBackend, policy: nn.Module, sync_check: SyncCheck | None = None,
                 ring: SnapshotRing | None = None, inflight: tuple[bool, int] | None = None,
                 cap: StalenessCap | None = None) -> None:
        self.engine, self.policy, self.sync_check, self.ring = engine, policy, sync_check, ring
        # generation.weight_updates in_flight / partial: (partial, decode steps between landings); None: one version
        self.inflight = inflight
        # A server that takes weights between its decode steps gets each version as soon as the policy has it.
        self.publishes = bool(getattr(engine, "in_flight", False))
        self.cap = cap  # generation.staleness_cap: what becomes of samples whose oldest token is older
        self.dropped: Tensor | None = None  # [B] bool: the last batch's samples over the cap, out of the loss
        self.cap_metrics: dict[str, float] = {}
        self.continuous: ContinuousEngine | None = None  # generation.continuous: the simulator's engine, set by its maker
        self.sampling_version = 0  # the updates of the weights the engine samples with now (the ring's, lagging)
        self.training_version = 0  # the policy's updates when the last training batch was handed out
        self.lags = False  # inside :meth:`lagging`: sampling with the ring's weights of max(t − k, 0) updates
        self.holds_weights = bool(getattr(engine, "holds_weights", False))
        self.sleeps = bool(getattr(engine, "sleeps", False))
        # Level 1 keeps a host copy of weights that never change (LoRA's base); level 2 drops weights that will.
        self.sleep_level = 1 if getattr(engine, "lora", False) else 2
        self.policy_version = 0  # updates the policy has had
        # Updates behind the weights the engine holds: built from the policy's (0), or other ones (-1: load first).
        self.engine_version = 0 if getattr(engine, "starts_current", True) else -1
        self.weights_lost = False  # a level-2 sleep discarded the engine's weights: load them at the next wake
        self._awake = False
        self.check_due = False  # a load the canary has not checked yet (checked before the engine sleeps again)
        # The batches in flight, oldest first: (key, claim, the updates behind the weights that sampled it).
        self.ahead: list[tuple[AheadKey, Callable[[], Samples], int]] = []
        # Each batch's request, to sample a group again (generation.staleness_cap=k with wait): prompts, seeds, settings.
        self.requests: dict[AheadKey, tuple[list[Prompt], list[int] | None, Any]] = {}
        self.batch_version = 0  # the engine's weights that sampled the last batch handed out
        self.last_check: dict[str, float] = {}
        self.timer: Any = None  # the step's timer (``phase(name)`` adds a phase's seconds), set by the trainer
        self.step: int | None = None  # the run's step (or evaluation) sampling now, set by the trainer
        if self.sleeps:
            self._sleep()

    # ------------------------------------------------------------------------------------------ what the trainer says
    def weights_updated(self) -> None:
        """The policy took an optimizer step: the engine gets its weights before it next samples, or at once where
        it takes them in flight (between two decode steps of the batches it is sampling ahead)."""
        self.policy_version += 1
        if self.publishes and self.engine_version >= 0:  # (a first load, -1, is the next wake's, with its canary)
            with self._phase("sync_weights"):
                self.engine.publish_version = self.policy_version
                self.engine.sync_weights(self.policy)
            self.engine_version = self.policy_version

    def weights_loaded(self, updates: int) -> None:
        """The policy's weights were replaced by those after ``updates`` updates (a resume): the engine, built
        before, takes them next."""
        self.policy_version, self.engine_version = updates, -1

    def generate(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, settings: SamplingSettings | None = None) -> Samples:
        """``group_size`` samples per prompt from the policy's current weights (the engine interface's call)."""
        with self.awake():
            self.batch_version = self.engine_version
            if self.check_due and hasattr(self.engine, "generate_probed"):  # the canary rides in this call
                rollout, probe = self.engine.generate_probed(self.sync_check.probe_ids, self.sync_check.settings,
                                                             prompts, group_size, seeds=seeds, greedy=greedy,
                                                             settings=settings)
                if probe is not None:  # else the block's end checks it in a call of its own
                    self._check(probe, settings or self.engine.settings)
                return stamped(rollout, self.sampling_version)
            if self.inflight is None or not self.lags or greedy:
                rollout = self.engine.generate(prompts, group_size, seeds=seeds, greedy=greedy, settings=settings)
                return stamped(rollout, self.sampling_version)
            partial, every = self.inflight
            schedule = InflightSchedule(self.ring, self.sampling_version, self.policy_version, every, partial)
            self.engine.between_steps = schedule
            try:
                rollout = self.engine.generate(prompts, group_size, seeds=seeds, settings=settings)
            finally:
                self.engine.between_steps = None
            return replace(rollout, versions=schedule.token_versions(rollout.response_mask))

    @contextmanager
    def lagging(self) -> Iterator[None]:
        """A training batch: under ``generation.simulate_staleness`` the samples in the block come from the weights
        of max(t − k, 0) updates (the ring's), the weights of now are kept for the next k steps, and older ones
        dropped; without a ring, nothing changes."""
        self.training_version = self.policy_version
        if self.ring is None:
            yield
            return
        self.ring.remember(self.policy_version)
        self.lags = True
        try:
            yield
        finally:
            self.lags = False
            self.ring.forget_before(self.policy_version - self.ring.staleness + 1)

    @contextmanager
    def awake(self) -> Iterator[RolloutWorker]:
        """The engine awake with the policy's current weights for the block (several calls: a multi-turn batch), then
        asleep again; inside :meth:`lagging`, with the ring's past weights (loaded into an engine with weights of
        its own, the policy's own back before it samples; the policy's for the block where the engine samples with
        them). Nested blocks share the outer one's wake."""
        if self._awake:
            yield self
            return
        version = self.ring.behind(self.policy_version) if self.lags else self.policy_version
        self.sampling_version = version
        past = self.ring.weights_of(version, self.policy_version) if version != self.policy_version else nullcontext()
        with ExitStack() as block:
            if self.holds_weights:
                with past:
                    self._wake(version)
            else:
                block.enter_context(past)
                self._wake(version)
            self._awake = True
            try:
                yield self
                if self.check_due:  # no call of the block carried the probe (a batch started ahead, the base model's)
                    self._check()
            finally:
                self._awake = False
                if self.sleeps:
                    self._sleep()

    # ------------------------------------------------------------------------------------------ the batches ahead
    def launch(self, key: AheadKey, prompts: list[Prompt], group_size: int, seeds: list[int] | None,
               settings: SamplingSettings | None) -> None:
        """Start sampling a later step's batch with the policy's current weights; :meth:`take` with the same ``key``
        returns it. Several may be in flight (``generation.max_staleness=k``: the next k steps' batches)."""
        with self.awake():
            claim = self.engine.submit(prompts, group_size, seeds=seeds, settings=settings)
            version = self.sampling_version
        self.ahead.append((key, claim, version))
        self.requests[key] = (list(prompts), seeds, settings)

    def take(self, key: AheadKey) -> Samples | None:
        """The batch started ahead for ``key``, or None: none in flight for it (an evaluation's prompts, a step the
        run did not launch); the others stay for their own steps. Under ``generation.staleness_cap`` its samples
        whose oldest token is older are dropped (:attr:`dropped`) or sampled again now (``wait``)."""
        self.dropped, self.cap_metrics = None, {}
        for index, (held_key, claim, version) in enumerate(self.ahead):
            if held_key == key:
                del self.ahead[index]
                self.batch_version = version
                rollout = stamped(claim(), version)
                request = self.requests.pop(key, None)
                return rollout if self.cap is None else self._capped(rollout, request)
        return None

    def _capped(self, rollout: Samples, request: tuple[list[Prompt], list[int] | None, Any] | None) -> Samples:
        """``generation.staleness_cap`` on a batch taken now: a group with a sample whose oldest token is more than
        the cap behind the policy is dropped (out of the loss) or, under ``wait``, sampled again with the weights
        of now (the trainer waits for it)."""
        over = self.cap.over(rollout, self.policy_version)
        share = float(over.float().mean()) if over.numel() else 0.0
        if not bool(over.any()):
            self.cap_metrics = {"rollout/stale_dropped_frac": 0.0, "rollout/stale_waited_frac": 0.0}
            return rollout
        if self.cap.wait and request is not None:
            self.cap_metrics = {"rollout/stale_dropped_frac": 0.0, "rollout/stale_waited_frac": share}
            prompts, seeds, settings = request
            return self.cap.resampled(rollout, over, prompts, seeds, lambda p, s: self.generate(
                p, rollout.group_size, seeds=s, settings=settings), self.engine.tokenizer.pad_token_id)
        self.cap_metrics = {"rollout/stale_dropped_frac": share, "rollout/stale_waited_frac": 0.0}
        self.dropped = over
        return rollout

    def take_groups(self, count: int) -> tuple[list[Group], Samples]:
        """``generation.continuous``: the ``count`` groups that completed first and their samples, for the policy of
        now, then the engine's ticks while the trainer updates. Under ``generation.staleness_cap`` a group with a
        sample whose oldest token is older is dropped (out of the loss, :attr:`dropped`) or, under ``wait``, sampled
        again from now while the trainer waits."""
        engine = self.continuous
        self.training_version, self.dropped, self.cap_metrics = self.policy_version, None, {}
        with self.awake():  # a server's first groups sample the policy's weights (loaded, and checked, first)
            groups = engine.take(count)
        rollout = engine.samples(groups)
        if self.cap is not None:
            over = self.cap.over(rollout, self.policy_version)
            share = float(over.float().mean())
            waits = self.cap.wait and share > 0
            self.cap_metrics = {"rollout/stale_dropped_frac": 0.0 if waits else share,
                                "rollout/stale_waited_frac": share if waits else 0.0}
            if waits:
                stale = over.view(-1, rollout.group_size)[:, 0].nonzero().flatten().tolist()
                for place, fresh in zip(stale, engine.again([groups[g] for g in stale]), strict=True):
                    groups[place] = fresh
                rollout = engine.samples(groups)
            elif share > 0:
                self.dropped = over
        engine.run(engine.every)
        return groups, rollout

    def settle(self) -> None:
        """The batches in flight are in and kept for their steps (before an evaluation or a checkpoint; an engine
        answers its requests in order)."""
        self.ahead = [(key, _held(claim()), version) for key, claim, version in self.ahead]

    def state(self) -> list[list[dict[str, Any]]]:
        """Every rank's batches in flight (settled), as plain fields and CPU tensors, for rank 0 to write."""
        self.settle()
        mine = [{**_rollout_state(key, claim(), version), "request": list(self.requests.get(key, (None, None))[:2])}
                for key, claim, version in self.ahead]
        return distributed.gather_objects([mine])

    def load_state(self, states: list[list[dict[str, Any]]] | None, device: torch.device) -> None:
        """Resume: this rank's batches in flight, which the next steps train on (nothing when the checkpoint has
        none: those steps sample afresh)."""
        if not states or len(states) != distributed.world_size():
            return
        for held in states[distributed.rank()]:
            key, values = held["key"], held["rollout"]
            names = {f.name for f in fields(Samples)}  # a checkpoint's batch may carry fields a Samples has not
            rollout = Samples(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()
                                 if k in names})
            # A checkpoint from before versions were kept: sampled one update behind (max_staleness=1).
            version = int(held.get("version", self.policy_version - 1))
            held_key = (tuple(key[0]), int(key[1]), tuple(key[2]))
            self.ahead.append((held_key, _held(rollout), version))
            prompts, seeds = held.get("request") or (None, None)
            if prompts is not None:  # its prompts as the engine got them, should a group be sampled again
                self.requests[held_key] = (list(prompts), seeds, None)

    # ------------------------------------------------------------------------------------------ the lifecycle
    def _wake(self, version: int) -> None:
        """Awake with the policy's weights, which are those of ``version`` updates (the ring's inside :meth:`lagging`)."""
        if self.sleeps:
            _empty_cache()
            self.engine.wake_up(tags=["weights"])
        load = self.holds_weights and (self.weights_lost or self.engine_version != version)
        if load:
            with self._phase("sync_weights"):
                if self.publishes:
                    self.engine.publish_version = version
                self.engine.sync_weights(self.policy)
            self.engine_version, self.weights_lost = version, False
        if self.sleeps:
            _empty_cache()  # the load's gathered and staged tensors went back to torch's cache: returned first
            self.engine.wake_up(tags=["kv_cache"])
        # The canary samples after the cache is back: as one more request of the block's first batch where the
        # engine takes one (no engine call of its own), else in a call of its own before the engine sleeps again.
        self.check_due = self.check_due or (load and self.sync_check is not None)
        if self.check_due and version != self.policy_version:  # a past policy's weights: checked while the policy
            self._check()  # holds them (generation.simulate_staleness), not in the batch's call

    def _check(self, probe: Samples | None = None, sampled: SamplingSettings | None = None) -> None:
        """The weight-sync canary of the last load, on the engine's ``probe`` rollout (None: sampled here) that rode
        in a batch sampled with ``sampled``."""
        self.check_due = False
        with self._phase("sync_check"):
            if probe is None:
                self.last_check = self.sync_check(self.engine, self.policy, self.engine_version, step=self.step)
            else:
                self.last_check = self.sync_check.judge(probe, self.policy, self.engine_version, sampled.temperature,
                                                        step=self.step, top_k=sampled.top_k, top_p=sampled.top_p)

    def _phase(self, name: str) -> AbstractContextManager:
        return self.timer.phase(name) if self.timer is not None else nullcontext()

    def _sleep(self) -> None:
        self.engine.sleep(level=self.sleep_level)
        self.weights_lost = self.sleep_level == 2

    def adapter_off(self) -> AdapterOff:
        """This worker sampling the base model (the adapter off: a LoRA policy's reference), through the same engine
        and lifecycle (``engine.samples_base``: vLLM with an adapter)."""
        return AdapterOff(self)

    def metrics(self) -> dict[str, float]:
        """``rollout/weight_sync_diff`` (the last canary's max |Δ log-prob|) and ``rollout/weight_version`` (the updates
        behind the engine's weights that sampled the last batch handed out), where the engine holds weights of its
        own; under ``generation.staleness_cap``, the share of the last batch taken that was over it
        (``rollout/stale_dropped_frac``, ``rollout/stale_waited_frac``)."""
        if self.continuous is not None:
            return {**self.continuous.metrics(), **self.cap_metrics}
        if not self.holds_weights:
            return dict(self.cap_metrics)
        return {"rollout/weight_version": float(self.batch_version), **self.last_check, **self.cap_metrics}


def _empty_cache() -> None:
    """torch's cached GPU blocks returned to the device before a wake, so the engine can map its memory again."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class AdapterOff:
    """What an experience maker needs of a worker, sampling the engine's base weights (see
    :meth:`RolloutWorker.adapter_off`): the evaluation's win rate against the reference."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker, self.engine = worker, worker.engine

    def generate(self, prompts: list[Prompt], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False, settings: SamplingSettings | None = None) -> Samples:
        with self.worker.awake():
            return self.engine.generate(prompts, group_size, seeds=seeds, greedy=greedy, settings=settings,
                                        adapter=False)

    def awake(self) -> AbstractContextManager:
        return self.worker.awake()

    def take(self, key: AheadKey) -> None:
        """No batch is ever started ahead for the reference."""
        return None


def stamped(rollout: Samples, version: int) -> Samples:
    """The engine's samples with each token's version: ``version`` for every token where the engine recorded none."""
    if rollout.versions is not None:
        return rollout
    return replace(rollout, versions=batch_versions(rollout.response_mask, version))


def _held(rollout: Samples) -> Callable[[], Samples]:
    return lambda: rollout


def _rollout_state(key: AheadKey, rollout: Samples, version: int) -> dict[str, Any]:
    """A batch just generated: its tensors (on the CPU) and sizes; what later passes add to it is not there yet."""
    kept: dict[str, Any] = {}
    for field_ in fields(rollout):
        value = getattr(rollout, field_.name)
        if isinstance(value, Tensor):
            kept[field_.name] = value.detach().cpu()
        elif isinstance(value, int) and not isinstance(value, bool):
            kept[field_.name] = value
    return {"key": [list(key[0]), key[1], list(key[2])], "rollout": kept, "version": version}
