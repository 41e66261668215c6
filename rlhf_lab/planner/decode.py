"""The decode of a planned step (:mod:`rlhf_lab.planner.step`) on fake tensors: a few steps run, the rest
extrapolated.

A decode of ``trainer.max_new_tokens`` steps on fake tensors would take as long as the real one's Python; its memory
and FLOPs are read from a few steps instead. ``phases`` is the step's ``_Phases``: its tracker (``memory``: the
phase's peak, ``start_phase``, ``current``), its FLOP count, its real-index mode (``indices``, which ends the decode
after a number of draws) and ``extra_generation_flops``.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch

from rlhf_lab.scoring.head import HeadLogits

# Decode steps run on fake tensors, then twice as many in a second decode; the rest are extrapolated. Two decodes, not
# one read at its third draw: a decode's peak can come after its last draw (the rollout's assembly, whose size grows
# with the steps), and only a whole decode's peak holds it.
DECODE_STEPS = 3


def planned_decode(engine: Any, prompts: list[list[int]], group: int, phases: Any, response_tokens: int) -> Any:
    """The engine's rollout of ``response_tokens`` per row. On fake tensors the decode stops early, the rollout is
    extended to full length (:func:`extend_rollout`), and what the steps not run would add is extrapolated from
    those run: their FLOPs from the last ones (a step's FLOPs grow linearly with its context), their memory from
    the decode's peak at ``DECODE_STEPS`` and at twice as many steps (its key/value cache and kept logits are
    allocated for every step at the first; whatever still grows per step, a kept autograd graph or a cache copied
    at every step, grows linearly to ``response_tokens``)."""
    if phases.indices is None or response_tokens <= DECODE_STEPS:
        return engine.generate(prompts, group)
    memory, steps = phases.memory, DECODE_STEPS
    if memory is not None and response_tokens > 2 * DECODE_STEPS:
        origin, before = memory.current(), phases.total_flops()
        short = _decode_growth(engine, prompts, group, phases, DECODE_STEPS)
        phases.extra_generation_flops -= phases.total_flops() - before  # not the step's: a measure
        steps = 2 * DECODE_STEPS
    counts: list[int] = []
    start = memory.start_phase() if steps > DECODE_STEPS else 0
    with phases.indices.draws(steps, lambda: counts.append(phases.total_flops())):
        rollout = engine.generate(prompts, group)
    if steps > DECODE_STEPS:
        grown = memory.phase_peak - start
        per_step = max(0, grown - short) / DECODE_STEPS
        memory.phase_peak = origin + grown + int(per_step * (response_tokens - steps))
    if phases.flop_counter is not None and len(counts) == steps:
        first, second = counts[-2] - counts[-3], counts[-1] - counts[-2]  # the last two steps
        growth, remaining = second - first, response_tokens - steps
        # steps ``steps`` .. response_tokens - 1: the last measured step's FLOPs plus the growth per step
        phases.extra_generation_flops += remaining * second + growth * remaining * (remaining + 1) // 2
    return extend_rollout(rollout, response_tokens, phases.indices.token_id)


def _decode_growth(engine: Any, prompts: list[list[int]], group: int, phases: Any, steps: int) -> int:
    """Bytes the decode's peak adds over what is live before it, at ``steps`` steps (its rollout then dropped)."""
    start = phases.memory.start_phase()
    with phases.indices.draws(steps, lambda: None):
        rollout = engine.generate(prompts, group)
    grown = phases.memory.phase_peak - start
    del rollout
    gc.collect()
    return grown


def extend_rollout(rollout: Any, width: int, token_id: int) -> Any:
    """``rollout`` with its response part extended to ``width`` tokens, all valid: sampled ``token_id``, per-token
    values of zeros (new tensors like the engine's), the kept logits as the whole buffer the decode wrote into."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    rows, short = rollout.response_mask.shape
    extra = width - short
    longer: dict[str, Any] = {}
    with unset_fake_temporarily():  # the bookkeeping stays real
        longer["input_ids"] = torch.cat([rollout.input_ids, rollout.input_ids.new_full((rows, extra), token_id)], 1)
        longer["attention_mask"] = torch.cat([rollout.attention_mask, rollout.attention_mask.new_ones(rows, extra)], 1)
        longer["response_mask"] = torch.cat([rollout.response_mask, rollout.response_mask.new_ones(rows, extra)], 1)
    for item in dataclasses.fields(rollout):
        value = getattr(rollout, item.name)
        if isinstance(value, HeadLogits):  # kept as the LM head's inputs: those of every step
            hidden = value.hidden
            longer[item.name] = dataclasses.replace(value, hidden=torch.cat(
                [hidden, hidden.new_zeros(rows, extra, *hidden.shape[2:])], 1))
            continue
        if item.name in longer or not isinstance(value, torch.Tensor):
            continue
        if value.dim() < 2 or value.shape[:2] != (rows, short):
            continue
        base = value._base
        if base is not None and base.shape[0] == rows and base.shape[1] == width and base.shape[2:] == value.shape[2:]:
            longer[item.name] = base  # the decode's buffer for every step (kept logits)
        else:
            longer[item.name] = torch.cat([value, value.new_zeros(rows, extra, *value.shape[2:])], 1)
    return dataclasses.replace(rollout, **longer)
