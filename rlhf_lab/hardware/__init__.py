"""Hardware profiles (config group ``hardware``): tuning that pays on one kind of machine, opt-in for the run.

``hardware=default`` is the plain path: PyTorch and transformers as they come, the same code on CPU and CUDA.
``hardware=cpu_tuned`` turns on the pieces measured to pay on small CPUs (the embedded default on a laptop; the
figures, and the pieces measured and deleted, are in the docs' hardware guide). Each piece is one field of the
profile, so an ablation is one override (``hardware=cpu_tuned hardware.fast_draws=false``):

==========================  ===============================================================================
``keep_freed_heap``          glibc keeps freed memory for the next step (:mod:`~rlhf_lab.hardware.allocator`)
``row_chunk``                rows per [rows, V] float32 chunk of the log-prob and KL passes (0: the plain 1024)
``fast_draws``               multinomial's draws computed only where a token can win (:mod:`.fast_draws`)
``generation_weights``       merged / cast / packed weights for the decode (:mod:`.generation_weights`)
``recompute``                ``trainer.recompute: null`` recomputes both norms and the MLP under full fine-tuning
``preallocate_optimizer``    AdamW's moments made before the first generation (:mod:`.allocator`)
==========================  ===============================================================================

Nothing here runs at import. The trainer builds a :class:`HardwareProfile` from ``cfg.hardware`` and applies it
for the run it starts: :meth:`HardwareProfile.apply_process_settings` before anything loads,
:meth:`~HardwareProfile.running` around the run, the hooks below at their one point of the step. On a device
other than the CPU every CPU piece is off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor, nn

from rlhf_lab.config.schema_run import HardwareConfig
from rlhf_lab.scoring.draws import multinomial
from rlhf_lab.scoring.logprobs import rows_per_chunk


@dataclass
class HardwareProfile(HardwareConfig):
    """The pieces of CPU tuning a run uses (all off: the plain path), as ``cfg.hardware`` types them
    (:class:`~rlhf_lab.config.schema_run.HardwareConfig`); see the module's text."""

    @classmethod
    def from_config(cls, hardware_cfg: Any, device: torch.device | None = None) -> HardwareProfile:
        """The profile ``cfg.hardware`` describes, for a run on ``device``: on a device other than the CPU the
        CPU pieces are off (the profile keeps its name)."""
        values = {f.name: hardware_cfg.get(f.name, f.default) for f in fields(cls)} if hardware_cfg else {}
        profile = cls(**values)
        if device is not None and device.type != "cpu" and profile.tunes():
            profile = replace(cls(), name=profile.name)
        return profile

    def tunes(self) -> bool:
        """Whether any piece is on."""
        plain = HardwareProfile()
        return any(getattr(self, f.name) != getattr(plain, f.name) for f in fields(self) if f.name != "name")

    # ------------------------------------------------------------------ the process, before anything loads
    def apply_process_settings(self) -> dict[str, bool]:
        """Set what the profile asks of the process (glibc's heap, unless the environment sets glibc's own
        switches); returns which took effect. Call it before the run allocates its first tensors."""
        if not self.keep_freed_heap:
            return {}
        from rlhf_lab.hardware.allocator import keep_freed_heap

        return {"keep_freed_heap": keep_freed_heap()}

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around a run: the row chunk of the log-prob and KL passes."""
        with rows_per_chunk(self.row_chunk) if self.row_chunk else nullcontext():
            yield

    # ------------------------------------------------------------------ the hooks of a step
    @property
    def sample(self) -> Callable[[Tensor], Tensor]:
        """The decode loop's draw: multinomial's, or the same draws computed where a token can win."""
        if self.fast_draws:
            from rlhf_lab.hardware.fast_draws import sample_tokens

            return sample_tokens
        return multinomial

    def decode_weights(self, model: nn.Module, rows: int | None = None) -> AbstractContextManager:
        """Around a generation: the decode's prepared weights (see :mod:`rlhf_lab.hardware.generation_weights`)."""
        if not self.generation_weights:
            return nullcontext(0)
        from rlhf_lab.hardware.generation_weights import generation_weights

        return generation_weights(model, rows=rows)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Before the first generation: AdamW's moments made where the heap will keep them (``preallocate_optimizer``)."""
        if self.preallocate_optimizer:
            from rlhf_lab.hardware.allocator import preallocate_adam_state

            preallocate_adam_state(optimizer)


def describe(profile: HardwareProfile) -> str:
    """One line naming the profile and the pieces it has on (for the console and the bench)."""
    plain = HardwareProfile()
    on = [f.name for f in fields(profile) if f.name != "name" and getattr(profile, f.name) != getattr(plain, f.name)]
    return f"hardware={profile.name}" + (f" ({', '.join(on)})" if on else "")
