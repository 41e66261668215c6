"""The N-rank plan under FSDP: the step sharded over torch's fake process group, counted by torch's FSDPMemTracker.

The plan runs in a process of its own: the fake group must be the process's default group, and an earlier test in
the same worker may hold one for good (vLLM's in-process engine starts a group that lives as long as the engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import HANG_GUARD_S

TINY = ["model=tiny", "trainer.precision=fp32", "trainer.prompts_per_step=4", "algorithm.group_size=2",
        "trainer.max_new_tokens=4", "data.max_prompt_tokens=16", "trainer.strategy=fsdp"]

PLAN_TWICE = """
import json, sys
from rlhf_lab.config import compose
from rlhf_lab.models.loading import load_tokenizer
from rlhf_lab.planner import fake
from rlhf_lab.planner.step import plan_step
from rlhf_lab.runtime.precision import Precision
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

used = []
tracker = fake.FSDPStepMemory

class Recorded(tracker):
    def __init__(self, *args):
        used.append(args[0].__class__.__name__)
        super().__init__(*args)

fake.FSDPStepMemory = Recorded
cfg = compose(json.loads(sys.argv[1]))
tokenizer, precision = load_tokenizer(cfg.model), Precision("fp32", "cpu")
one = plan_step(cfg, tokenizer, precision)
two = plan_step(cfg, tokenizer, precision, world_size=2, fsdp=True)
state = lambda plan: {"peaks": sorted(plan.peaks), "sharded_over": plan.sharded_over, "rows": plan.rows,
                      "weights": plan.weights, "reference": plan.reference, "optimizer": plan.optimizer,
                      "peak": plan.peak}
print(json.dumps({"fsdp_tracker": issubclass(tracker, FSDPMemTracker), "used": used, "one": state(one),
                  "two": state(two)}))
"""


def test_two_fsdp_ranks_are_planned_with_torchs_fsdp_tracker() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", PLAN_TWICE, json.dumps(TINY)], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = result["one"], result["two"]
    assert result["fsdp_tracker"] and len(result["used"]) == 1  # the 2-rank plan only, on the sharded policy
    assert result["used"][0].startswith("FSDP")
    assert two["peaks"] == one["peaks"] == ["generation", "scoring", "training"]
    assert two["sharded_over"] == 2 and two["rows"] * 2 == one["rows"]
    # Each rank holds half of every state (the reference and the weights' shards; AdamW's moments of its shards).
    assert two["weights"] == pytest.approx(one["weights"] / 2, rel=0.02)
    assert two["reference"] == pytest.approx(one["reference"] / 2, rel=0.02)
    assert two["optimizer"] == pytest.approx(one["optimizer"] / 2, rel=0.02)
    assert 0 < two["peak"] < one["peak"]
