"""``generation.simulate_staleness``: the last k policies' weights on the host, so a colocated engine samples step
t's own prompts with the weights of max(t − k, 0) updates.

An asynchronous trainer's sampler lags because it runs beside the trainer; an engine that shares the trainer's device
(``hf``, colocated ``vllm``) cannot, so this ring keeps what it would have sampled with: a snapshot of the trainable
weights (every weight under full fine-tuning, the adapter's alone under LoRA, whose base never changes) taken each
time the worker samples a training batch, the newest k kept. The rollout worker
(:mod:`rlhf_lab.generation.worker`) stays the one owner of loads, wakes and sleeps: it asks :meth:`SnapshotRing.
weights_of` for a block in which the policy module holds an old snapshot (the ``hf`` engine samples inside it; an
engine with weights of its own takes them inside it) and the current weights come back at its end, bit for bit.
A checkpoint holds the ring (:data:`RING_FILE`), so a resumed run samples with the weights the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.errors import CheckpointError

RING_FILE = "staleness_ring.safetensors"  # in a checkpoint: "{updates}/{parameter name}" -> the snapshot's tensor


class SnapshotRing:
    """The trainable weights after each of the last ``staleness`` updates that sampled a training batch, on the host.

    ``policy``: the module the engine samples with (unwrapped); its parameters that require a gradient are the ones
    an update changes and the ones kept (k × the trainable weights' bytes in host memory).
    """

    def __init__(self, policy: nn.Module, staleness: int) -> None:
        self.policy, self.staleness = policy, staleness
        self.snapshots: dict[int, dict[str, Tensor]] = {}  # updates -> parameter name -> a host copy

    def trainable(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.policy.named_parameters() if p.requires_grad}

    def behind(self, updates: int) -> int:
        """The updates of the weights that sample a training batch when the policy has had ``updates``."""
        return max(updates - self.staleness, 0)

    def remember(self, updates: int) -> None:
        """Keep the policy's weights of now (after ``updates`` updates), once per version."""
        if updates not in self.snapshots:
            self.snapshots[updates] = {name: p.detach().to("cpu", copy=True) for name, p in self.trainable().items()}

    def forget_before(self, updates: int) -> None:
        """Drop the snapshots older than ``updates`` (no later step samples with them)."""
        for version in [v for v in self.snapshots if v < updates]:
            del self.snapshots[version]

    @contextmanager
    def weights_of(self, updates: int, current: int) -> Iterator[None]:
        """The policy holds the snapshot of ``updates`` for the block, and its weights of ``current`` (remembered
        first) again after it."""
        self.remember(current)
        self._load(self.snapshots[updates])
        try:
            yield
        finally:
            self._load(self.snapshots[current])

    def load(self, version: int) -> None:
        """The policy holds the snapshot of ``version`` updates (inside :meth:`weights_of`: a newer weight update
        landing mid-generation, :mod:`rlhf_lab.generation.inflight`; the block's end puts the current back)."""
        self._load(self.snapshots[version])

    @torch.no_grad()
    def _load(self, snapshot: dict[str, Tensor]) -> None:
        for name, parameter in self.trainable().items():
            parameter.copy_(snapshot[name])

    def state(self) -> dict[str, Tensor]:
        """The snapshots as one flat mapping for a safetensors file (``"{updates}/{name}"``)."""
        return {f"{version}/{name}": tensor.contiguous() for version, snapshot in self.snapshots.items()
                for name, tensor in snapshot.items()}

    def load_state(self, tensors: dict[str, Tensor], updates: int, where: str) -> None:
        """:meth:`state` read back from the checkpoint ``where`` of the policy after ``updates`` updates; a one-line
        error where it lacks a snapshot the next k steps sample with (a checkpoint written without the ring)."""
        self.snapshots = {}
        for key, tensor in tensors.items():
            version, name = key.split("/", 1)
            self.snapshots.setdefault(int(version), {})[name] = tensor
        needed = sorted({self.behind(u) for u in range(updates, updates + self.staleness)} - {updates})
        missing = [version for version in needed if version not in self.snapshots]
        if missing:
            raise CheckpointError(
                f"{where} holds no snapshot of the weights after {', '.join(map(str, missing))} update(s), which "
                f"generation.simulate_staleness=true with generation.max_staleness={self.staleness} samples the next "
                "steps with (it was written without generation.simulate_staleness): resume it with "
                "generation.simulate_staleness=false")


def snapshot_ring(cfg: Any, policy: nn.Module) -> SnapshotRing | None:
    """The ring of a run with ``generation.simulate_staleness=true`` (k = ``generation.max_staleness``), else None."""
    generation = cfg.get("generation") or {}
    if not generation.get("simulate_staleness", False):
        return None
    return SnapshotRing(policy, int(generation.get("max_staleness", 0)))


def ring_files(ring: SnapshotRing | None) -> dict[str, dict[str, Tensor]]:
    """The checkpoint's file of the ring's snapshots (none without a ring)."""
    return {RING_FILE: ring.state()} if ring is not None else {}
