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

from typing import Any

import torch
from torch import Tensor

from rlhf_lab.generation.staleness import SnapshotRing

WEIGHT_UPDATES = ("batch", "in_flight", "partial")


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
