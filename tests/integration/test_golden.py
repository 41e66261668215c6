"""Golden runs: seeded ``model=tiny`` runs reproduce the recorded ``metrics.jsonl``.

The files in ``tests/golden/`` were recorded (``python tests/golden/record.py``) on one CPU: every algorithm ×
two KL settings × LoRA on/off, 4 steps with an evaluation every 2, and a PPO run stopped after 2 steps and
resumed to 4. Wall-clock and machine keys (``time/``, ``throughput/``, ``perf/``) are left out. Metrics renamed since the recording
are mapped in ``RENAMED``; metrics added since are listed in ``ADDED``; nothing else may appear or go missing.

What is compared exactly and what to a tolerance follows what the code guarantees:

- **The plain path and the CPU profile** (``hardware=default`` and ``hardware=cpu_tuned``) both reproduce the
  recordings: the profile's pieces compute the same numbers (memory placement, the same draws, the same
  gradients; under autocast LoRA's merged decode weights round otherwise, and the recordings are float32).
- **Within one process, with the same threads, a run is bit for bit repeatable**
  (:func:`test_golden_run_is_repeatable`): the same seeds, the same kernels, the same order of every sum.
- **Across machines it is not.** MKL and oneDNN pick their float32 kernels by CPU kind (AVX2, AVX-512,
  AVX-512-BF16, AMX), and those sum in different orders: a recorded ``kl/estimate`` of 0.0181056 reads
  0.0181055 on another CPU. The recorded runs are therefore held to the tolerances below on every machine,
  including the recording one; each is the documented size of a float32 rounding effect, with the largest
  difference measured between an Intel Xeon (the recording) and an AMD EPYC noted beside it.
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

WALL_CLOCK = ("time/", "throughput/", "perf/")
RENAMED = {"skip_minibatch": "optim/vetoed"}  # PPO's ratio-threshold veto, now a typed loss result
# Metrics added since the recording (the algorithm menu's debugging statistics).
ADDED = {"advantages/min", "advantages/max", "policy/ratio_mean", "policy/ratio_max", "policy/ratio_min",
         "policy/clipped_low_frac", "policy/clipped_high_frac", "response/truncated_frac", "response/length_min",
         "response/length_max", "response/clipped_frac", "rollout/frac_reward_zero_std", "kl/exact_floor",
         # every token's policy version (rlhf_lab/generation/inflight.py): on-policy, all 0
         "staleness/token_mean", "staleness/sample_mean", "staleness/sample_max",
         "staleness/multi_version_frac", "staleness/samples_at_0"}

# Relative: 4 steps of Adam carry a kernel's last-bit difference into the weights; Adam divides each gradient
# by its own running size, so a relative difference in a gradient stays relative in the update. Largest seen
# across CPU kinds: 2.4e-4 (``optim/grad_norm``); 1e-3 still fails a change that moves a metric by 0.1%.
REL_TOL = 1e-3
# Absolute: the tiny model's log-probs are about −10.8 (49,152 tokens, near uniform), where float32's spacing is
# 9.5e-7; a KL, an entropy or a ratio built from log-prob differences moves by a few of those spacings when one
# log-softmax rounds otherwise. Largest seen: 1.9e-6 (``policy/entropy``, two spacings; ``loss/policy`` in PPO).
ABS_TOL = 4e-6
# Float noise by construction: in a group whose rewards tie (``reward=length`` over 4 tokens), the centred
# returns are rounding noise (~1e-8 of either sign) divided by GRPO's std floor of 1e-4, so the advantages, and
# the policy losses they weight, are noise of up to ~1e-3. Largest seen: 9.3e-5.
NOISE_ABS_TOL = 1e-3
NOISE_KEYS = ("advantages/", "loss/policy", "loss/total")
# In these runs every reward of a step ties and the KL penalty in the reward, float noise at step 0, is the only
# difference between samples; Adam's first update normalises those noise-level gradients to full-size steps, so
# the trajectory after it is each CPU's own. Across machines only step 0's evaluation and its rollout side
# (rewards, KL, values and returns before the update) are comparable; the repeatability test covers the rest.
CHAOTIC = {"ppo_k1reward_full", "resume_ppo"}
BEFORE_UPDATE = ("eval/", "reward/", "kl/", "response/", "returns/", "advantages/", "value/mean")


def comparable(text: str) -> list[dict]:
    lines = [json.loads(line) for line in text.splitlines()]
    return [{RENAMED.get(k, k): v for k, v in line.items() if not k.startswith(WALL_CLOCK)} for line in lines]


def close(key: str, want: object, have: object) -> bool:
    """Whether a recorded value and a reproduced one agree to the tolerance of ``key``."""
    if isinstance(want, float) and isinstance(have, int | float) and not isinstance(have, bool):
        if want == have:  # inf == inf
            return True
        abs_tol = NOISE_ABS_TOL if key.startswith(NOISE_KEYS) else ABS_TOL
        return math.isclose(want, have, rel_tol=REL_TOL, abs_tol=abs_tol)
    return want == have


def assert_same_metrics(name: str, expected_text: str, actual: str) -> None:
    expected, got = comparable(expected_text), comparable(actual)
    assert [line["step"] for line in got] == [line["step"] for line in expected]
    for want, have in zip(expected, got):
        assert want.keys() <= have.keys(), f"step {want['step']}: missing {want.keys() - have.keys()}"
        assert have.keys() - want.keys() <= ADDED, f"step {want['step']}: new keys {have.keys() - want.keys() - ADDED}"
    if name in CHAOTIC:  # step 0's evaluation and rollout side, before the first update
        expected, got = ([{k: v for k, v in line.items() if k == "step" or k.startswith(BEFORE_UPDATE)}
                          for line in lines[:2]] for lines in (expected, got))
    for want, have in zip(expected, got):
        differing = {key: (want[key], have[key]) for key in want if not close(key, want[key], have[key])}
        assert not differing, f"{name} step {want['step']}: {differing}"


PROFILES = ("default", "cpu_tuned")


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", sorted(record.arms()))
def test_golden_run_is_reproduced(name: str, profile: str, tmp_path: Path) -> None:
    actual = record.record_arm([*record.arms()[name], f"hardware={profile}"], tmp_path / "run")
    assert_same_metrics(name, (GOLDEN_DIR / f"{name}.jsonl").read_text(), actual)


@pytest.mark.parametrize("profile", PROFILES)
def test_golden_resume_is_reproduced(profile: str, tmp_path: Path) -> None:
    assert_same_metrics("resume_ppo", (GOLDEN_DIR / "resume_ppo.jsonl").read_text(),
                        record.record_resume(tmp_path / "run", [f"hardware={profile}"]))


@pytest.mark.parametrize("name", ["ppo_k1reward_full", "grpo_k1reward_lora"])
def test_golden_run_is_repeatable(name: str, tmp_path: Path) -> None:
    """Twice in one process, with the same threads: every value equal, bit for bit (the chaotic PPO arm and the
    arm with the most float noise among the others)."""
    first = comparable(record.record_arm(record.arms()[name], tmp_path / "first"))
    second = comparable(record.record_arm(record.arms()[name], tmp_path / "second"))
    assert first == second


def test_tolerances_fail_a_real_change() -> None:
    """The tolerances are tight enough to catch a metric moved by 0.2% or a KL moved by 1e-5."""
    line = json.dumps({"step": 0, "reward/mean": 0.65, "kl/exact": 3.5e-6, "advantages/mean": 1e-7})
    assert_same_metrics("grpo_k3loss_full", line, line)
    for key, moved in (("reward/mean", 0.65 * 1.002), ("kl/exact", 1.35e-5), ("advantages/mean", 2e-3)):
        changed = json.dumps({**json.loads(line), key: moved})
        with pytest.raises(AssertionError, match=key):
            assert_same_metrics("grpo_k3loss_full", line, changed)
