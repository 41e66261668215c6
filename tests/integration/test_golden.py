"""Golden runs: seeded ``model=tiny`` runs reproduce the recorded ``metrics.jsonl`` value for value.

The files in ``tests/golden/`` were recorded before the package was reorganised along its seams
(``python tests/golden/record.py``); every algorithm × two KL settings × LoRA on/off, 4 steps with an
evaluation every 2, and a PPO run stopped after 2 steps and resumed to 4. Wall-clock keys (``time/``,
``throughput/``) are left out; every other value must be equal, except in the PPO arms, which agree to float
tolerance (``REL_TOL``/``ABS_TOL``): PPO's sampling-time values now come from the decode loop's hidden states
instead of a second forward pass, the same computation in a different order. Metrics renamed since the
recording are mapped in ``RENAMED``; metrics added since are listed in ``ADDED``.

Bit-for-bit equality needs the recording CPU's float32 kernels. On a CPU whose kernels round otherwise (the
step-0 evaluation, before any update, then differs in its last bits) the runs are held to float tolerance
(``FOREIGN_REL_TOL``/``FOREIGN_ABS_TOL``; the absolute part covers quantities that are float noise by
construction: a tied group's advantages are noise over GRPO's 1e-4 std floor, ~1e-4 of either sign). In the
``CHAOTIC`` runs every reward of a step ties (``reward=length`` over 4 tokens) and the KL penalty in the reward,
float noise at step 0, is the only difference between samples; Adam's first update normalizes those
noise-level gradients, so the trajectory after it is that CPU's own, and only step 0's evaluation and rollout
side (rewards, KL, values and returns before the update) are compared there.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
sys.path.insert(0, str(GOLDEN_DIR))
import record  # noqa: E402

WALL_CLOCK = ("time/", "throughput/")
REL_TOL, ABS_TOL = 1e-4, 1e-6
RENAMED = {"skip_minibatch": "optim/vetoed"}  # PPO's ratio-threshold veto, now a typed loss result
# Metrics added since the recording (the algorithm menu's debugging statistics); every recorded key must still
# be there with its value, and nothing else may appear.
ADDED = {"advantages/min", "advantages/max", "policy/ratio_mean", "policy/ratio_max", "policy/ratio_min",
         "policy/clipped_low_frac", "policy/clipped_high_frac", "response/truncated_frac"}


FOREIGN_REL_TOL, FOREIGN_ABS_TOL = 1e-4, 1e-3
CHAOTIC = {"ppo_k1reward_full", "resume_ppo"}
BEFORE_UPDATE = ("eval/", "reward/", "kl/", "response/", "returns/", "advantages/", "value/mean")


def comparable(text: str) -> list[dict]:
    lines = [json.loads(line) for line in text.splitlines()]
    return [{RENAMED.get(k, k): v for k, v in line.items() if not k.startswith(WALL_CLOCK)} for line in lines]


def same(want: object, have: object, exact: bool, rel_tol: float = REL_TOL, abs_tol: float = ABS_TOL) -> bool:
    if not exact and isinstance(want, float) and isinstance(have, float):
        return math.isclose(want, have, rel_tol=rel_tol, abs_tol=abs_tol) or want == have  # inf == inf
    return want == have


def assert_same_metrics(expected_file: Path, actual: str, exact: bool) -> None:
    expected, got = comparable(expected_file.read_text()), comparable(actual)
    assert [line["step"] for line in got] == [line["step"] for line in expected]
    tolerance = {}
    if expected[0] != got[0]:  # the evaluation before any update: this CPU's float32 kernels round otherwise
        exact, tolerance = False, dict(rel_tol=FOREIGN_REL_TOL, abs_tol=FOREIGN_ABS_TOL)
        if expected_file.stem in CHAOTIC:  # step 0's evaluation and rollout side, before the first update
            expected, got = ([{k: v for k, v in line.items() if k == "step" or k.startswith(BEFORE_UPDATE)}
                              for line in lines[:2]] for lines in (expected, got))
    for want, have in zip(expected, got):
        assert want.keys() <= have.keys(), f"step {want['step']}: missing {want.keys() - have.keys()}"
        assert have.keys() - want.keys() <= ADDED, f"step {want['step']}: new keys {have.keys() - want.keys() - ADDED}"
        differing = {key: (want[key], have[key]) for key in want if not same(want[key], have[key], exact, **tolerance)}
        assert not differing, f"step {want['step']}: {differing}"


@pytest.mark.parametrize("name", sorted(record.arms()))
def test_golden_run_is_reproduced(name: str, tmp_path: Path) -> None:
    # PPO's values come from the decode loop's hidden states: float tolerance; every other arm: exactly equal.
    assert_same_metrics(GOLDEN_DIR / f"{name}.jsonl", record.record_arm(record.arms()[name], tmp_path / "run"),
                        exact=not name.startswith("ppo"))


def test_golden_resume_is_reproduced(tmp_path: Path) -> None:
    assert_same_metrics(GOLDEN_DIR / "resume_ppo.jsonl", record.record_resume(tmp_path / "run"), exact=False)
