"""``generation.continuous``: the continuous asynchronous simulator (rlhf_lab/generation/continuous.py). Checked
against the fixed-lag simulator and the on-policy run where the clock gives the same timing, bit for bit across two
runs, and across a stop and resume (the groups in flight kept with their caches and streams); long groups launched
early trained late, and the staleness cap's drop and wait.

In-process on the tiny model and the exact task (fp32, so equal weights give equal numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_lab.errors import ConfigError
from rlhf_lab.training.loop import Trainer

# Rewards that differ within a group from the first step, so every update moves the weights (as test_staleness.py).
STEPS = ["trainer.steps=4", "trainer.eval_prompts=0", "trainer.lr=1e-2", "trainer.seed_per_prompt=true",
         "trainer.max_new_tokens=8", "reward=length", "reward.min_words=1", "reward.max_words=2",
         "reward.slope_words=1", "algorithm.tis_cap=2"]
WALL_TIME = ("time/", "throughput/", "perf/", "async/", "rollout/weight_version")


def steady_lines(run_dir: Path) -> list[dict]:
    """The run's metrics lines without the wall-clock measurements and the simulator's own counters."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(WALL_TIME)} for line in lines]


def samples(run_dir: Path) -> list[tuple]:
    lines = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [(line["step"], line["prompt"], line["response"]) for line in lines]


def test_one_group_slot_per_prompt_and_a_long_update_is_the_fixed_lag_of_one(compose, tiny_overrides,
                                                                            tmp_path) -> None:
    """S = B groups and an update of N ≥ max_new_tokens ticks: every batch completes during the update before its
    step, one version behind — the fixed-lag simulator's max_staleness=1, the same prompts, tokens and losses."""
    common = [*tiny_overrides(None), *STEPS, "trainer.samples_per_step_logged=4"]
    fixed = tmp_path / "fixed"
    Trainer(compose([*common, "generation.max_staleness=1", "generation.simulate_staleness=true",
                     f"trainer.output_dir={fixed}"]), fixed).train()
    continuous = tmp_path / "continuous"
    Trainer(compose([*common, "generation.continuous=true", "generation.engine_groups=2",
                     "generation.weight_updates=in_flight", "generation.update_every_tokens=8",
                     f"trainer.output_dir={continuous}"]), continuous).train()
    assert samples(continuous) == samples(fixed)
    ours, theirs = steady_lines(continuous), steady_lines(fixed)
    assert [line["staleness/sample_mean"] for line in ours] == [0.0, 1.0, 1.0, 1.0]
    for mine, other in zip(ours, theirs, strict=True):
        assert set(mine) == set(other)
        for key, value in other.items():
            assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_an_update_of_no_ticks_is_the_on_policy_run(compose, tiny_overrides, tmp_path) -> None:
    """N = 0: the engine decodes nothing while the trainer updates, so every token comes from the policy it trains."""
    common = [*tiny_overrides(None), *STEPS, "generation.logprobs=trainer"]
    synchronous = tmp_path / "sync"
    Trainer(compose([*common, f"trainer.output_dir={synchronous}"]), synchronous).train()
    continuous = tmp_path / "continuous"
    Trainer(compose([*common, "generation.continuous=true", "generation.engine_groups=2",
                     "generation.weight_updates=partial", "generation.update_every_tokens=0",
                     f"trainer.output_dir={continuous}"]), continuous).train()
    assert samples(continuous) == samples(synchronous)
    ours = steady_lines(continuous)
    assert all(line["staleness/sample_max"] == 0.0 for line in ours)
    for mine, other in zip(ours, steady_lines(synchronous), strict=True):
        for key, value in other.items():
            assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


CLOCK = ["generation.continuous=true", "generation.engine_groups=3", "generation.update_every_tokens=3",
         "trainer.checkpoint_every=2", "trainer.keep_last_n=2"]


@pytest.mark.parametrize("updates", ["in_flight", "partial"])
def test_two_runs_are_bit_identical_and_a_resume_goes_on_as_if_never_stopped(compose, tiny_overrides, tmp_path,
                                                                           updates) -> None:
    """Three groups launched for batches of two, an update every 3 ticks of 8-token responses: groups span several
    versions and are in flight at the checkpoint. A second run logs the very same lines (the simulator's counters
    too); resumed from the checkpoint after 2 updates, steps 2 and 3 log what the uninterrupted run logged."""
    common = [*tiny_overrides(None), *STEPS, *CLOCK, f"generation.weight_updates={updates}"]
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        Trainer(compose([*common, f"trainer.output_dir={folder}"]), folder).train()
    lines = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    again = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    drop = ("time/", "throughput/", "perf/")
    assert [{k: v for k, v in line.items() if not k.startswith(drop)} for line in lines] == \
        [{k: v for k, v in line.items() if not k.startswith(drop)} for line in again]
    assert samples(first) == samples(second)
    assert any(line["staleness/multi_version_frac"] > 0 for line in lines)
    assert max(line["staleness/sample_max"] for line in lines) >= 2.0
    assert [line["async/clock_ticks"] for line in lines] == sorted(line["async/clock_ticks"] for line in lines)

    checkpoint = first / "checkpoints" / "step_2"
    state = json.loads((checkpoint / "trainer_state.json").read_text())["continuous"]
    assert len(state["groups"]) == 3 and state["running"] >= 1  # S groups launched, some decoding mid-response
    resumed = tmp_path / "resumed"
    Trainer(compose([*common, f"trainer.resume={checkpoint}", f"trainer.output_dir={resumed}"]), resumed).train()
    expected = [line for line in steady_lines(first) if line["step"] >= 2]
    assert [line["step"] for line in expected] == [2, 3]
    assert steady_lines(resumed) == expected
    assert [s for s in samples(resumed)] == [s for s in samples(first) if s[0] >= 2]


