"""A trainer's real step, measured as the planner counts it: what ``rlhf-lab plan``'s prediction is checked against.

:func:`measured_step` runs ``Trainer.train_step`` on real tensors under torch's ``MemTracker`` (the bytes of every
live tensor storage, what a device allocator's peak counts) and returns its peak with the prompt width its batch had
(the planner's ``prompt_tokens`` for the same step). :func:`prompt_widths` records those widths for a measurement of
one's own (a GPU's ``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def prompt_widths(trainer: Any) -> Iterator[list[int]]:
    """Within the block, the prompt width of every batch ``trainer`` makes, in order."""
    widths: list[int] = []
    experience = trainer.experience
    make = experience.make

    def recorded(*args: Any, **kwargs: Any) -> Any:
        made = make(*args, **kwargs)
        widths.append(made.rollout.prompt_width)
        return made

    experience.make = recorded
    try:
        yield widths
    finally:
        del experience.make  # the class's method again


def measured_step(trainer: Any, step: int) -> tuple[int, int]:
    """(bytes at the peak of ``trainer.train_step(step)``, its batch's prompt width). Measure a step after the first,
    whose optimizer state exists, as the planner plans it."""
    from rlhf_lab.planner.fake import StepMemory

    with prompt_widths(trainer) as widths, StepMemory() as memory:
        memory.track_external(trainer.models.policy, trainer.models.reference, trainer.updater.optimizer)
        memory.start_phase()
        trainer.train_step(step)
    return memory.phase_peak, widths[0]
