"""The planned decode (rlhf_lab/planner/decode.py): a few steps run on fake tensors, the rest extrapolated. Against a
stand-in decode whose step t (from 1) holds ``BASE + GROWTH·t`` bytes more than before it and costs ``a + b·t``
FLOPs: the plan's generation peak and FLOPs are those of the full-length decode, by hand, and the measuring decode
(the short one) counts in neither."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from rlhf_lab.planner import decode as planned

BASE, GROWTH, A, B = 1000, 10, 50, 4
ORIGIN = 7000  # live before the decode


class Tracker:
    """The planner's memory tracker's contract: ``current``, ``start_phase`` (the peak starts at what is live) and
    ``phase_peak``."""

    def __init__(self) -> None:
        self.live = ORIGIN
        self.phase_peak = ORIGIN

    def current(self) -> int:
        return self.live

    def start_phase(self) -> int:
        self.phase_peak = self.live
        return self.live


class Phases:
    def __init__(self) -> None:
        self.memory, self.flops, self.extra_generation_flops = Tracker(), 0, 0
        self.flop_counter = object()
        self.indices = self
        self.token_id, self.draws_left, self.on_draw = 5, None, None

    def total_flops(self) -> int:
        return self.flops

    @contextmanager
    def draws(self, count, on_draw):
        self.draws_left, self.on_draw = count, on_draw
        yield
        self.draws_left = self.on_draw = None


class Engine:
    """Decodes until the phases' draws run out: step t holds BASE + GROWTH·t bytes at its peak, costs A + B·t."""

    def __init__(self, phases: Phases, growth: int = GROWTH) -> None:
        self.phases, self.growth, self.lengths = phases, growth, []

    def generate(self, prompts, group):
        phases, step = self.phases, 0
        while phases.draws_left:
            step += 1
            phases.flops += A + B * step
            phases.memory.phase_peak = max(phases.memory.phase_peak, phases.memory.live + BASE + self.growth * step)
            phases.draws_left -= 1
            phases.on_draw()
        self.lengths.append(step)
        return step


@pytest.mark.parametrize("response", [20, 64])
def test_memory_and_flops_that_grow_per_step_are_extrapolated_to_full_length(monkeypatch, response) -> None:
    monkeypatch.setattr(planned, "extend_rollout", lambda rollout, width, token: (rollout, width))
    phases = Phases()
    engine = Engine(phases)
    assert planned.planned_decode(engine, [[1, 2]], 2, phases, response) == (2 * planned.DECODE_STEPS, response)
    assert engine.lengths == [planned.DECODE_STEPS, 2 * planned.DECODE_STEPS]  # the measure, then the step's
    assert phases.memory.phase_peak == ORIGIN + BASE + GROWTH * response
    full = sum(A + B * t for t in range(1, response + 1))
    assert phases.flops + phases.extra_generation_flops == full


def test_a_decode_that_does_not_grow_is_planned_at_its_first_steps_memory(monkeypatch) -> None:
    monkeypatch.setattr(planned, "extend_rollout", lambda rollout, width, token: rollout)
    phases = Phases()
    planned.planned_decode(Engine(phases, growth=0), [[1]], 1, phases, 40)
    assert phases.memory.phase_peak == ORIGIN + BASE


def test_a_short_decode_runs_whole() -> None:
    phases = Phases()
    phases.draws_left = None
    engine = Engine(phases)
    engine.generate = lambda prompts, group: "whole"
    assert planned.planned_decode(engine, [[1]], 1, phases, planned.DECODE_STEPS) == "whole"
