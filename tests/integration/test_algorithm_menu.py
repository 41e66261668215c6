"""The algorithm menu end to end: every preset trains 2 steps on the tiny model, and the two axes cross."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlhf_lab.training.loop import Trainer

PRESETS = ["ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce", "reinforce_pp", "remax", "gspo", "cispo"]
CONTRACT = ["reward/mean", "kl/estimate", "kl/exact", "loss/policy", "loss/total", "policy/entropy",
            "policy/clipfrac", "policy/ratio_mean", "policy/ratio_max", "policy/ratio_min", "advantages/min",
            "advantages/max", "time/step_s"]


def train(compose, tiny_overrides, run_dir: Path, *overrides: str) -> list[dict]:
    cfg = compose([*tiny_overrides(None), "trainer.eval_prompts=0", "reward=length", "trainer.lr=1e-3",
                   *overrides])
    Trainer(cfg, run_dir).train()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_trains_and_logs_the_contract(compose, tiny_overrides, tmp_path: Path, preset: str) -> None:
    # The tiny random model never emits EOS: under dapo's truncation mask no token would reach the loss.
    extra = {"ppo": ["algorithm.mini_batch_size=2"], "dapo": ["algorithm.mask_truncated=false"]}.get(preset, [])
    lines = train(compose, tiny_overrides, tmp_path / "run", f"algorithm={preset}", *extra)
    assert [line["step"] for line in lines] == [0, 1]
    for line in lines:
        missing = [key for key in CONTRACT if key not in line]
        assert not missing, missing
        assert line["policy/ratio_min"] <= line["policy/ratio_mean"] <= line["policy/ratio_max"]
        assert line["advantages/min"] <= line["advantages/max"]
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()


@pytest.mark.parametrize(("advantage", "policy_loss"), [("rloo", "gspo"), ("reinforce_pp", "cispo"),
                                                         ("dr_grpo", "reinforce"), ("reinforce_pp_baseline", "clip")])
def test_the_axes_cross(compose, tiny_overrides, tmp_path: Path, advantage: str, policy_loss: str) -> None:
    cfg = compose([*tiny_overrides(None), "algorithm=grpo", f"algorithm.advantage={advantage}",
                   f"algorithm.policy_loss={policy_loss}"])
    assert (cfg.algorithm.advantage, cfg.algorithm.policy_loss) == (advantage, policy_loss)
    lines = train(compose, tiny_overrides, tmp_path / "run", "algorithm=grpo", f"algorithm.advantage={advantage}",
                  f"algorithm.policy_loss={policy_loss}")
    assert len(lines) == 2


def test_dual_clip_and_tis_log_their_shares(compose, tiny_overrides, tmp_path: Path) -> None:
    lines = train(compose, tiny_overrides, tmp_path / "run", "algorithm=grpo", "algorithm.clip_ratio_c=3.0",
                  "algorithm.tis_cap=2.0", "trainer.precision=bf16-mixed")
    for line in lines:
        assert 0.0 <= line["policy/dual_clipped_frac"] <= 1.0
        assert 0.0 < line["rollout/is_weight_mean"] <= 2.0
        assert 0.0 <= line["rollout/is_capped_frac"] <= 1.0
        assert 0.0 <= line["rollout/logprob_diff_mean"] <= line["rollout/logprob_diff_max"]


@pytest.mark.parametrize("overrides", [
    ("algorithm.tis_mode=icepop", "algorithm.tis_cap=5.0", "algorithm.tis_floor=0.5"),
    ("algorithm.tis_mode=geo_mask", "algorithm.tis_cap=1.5"),
    ("algorithm.tis_mode=m2po", "algorithm.tis_cap=5.0", "algorithm.m2po_tau=1e-6", "generation.max_staleness=1",
     "generation.simulate_staleness=true"),
    ("algorithm.policy_loss=dppo", "algorithm.off_policy_mask=0.0", "algorithm.tis_cap=2.0"),
])
def test_the_asynchronous_corrections_train_and_log(compose, tiny_overrides, tmp_path: Path, overrides) -> None:
    """Each correction runs in the trainer on samples scored apart from the trainer (bf16 sampling), and logs what
    it did: M2PO on the second step's samples of the first step's weights (one update stale), at a τ below their
    second moment, rejects tokens (a step whose tokens all leave the loss has a finite loss); the V3.2 mask at δ = 0 logs its share."""
    lines = train(compose, tiny_overrides, tmp_path / "run", "algorithm=grpo", "trainer.precision=bf16-mixed",
                  *overrides)
    for line in lines:
        assert 0.0 <= line["rollout/is_capped_frac"] <= 1.0
        assert all(math.isfinite(line[key]) for key in ("loss/policy", "loss/total"))
        if "algorithm.tis_mode=m2po" in overrides:
            assert 0.0 <= line["rollout/rejected_frac"] <= 1.0
    if "algorithm.tis_mode=m2po" in overrides:
        assert lines[-1]["rollout/rejected_frac"] > 0.0
        if "algorithm.off_policy_mask=0.0" in overrides:
            assert 0.0 <= line["policy/off_policy_masked_frac"] <= 1.0


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm=ppo", "algorithm.advantage=grpo"],
     "algorithm.advantage='grpo' does not fit algorithm=ppo, whose critic estimates advantages: it needs "
     "algorithm.advantage=gae"),
    (["algorithm=grpo", "algorithm.advantage=gae"],
     "algorithm.advantage=gae needs a critic, which algorithm=grpo has not; use algorithm=ppo"),
    (["algorithm.policy_loss=vanilla"], "algorithm.policy_loss='vanilla' is not valid; choose from: cispo, clip, dppo, "
                                     "gspo, reinforce"),
    (["algorithm.clip_ratio_c=0.5"], "algorithm.clip_ratio_c=0.5 is out of range; must be > 1.0"),
    (["algorithm=remax", "algorithm.remax_return=suffix"],
     "algorithm.remax_return='suffix' is not valid; choose from: total, to_go"),
    (["algorithm=grpo", "algorithm.std_eps=0"], "algorithm.std_eps=0.0 is out of range; must be > 0.0"),
    (["algorithm=cispo", "algorithm.clip_ratio_c=1.5"],
     "algorithm.clip_ratio_c=1.5 bounds the ratio term −A·r of a ratio loss, and algorithm.policy_loss='cispo' "
     "has none; use policy_loss clip or gspo, or clip_ratio_c=null"),
    (["algorithm=grpo", "algorithm.policy_loss=reinforce", "algorithm.clip_ratio_c=3"],
     "algorithm.clip_ratio_c=3.0 bounds the ratio term −A·r of a ratio loss, and algorithm.policy_loss='reinforce' "
     "has none; use policy_loss clip or gspo, or clip_ratio_c=null"),
])
def test_axis_mistakes_are_one_line_errors(compose, overrides: list[str], message: str) -> None:
    from rlhf_lab.errors import UserError

    with pytest.raises(UserError) as raised:
        compose(overrides)
    assert str(raised.value) == message
