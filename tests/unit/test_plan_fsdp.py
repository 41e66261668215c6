"""The N-rank plan under FSDP: the step sharded over torch's fake process group, counted by torch's FSDPMemTracker."""

from __future__ import annotations

import pytest

from rlhf_lab.planner import fake
from rlhf_lab.planner.step import plan_step
from rlhf_lab.runtime.precision import Precision

TINY = ["model=tiny", "trainer.precision=fp32", "trainer.prompts_per_step=4", "algorithm.group_size=2",
        "trainer.max_new_tokens=4", "data.max_prompt_tokens=16", "trainer.strategy=fsdp"]


def test_two_fsdp_ranks_are_planned_with_torchs_fsdp_tracker(compose, tiny_tokenizer, monkeypatch) -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    used = []
    tracker = fake.FSDPStepMemory

    class Recorded(tracker):
        def __init__(self, *args) -> None:
            used.append(args[0])
            super().__init__(*args)

    monkeypatch.setattr(fake, "FSDPStepMemory", Recorded)
    cfg = compose(TINY)
    precision = Precision("fp32", "cpu")
    one = plan_step(cfg, tiny_tokenizer, precision)
    two = plan_step(cfg, tiny_tokenizer, precision, world_size=2, fsdp=True)
    assert issubclass(tracker, FSDPMemTracker) and len(used) == 1  # the 2-rank plan only, on the sharded policy
    assert used[0].__class__.__name__.startswith("FSDP")
    assert set(two.peaks) == set(one.peaks) == {"generation", "scoring", "training"}
    assert two.sharded_over == 2 and two.rows * 2 == one.rows
    # Each rank holds half of every state (the reference and the weights' shards; AdamW's moments of its shards).
    assert two.weights == pytest.approx(one.weights / 2, rel=0.02)
    assert two.reference == pytest.approx(one.reference / 2, rel=0.02)
    assert two.optimizer == pytest.approx(one.optimizer / 2, rel=0.02)
    assert 0 < two.peak < one.peak
