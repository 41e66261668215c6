"""``experiment=off_policy_kl``: its grid is the one its page describes (staleness {0, 1, 2, 4, 8} x correction x
KL, the on-policy cells' corrections merged), every job composes to the staleness and correction its arm names, and
a short job runs on the exact task with KL(π‖π*) = gap / β logged."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

from rlhf_lab.training.loop import Trainer

ARMS = ["s0"] + [f"s{k}_{c}" for k in (1, 2, 4, 8) for c in ("none", "token", "sequence")]
KL_ARMS = ["none", "kl_reward", "k3_loss", "mse_loss"]
ASYNC_KL_ARMS = ["kl_reward", "k3_loss", "k3_loss_v32"]  # experiment=async_kl's (tests/integration/test_async_experiment.py)
MODES = {"none": "none", "token": "token_truncate", "sequence": "sequence_mask"}


def grid(compose, experiment: str, arm_group: str, arms: list[str]) -> Iterator[tuple[str, str, Any]]:
    """Each (arm, KL arm, composed job) of ``experiment``, once its sweep is checked to be ``arms`` x KL_ARMS x its
    seeds (20 for off_policy_kl, 10 for async_kl)."""
    from rlhf_lab.config.compose import _hydra_compose

    sweep = _hydra_compose([f"experiment={experiment}"], return_hydra_config=True).hydra.sweeper.params
    kl_arms = KL_ARMS if experiment == "off_policy_kl" else ASYNC_KL_ARMS
    assert {key: str(value) for key, value in sweep.items()} == {
        f"+{arm_group}": ",".join(arms), "+kl_arm": ",".join(kl_arms),
        "seed": ",".join(map(str, range(20 if experiment == "off_policy_kl" else 10)))}
    for arm, kl_arm in itertools.product(arms, kl_arms):
        yield arm, kl_arm, compose([f"experiment={experiment}", f"+{arm_group}={arm}", f"+kl_arm={kl_arm}"])


def test_the_grid_is_staleness_by_correction_by_kl(compose) -> None:
    for arm, _, cfg in grid(compose, "off_policy_kl", "off_policy_arm", ARMS):
        staleness, _, correction = arm[1:].partition("_")
        assert cfg.generation.max_staleness == int(staleness)
        assert cfg.algorithm.tis_mode == MODES[correction or "none"] and cfg.algorithm.tis_cap == 2.0
        assert cfg.model.name == "exact" and cfg.kl.coef == 0.2


def exact_job(compose, tmp_path, overrides: list[str]) -> list[dict]:
    """The metrics lines of a short job of an exact-task experiment (the exact metrics every step)."""
    cfg = compose([*overrides, "trainer.exact_every=1", f"trainer.output_dir={tmp_path / 'run'}", "logger=none"])
    Trainer(cfg, tmp_path / "run").train()
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_stale_corrected_job_runs_and_logs_its_distance_to_the_optimum(compose, tmp_path) -> None:
    lines = exact_job(compose, tmp_path, ["experiment=off_policy_kl", "+off_policy_arm=s2_sequence", "+kl_arm=k3_loss",
                                          "trainer.steps=4"])
    exact = [line for line in lines if "exact/gap" in line]
    assert len(exact) == 4
    for line in exact:
        assert line["exact/kl_to_optimal"] == pytest.approx(line["exact/gap"] / 0.2, rel=1e-6)
    assert all("rollout/is_weight_mean" in line for line in lines if "reward/mean" in line)
