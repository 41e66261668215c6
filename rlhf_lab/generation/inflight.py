"""Weight updates that land while a batch is being sampled (``generation.weight_updates``), simulated exactly on one
process with a scripted clock.

An asynchronous trainer's engine keeps sampling while the trainer trains, and takes each new version of the weights
as it is published: **in flight** (vLLM's and PipelineRL's: between two decode steps, the requests in progress go on
with the key/value cache the older weights computed) or as a **partial rollout** (verl's, SkyRL's: the requests are
paused at the update and resumed with their tokens kept, the cache recomputed with the new weights). A response's
tokens then come from several policy versions, and the long responses — still decoding when more updates land —
span the most.

The simulator gives each batch that history deterministically. Under ``generation.simulate_staleness`` the training
batch of the policy after t updates starts sampling with the weights of t − k (the ring's,
:mod:`rlhf_lab.generation.staleness`), and the scripted clock lands one newer version every
``generation.update_every_tokens`` decode steps, up to t: the token sampled at decode step s comes from the weights
of min(t − k + ⌊s / N⌋, t). The engine records each token's version (``Samples.versions``), so the corrections read
each token's own sampler log-prob. ``batch`` (the default) keeps one version per batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rlhf_lab.generation.rollout import Samples, concat_rollouts
from rlhf_lab.generation.staleness import SnapshotRing

WEIGHT_UPDATES = ("batch", "in_flight", "partial")
OVER_CAP = ("drop", "wait")  # generation.over_cap: what becomes of a sample over generation.staleness_cap


class InflightSchedule:
    """The scripted clock of one generation call: the decode's ``between_steps`` hook
    (:func:`~rlhf_lab.generation.decode.decode`), loading each newer version into the policy as it lands.

    ``start``: the weights' version at the first step; ``current``: the newest there is (the trainer's); a version
    lands every ``every`` steps; ``partial``: the decode recomputes its cache at each landing."""

    def __init__(self, ring: SnapshotRing, start: int, current: int, every: int, partial: bool) -> None:
        self.ring, self.start, self.current, self.every, self.partial = ring, start, current, every, partial
        self.loaded = start
        self.ring.load(start)  # a second call of the same block starts from the first version again
        self.versions = [start]  # the version of the token each step samples

    def __call__(self, step: int) -> bool:
        target = min(self.start + step // self.every, self.current)
        self.versions.append(target)
        if target == self.loaded:
            return False
        self.ring.load(target)
        # Under autocast the decode's casts of the weights are cached for the whole region, keyed by the tensor, not
        # its values: without this the steps after the landing would run on the casts of the older weights.
        torch.clear_autocast_cache()
        self.loaded = target
        return self.partial

    def token_versions(self, response_mask: Tensor) -> Tensor:
        """[B, T] long: each sampled token's version, 0 off the response."""
        steps = torch.tensor(self.versions[: response_mask.shape[1]], dtype=torch.long, device=response_mask.device)
        return steps[None, :].expand_as(response_mask) * (response_mask > 0)


def inflight_settings(cfg: Any) -> tuple[bool, int] | None:
    """(partial, tokens between updates) of ``generation.weight_updates`` in flight or partial; None for ``batch``."""
    generation = cfg.get("generation") or {}
    mode = generation.get("weight_updates", "batch")
    if mode == "batch":
        return None
    return mode == "partial", int(generation.get("update_every_tokens", 0))


def batch_versions(response_mask: Tensor, version: int) -> Tensor:
    """[B, T] long: every token of the batch sampled by the weights of ``version`` updates, 0 off the response."""
    return (response_mask > 0).long() * version


class StalenessCap:
    """``generation.staleness_cap=c`` (verl's ``max_off_policy_threshold``, prime-rl's ``max_off_policy_steps``): a
    batch taken by the trainer after t updates holds a sample over the cap where its oldest token was sampled by
    weights of fewer than t − c updates. Its whole group (the group's baseline needs every sample) is dropped (out of
    the loss and its token count, ``drop``) or sampled again with the weights of now while the trainer waits
    (``wait``)."""

    def __init__(self, cap: int, wait: bool) -> None:
        self.cap, self.wait = cap, wait

    def over(self, rollout: Samples, policy_version: int) -> Tensor:
        """[B] bool: the samples of groups with a sample over the cap."""
        mask = rollout.response_mask > 0
        versions = rollout.versions if rollout.versions is not None else torch.zeros_like(mask, dtype=torch.long)
        over = (policy_version - oldest_versions(versions, mask, policy_version)) > self.cap
        return over.view(-1, rollout.group_size).any(-1).repeat_interleave(rollout.group_size)

    def resampled(self, rollout: Samples, over: Tensor, prompts: list[Any], seeds: list[int] | None,
                  sample: Callable[[list[Any], list[int] | None], Samples], pad_token_id: int) -> Samples:
        """The batch with its groups over the cap sampled again by ``sample(prompts, seeds)``, in their places."""
        groups = over.view(-1, rollout.group_size)[:, 0].nonzero().flatten().tolist()
        fresh = sample([prompts[g] for g in groups], None if seeds is None else [seeds[g] for g in groups])
        kept = (~over).nonzero().flatten()
        stale = over.nonzero().flatten()
        parts = [rollout.select(kept), fresh] if kept.numel() else [fresh]
        joined = concat_rollouts(parts, pad_token_id)
        return joined.select(torch.argsort(torch.cat([kept, stale])).to(joined.response_mask.device))


def staleness_cap(cfg: Any) -> StalenessCap | None:
    """The cap of ``generation.staleness_cap`` (None: no cap)."""
    generation = cfg.get("generation") or {}
    cap = generation.get("staleness_cap")
    if cap is None:
        return None
    return StalenessCap(int(cap), generation.get("over_cap", "drop") == "wait")


def oldest_versions(versions: Tensor, mask: Tensor, empty: int) -> Tensor:
    """[B]: each sample's oldest token's version (its stalest), over the tokens of ``mask``; ``empty`` for a sample
    with none."""
    return torch.where(mask, versions, torch.full_like(versions, empty)).amin(-1)
