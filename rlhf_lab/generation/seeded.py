"""Seeded sampling in one batched decode: one random stream per prompt group (``trainer.seed_per_prompt``).

A group's samples depend only on its seed, not on which prompts share its batch or its rank. Each group draws
from its own stream: the generator ``torch.manual_seed(seed)`` would give (a ``torch.Generator`` per group for
``torch.multinomial``; for a hardware profile's own draw function, the process's generator state swapped in and
out per group). The draws are then those of decoding each group alone with that seed, so the samples are the same
wherever the batched forward pass gives the group's probabilities bit for bit (in float32 on the CPU for the tiny
model: tests/unit/test_seeded_sampling.py); where a kernel rounds a wider batch otherwise (other padding, other
matmul blocking), a draw on the edge between two tokens can differ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf_lab.generation.decode import multinomial


class SeededDraws:
    """A draw function over [groups × group_size, V] probabilities that takes each group's tokens from its own
    seeded stream (one per seed, in batch order)."""

    def __init__(self, sample: Callable[[Tensor], Tensor], seeds: list[int], group_size: int,
                 device: torch.device) -> None:
        self.sample, self.group_size, self.device = sample, group_size, device
        self.cuda = device.type == "cuda"
        if sample is multinomial:
            self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
            return
        self.generators = []
        self.states = []
        with torch.random.fork_rng(devices=[device] if self.cuda else []):
            for seed in seeds:
                torch.manual_seed(seed)
                self.states.append(self._state())

    def _state(self) -> tuple[Tensor, Tensor | None]:
        return torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None

    def _set_state(self, state: tuple[Tensor, Tensor | None]) -> None:
        torch.set_rng_state(state[0])
        if self.cuda:
            torch.cuda.set_rng_state(state[1], self.device)

    def __call__(self, probs: Tensor) -> Tensor:
        groups = probs.split(self.group_size)
        if self.generators:
            return torch.cat([torch.multinomial(group, num_samples=1, generator=generator).squeeze(1)
                              for group, generator in zip(groups, self.generators, strict=True)])
        tokens = []
        with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
            for index, group in enumerate(groups):
                self._set_state(self.states[index])
                tokens.append(self.sample(group))
                self.states[index] = self._state()
        return torch.cat(tokens)
