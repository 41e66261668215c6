"""Golden runs: seeded ``model=tiny`` runs reproduce the recorded ``metrics.jsonl`` value for value.

The files in ``tests/golden/`` were recorded before the package was reorganised along its seams
(``python tests/golden/record.py``); every algorithm × two KL settings × LoRA on/off, 4 steps with an
evaluation every 2, and a PPO run stopped after 2 steps and resumed to 4. Wall-clock keys (``time/``,
``throughput/``) are left out; every other value must be equal, except in the PPO arms, which agree to float
tolerance (``REL_TOL``/``ABS_TOL``): PPO's sampling-time values now come from the decode loop's hidden states
instead of a second forward pass, the same computation in a different order. Metrics renamed since the
recording are mapped in ``RENAMED``; metrics added since are listed in ``ADDED``.
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


def comparable(text: str) -> list[dict]:
    lines = [json.loads(line) for line in text.splitlines()]
    return [{RENAMED.get(k, k): v for k, v in line.items() if not k.startswith(WALL_CLOCK)} for line in lines]


def same(want: object, have: object, exact: bool) -> bool:
    if not exact and isinstance(want, float) and isinstance(have, float):
        return math.isclose(want, have, rel_tol=REL_TOL, abs_tol=ABS_TOL) or want == have  # inf == inf
    return want == have


def assert_same_metrics(expected_file: Path, actual: str, exact: bool) -> None:
    expected, got = comparable(expected_file.read_text()), comparable(actual)
    assert [line["step"] for line in got] == [line["step"] for line in expected]
    for want, have in zip(expected, got):
        assert want.keys() <= have.keys(), f"step {want['step']}: missing {want.keys() - have.keys()}"
        assert have.keys() - want.keys() <= ADDED, f"step {want['step']}: new keys {have.keys() - want.keys() - ADDED}"
        differing = {key: (want[key], have[key]) for key in want if not same(want[key], have[key], exact)}
        assert not differing, f"step {want['step']}: {differing}"


@pytest.mark.parametrize("name", sorted(record.arms()))
def test_golden_run_is_reproduced(name: str, tmp_path: Path) -> None:
    # PPO's values come from the decode loop's hidden states: float tolerance; every other arm: exactly equal.
    assert_same_metrics(GOLDEN_DIR / f"{name}.jsonl", record.record_arm(record.arms()[name], tmp_path / "run"),
                        exact=not name.startswith("ppo"))


def test_golden_resume_is_reproduced(tmp_path: Path) -> None:
    assert_same_metrics(GOLDEN_DIR / "resume_ppo.jsonl", record.record_resume(tmp_path / "run"), exact=False)
