"""Sweep arms that are one computation are named at start (rlhf_lab/config/sweep_arms.py): GRPO, GSPO and CISPO
with one on-policy update per rollout, RLOO and Dr. GRPO where every response has the same length; several
updates per rollout, or a loss-placed KL, set them apart."""

from __future__ import annotations

import warnings

import pytest

from rlhf_lab.config import compose

EXACT = ["model=exact", "data=exact", "reward=exact_table", "trainer.max_new_tokens=2", "algorithm.group_size=4",
         "kl=kl", "kl.placement=reward", "trainer.prompts_per_step=4"]


def sweep_warnings(overrides: list[str]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compose(overrides)
    return [str(w.message) for w in caught if str(w.message).startswith("sweep arms")]


def test_policy_losses_with_one_update_per_rollout_are_one_computation() -> None:
    (line,) = sweep_warnings([*EXACT, "algorithm=grpo,gspo,cispo,reinforce_pp", "seed=0,1"])
    assert line.startswith("sweep arms algorithm=grpo | algorithm=gspo | algorithm=cispo compute the same updates (")
    assert "so gspo is clip" in line and "so cispo is clip" in line and line.endswith("cannot tell them apart")
    assert sweep_warnings([*EXACT, "algorithm=grpo,gspo,cispo", "algorithm.epochs=2"]) == []


def test_rloo_and_dr_grpo_are_one_computation_only_where_nothing_tells_them_apart() -> None:
    (line,) = sweep_warnings([*EXACT, "algorithm=rloo,dr_grpo"])
    assert "dr_grpo is rloo × (G − 1)/G, a constant Adam does not see" in line
    assert "every response has the same length" in line  # their loss aggregations differ by a constant here
    assert sweep_warnings([*EXACT, "algorithm=rloo,dr_grpo", "kl=k3", "kl.placement=loss"]) == []


@pytest.mark.parametrize("experiment", ["algo_comparison", "algo_comparison_exact"])
def test_the_algorithm_comparisons_have_no_arm_twice(experiment: str) -> None:
    assert sweep_warnings([f"experiment={experiment}", "logger=none"]) == []