@pytest.mark.parametrize("over_cap", ["drop", "wait"])
def test_the_staleness_cap_drops_or_samples_again_the_groups_over_it(compose, tiny_overrides, tmp_path,
                                                                      over_cap) -> None:
    """Cap 1 with four groups launched for batches of two: groups whose oldest token is 2 or more updates old are
    out of the loss (drop, their share logged) or sampled again from now (wait: nothing trained is over the cap)."""
    folder = tmp_path / over_cap
    base = [*tiny_overrides(None), *STEPS, "trainer.steps=6", "generation.continuous=true",
            "generation.engine_groups=4", "generation.update_every_tokens=2", "generation.weight_updates=in_flight",
            f"trainer.output_dir={folder}"]
    Trainer(compose([*base, "generation.staleness_cap=1", f"generation.over_cap={over_cap}"]), folder).train()
    lines = steady_lines(folder)
    uncapped = tmp_path / "uncapped"
    Trainer(compose([*base[:-1], f"trainer.output_dir={uncapped}"]), uncapped).train()
    assert max(line["staleness/sample_max"] for line in steady_lines(uncapped)) >= 2.0
    if over_cap == "drop":
        assert any(line["rollout/stale_dropped_frac"] > 0 for line in lines)
        assert all(line["rollout/stale_waited_frac"] == 0 for line in lines)
    else:
        assert any(line["rollout/stale_waited_frac"] > 0 for line in lines)
        assert all(line["staleness/sample_max"] <= 1.0 for line in lines)
        waited = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert any(line["async/wait_ticks"] > 0 for line in waited)


@pytest.mark.parametrize(("override", "message"), [
    (["generation.weight_updates=batch"], r"^generation.continuous=true with generation.weight_updates=batch: .* "
     r"set generation.weight_updates=in_flight .* or partial \(recomputed\)$"),
    (["generation.engine_groups=1"], r"^generation.engine_groups=1 is out of range; an integer ≥ "
     r"trainer.prompts_per_step \(2: the groups a step takes\), or null for twice that$"),
    (["generation.max_staleness=1"], r"^generation.continuous=true with generation.max_staleness=1: its lag comes "
     r"from the clock; drop one of the two$"),
    (["trainer.strategy=fsdp"], r"^generation.continuous=true with trainer.strategy=fsdp: .*; drop one of the two$"),
    (["algorithm.dynamic_sampling=true"], r"^generation.continuous=true with algorithm.dynamic_sampling=true: .*$"),
    (["generation.update_every_tokens=-1"], r"^generation.update_every_tokens=-1 is out of range; .*integer ≥ 0"),
    (["generation=vllm_server", "generation.sync_folder=/tmp/sync", "generation.update_every_tokens=2"],
     r"^generation.update_every_tokens=2 scripts the simulator's clock; with generation=vllm_server a version lands "
     r"when the trainer publishes it: leave it 0$"),
])
def test_settings_it_cannot_run_are_one_line(compose, tiny_overrides, override: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose([*tiny_overrides(None), "generation.continuous=true", "generation.weight_updates=in_flight",
                 *override])


def test_a_colocated_vllm_engine_is_one_line(compose, tiny_overrides) -> None:
    """``generation=vllm`` (colocated) with ``generation.continuous``: refused, naming the engines that run it (checked
    on the config itself: composing ``generation=vllm`` first needs vLLM installed)."""
    from omegaconf import OmegaConf, open_dict

    from rlhf_lab.config.validate_async import check_continuous

    cfg = compose([*tiny_overrides(None), "generation.continuous=true", "generation.weight_updates=in_flight"])
    OmegaConf.set_readonly(cfg, False)
    with open_dict(cfg):
        cfg.generation.name = "vllm"
    with pytest.raises(ConfigError, match=r"^generation.continuous=true with generation=vllm: the engine that never "
                                          r"stops is the hf decode's: simulated in the trainer \(generation=hf\), or "
                                          r"for real on rlhf-lab serve --engine hf \(generation=vllm_server\); drop "
                                          r"one of the two$"):
        check_continuous(cfg)


def test_engine_groups_without_the_simulator_is_one_line(compose, tiny_overrides) -> None:
    with pytest.raises(ConfigError, match=r"^generation.engine_groups=4 sizes the continuous simulator's engine, "
                                          r"which is off: set generation.continuous=true, or "
                                          r"generation.engine_groups=null$"):
        compose([*tiny_overrides(None), "generation.engine_groups=4"])


def test_sigkill_and_resume_train_on_the_same_samples_as_an_uninterrupted_run(tmp_path) -> None:
    """A continuous run (groups in flight across every checkpoint) killed by SIGKILL after step 3 and resumed with
    ``trainer.resume=auto`` ends with the uninterrupted run's metrics and samples, line for line."""
    import signal

    from tests.integration.test_resume import Run, assert_same_history

    overrides = ["algorithm=grpo", "trainer.seed_per_prompt=true", "generation.continuous=true",
                 "generation.engine_groups=3", "generation.weight_updates=in_flight",
                 "generation.update_every_tokens=2", "trainer.checkpoint_every=1", "trainer.keep_last_n=2",
                 "trainer.resume=auto"]
    reference = Run(tmp_path, tmp_path / "reference", *overrides)
    victim = Run(tmp_path, tmp_path / "run", *overrides)
    victim.wait_for_step(3)
    victim.process.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    resumed = Run(tmp_path, tmp_path / "run", *overrides)
    assert resumed.wait() == 0, resumed.output
    assert "resumed from" in resumed.output and "Traceback" not in resumed.output
    assert reference.wait() == 0, reference.output
    assert_same_history(tmp_path / "run", tmp_path / "reference")
