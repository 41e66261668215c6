"""``experiment=async_kl``: its grid is the one its page describes (12 asynchronous arms x 3 KL arms x 5 seeds), every
job composes to the staleness, landing mode and correction its arm names, and a short job runs on the exact task
with tokens of several versions in every sample."""

from __future__ import annotations

import pytest

from tests.integration.test_off_policy_experiment import exact_job, grid

ARMS = ["sync", "f2_none", "f2_token", "f2_sequence", "f6_none", "f6_token", "f6_sequence", "f6_icepop",
        "f6_decoupled", "f6_m2po", "p6_token", "p6_sequence"]
MODES = {"none": "none", "token": "token_truncate", "sequence": "sequence_truncate", "icepop": "icepop",
         "decoupled": "token_mask", "m2po": "m2po"}


def test_the_grid_is_async_arm_by_kl_arm(compose) -> None:
    for arm, kl_arm, cfg in grid(compose, "async_kl", "async_arm", ARMS):
        generation, algorithm = cfg.generation, cfg.algorithm
        if arm == "sync":
            assert generation.max_staleness == 0 and algorithm.tis_mode == "none"
        else:
            landing, _, correction = arm.partition("_")
            assert generation.max_staleness == int(landing[1:]) and generation.simulate_staleness
            assert generation.weight_updates == {"f": "in_flight", "p": "partial"}[landing[0]]
            assert generation.update_every_tokens == 1 and algorithm.tis_mode == MODES[correction]
        assert algorithm.tis_cap == 5.0 and algorithm.tis_floor == (0.5 if arm == "f6_icepop" else None)
        assert cfg.kl.off_policy_correction == ("token_ratio" if kl_arm == "k3_loss_v32" else "policy")
        assert cfg.model.name == "exact" and cfg.kl.coef == 0.2


def test_an_in_flight_job_trains_on_tokens_of_three_versions(compose, tmp_path) -> None:
    lines = exact_job(compose, tmp_path, ["experiment=async_kl", "+async_arm=f2_token", "+kl_arm=k3_loss_v32",
                                          "trainer.steps=5"])
    steps = [line for line in lines if "staleness/token_mean" in line]
    assert [line["step"] for line in steps] == [0, 1, 2, 3, 4]
    # From step 2 on a batch starts 2 updates behind and a version lands after each of its 3 tokens.
    assert [line["staleness/token_mean"] for line in steps[2:]] == [1.0, 1.0, 1.0]
    assert all(line["staleness/multi_version_frac"] == 1.0 for line in steps[2:])
    assert all(line["exact/kl_to_optimal"] == pytest.approx(line["exact/gap"] / 0.2, rel=1e-6)
               for line in lines if "exact/gap" in line)


def test_the_drop_bias_grid_and_a_short_job_of_its_drop_arm(compose, tmp_path) -> None:
    """``experiment=async_drop_bias``: 6 drop arms x 10 seeds on the exact task with a stop symbol; a short job of the
    drop arm logs the policy's mean length against π*'s, and its cap's drops."""
    from rlhf_lab.config.compose import _hydra_compose

    sweep = _hydra_compose(["experiment=async_drop_bias"], return_hydra_config=True).hydra.sweeper.params
    assert {key: str(value) for key, value in sweep.items()} == {"+drop_arm": "sync,continuous,drop6,wait6,drop5,wait5",
                                                                 "seed": "0,1,2,3,4,5,6,7,8,9"}
    for arm in ("sync", "continuous", "drop6", "wait6", "drop5", "wait5"):
        cfg = compose(["experiment=async_drop_bias", f"+drop_arm={arm}"])
        generation = cfg.generation
        assert cfg.model.exact.stop and cfg.trainer.max_new_tokens == 5
        assert generation.continuous == (arm != "sync")
        assert generation.staleness_cap == (int(arm[-1]) if arm[-1].isdigit() else None)
        if arm[-1].isdigit():
            assert generation.over_cap == arm[:-1]
    lines = exact_job(compose, tmp_path, ["experiment=async_drop_bias", "+drop_arm=drop5", "trainer.steps=12",
                                          "generation.staleness_cap=1"])
    exact = [line for line in lines if "exact/length" in line]
    assert len(exact) == 12
    assert all(2.0 < line["exact/length"] < 5.0 for line in exact)
    assert any(line["rollout/stale_dropped_frac"] > 0 for line in lines if "reward/mean" in line)
