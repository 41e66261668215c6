"""``generation.simulate_staleness``: step t samples its own prompts with the weights of max(t − k, 0) updates, kept on
the host (rlhf_lab/generation/staleness.py). Checked against the policy of step t − k rebuilt from saved weights,
against the hold-ahead mode (the same lag, the same trainer diagnostics), across a resume, on the exact task and
on the stand-in vLLM (the snapshot loaded into the engine, the canary passing against it).

In-process on the tiny model (fp32, so the sampler's and the trainer's numbers match exactly at equal weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_lab.errors import CheckpointError, ConfigError
from rlhf_lab.generation.hf import HFGeneration
from rlhf_lab.generation.staleness import RING_FILE
from rlhf_lab.models.loading import build_policy, load_tokenizer
from rlhf_lab.step.update import Updater
from rlhf_lab.training.loop import Trainer

# Rewards that differ within a group from the first step, so every update moves the weights (as test_staleness.py).
STEPS = ["trainer.steps=4", "trainer.eval_prompts=0", "trainer.lr=1e-2", "trainer.seed_per_prompt=true",
         "trainer.max_new_tokens=8", "reward=length", "reward.min_words=1", "reward.max_words=2",
         "reward.slope_words=1", "algorithm.tis_cap=2"]
WALL_TIME = ("time/", "throughput/", "perf/")


def steady_lines(run_dir: Path) -> list[dict]:
    """The run's metrics lines without the wall-clock measurements."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if not k.startswith(WALL_TIME)} for line in lines]


def copy_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


@pytest.mark.parametrize("staleness", [1, 2])
def test_step_t_samples_what_the_policy_of_t_minus_k_gives_and_trains_as_hold_ahead(
        compose, tiny_overrides, tmp_path, monkeypatch, staleness: int) -> None:
    """Each generation's request is replayed on a fresh model loaded with the weights saved after max(t − k, 0)
    updates: the same tokens and log-probs. The whole run logs what the hold-ahead mode logs (with per-prompt seeds
    both draw step t's prompts from the same weights), the lag visible in the trainer's off-policy diagnostics."""
    requests, saved = [], []
    generate, update = HFGeneration.generate, Updater.update

    def recording_generate(self, prompts, group_size, seeds=None, greedy=False, settings=None):
        rollout = generate(self, prompts, group_size, seeds=seeds, greedy=greedy, settings=settings)
        requests.append((prompts, group_size, seeds, settings, rollout.response_ids.clone(), rollout.logprobs.clone()))
        return rollout

    def recording_update(self, *args, **kwargs):
        stats = update(self, *args, **kwargs)
        saved.append(copy_state(self.policy))
        return stats

    common = [*tiny_overrides(None), *STEPS, f"generation.max_staleness={staleness}"]
    Trainer(compose([*common, "generation.simulate_staleness=false"]), tmp_path / "ahead").train()
    monkeypatch.setattr(HFGeneration, "generate", recording_generate)
    monkeypatch.setattr(Updater, "update", recording_update)
    cfg = compose([*common, "generation.simulate_staleness=true"])
    trainer = Trainer(cfg, tmp_path / "simulated")
    saved.append(copy_state(trainer.experience.policy))  # the weights after 0 updates
    trainer.train()
    versions = saved  # after 0, 1, 2, 3, 4 updates
    assert len(requests) == 4 and len(versions) == 5

    monkeypatch.undo()  # the replays below are not recorded
    tokenizer = load_tokenizer(cfg.model)
    replica = build_policy(cfg.model, tokenizer, "float32", 0).policy
    engine = HFGeneration(replica, tokenizer, requests[0][3], keep_logits=False)
    lagged = False
    for step, (prompts, group_size, seeds, settings, response_ids, logprobs) in enumerate(requests):
        replica.load_state_dict(versions[max(step - staleness, 0)])
        again = engine.generate(prompts, group_size, seeds=seeds, settings=settings)
        assert torch.equal(again.response_ids, response_ids), step
        assert torch.allclose(again.logprobs, logprobs, atol=1e-6, rtol=0), step
        replica.load_state_dict(versions[step])  # what the current weights would have drawn
        lagged |= not torch.equal(engine.generate(prompts, group_size, seeds=seeds, settings=settings).response_ids,
                                  response_ids)
    assert lagged  # the lag changed what was drawn at some step, so the comparison above tells the weights apart

    simulated, ahead = steady_lines(tmp_path / "simulated"), steady_lines(tmp_path / "ahead")
    assert simulated == ahead
    steps = [line for line in simulated if "reward/mean" in line]
    assert [line["step"] for line in steps] == [0, 1, 2, 3]
    assert steps[0]["rollout/logprob_diff_max"] < 1e-5
    assert all(line["rollout/logprob_diff_max"] > 1e-4 for line in steps[1:]), steps
    assert steps[0]["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(abs(line["rollout/is_weight_mean"] - 1.0) > 1e-6 for line in steps[1:])


@pytest.mark.parametrize("updates", ["batch", "in_flight", "partial"])
def test_a_resumed_run_samples_with_the_checkpoint_s_snapshots(compose, tiny_overrides, tmp_path, updates) -> None:
    """Checkpoint after step 1 under k = 2: it holds the snapshots of 0 and 1 updates (what steps 2 and 3 sample
    with); resumed elsewhere, steps 2 and 3 log exactly what the uninterrupted run logged — with weight updates
    landing mid-generation too (every 3 decode steps: the scripted clock is a function of the step alone)."""
    common = [*tiny_overrides(None), *STEPS, "generation.max_staleness=2", "generation.simulate_staleness=true",
              "trainer.checkpoint_every=2", "trainer.keep_last_n=2", f"generation.weight_updates={updates}",
              "generation.update_every_tokens=3"]
    whole = tmp_path / "whole"
    Trainer(compose(common), whole).train()
    checkpoint = whole / "checkpoints" / "step_2"
    assert not (checkpoint / "ahead.safetensors").exists()  # nothing sampled ahead
    ring = load_file(str(checkpoint / RING_FILE))
    assert {key.split("/")[0] for key in ring} == {"0", "1"}
    resumed = tmp_path / "resumed"
    Trainer(compose([*common, f"trainer.resume={checkpoint}"]), resumed).train()
    expected = [line for line in steady_lines(whole) if line["step"] >= 2]
    assert [line["step"] for line in expected] == [2, 3]
    assert steady_lines(resumed) == expected
    for line in expected:  # from step 2 on the batch starts 2 updates behind; in flight its later tokens are newer
        assert line["staleness/sample_max"] == 2.0
        if updates == "batch":
            assert line["staleness/token_mean"] == 2.0 and line["staleness/multi_version_frac"] == 0.0
        else:
            assert line["staleness/token_mean"] < 2.0 and line["staleness/multi_version_frac"] > 0.0


def test_the_exact_task_runs_with_it_as_with_hold_ahead(compose, tmp_path) -> None:
    """``experiment=off_policy_kl``'s k = 2 arm: the distance to the optimum logged every step, the same numbers
    as the hold-ahead mode."""
    runs = {}
    for simulate in ("false", "true"):
        folder = tmp_path / simulate
        cfg = compose(["experiment=off_policy_kl", "+off_policy_arm=s2_sequence", "+kl_arm=k3_loss",
                       "trainer.steps=4", "trainer.exact_every=1", f"trainer.output_dir={folder}", "logger=none",
                       f"generation.simulate_staleness={simulate}"])
        assert cfg.model.name == "exact" and cfg.generation.max_staleness == 2
        Trainer(cfg, folder).train()
        runs[simulate] = steady_lines(folder)
    exact = [line for line in runs["true"] if "exact/gap" in line]
    assert len(exact) == 4
    assert all(line["rollout/logprob_diff_max"] > 1e-4 for line in runs["true"] if line["step"] >= 1
               and "rollout/logprob_diff_max" in line)
    assert runs["true"] == runs["false"]


@pytest.mark.parametrize(("override", "message"), [
    (["generation.max_staleness=0"],
     r"^generation.simulate_staleness=true with generation.max_staleness=0 has no lag to simulate: set "
     r"generation.max_staleness to 1–16, or generation.simulate_staleness=false$"),
    (["generation=vllm_server", "generation.sync_folder=/tmp/sync", "generation.max_staleness=1"],
     r"^generation.simulate_staleness=true with generation=vllm_server: a server engine lags for real .*"
     r"simulate_staleness works with generation=hf or vllm, or set generation.simulate_staleness=false$"),
    (["generation.max_staleness=1", "trainer.strategy=fsdp"],
     r"^generation.simulate_staleness=true with trainer.strategy=fsdp: .* use trainer.strategy=ddp, or "
     r"generation.simulate_staleness=false$"),
])
def test_settings_it_cannot_simulate_are_one_line(compose, tiny_overrides, override: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose([*tiny_overrides(None), *override, "generation.simulate_staleness=true"])


def test_a_checkpoint_without_snapshots_is_refused_at_resume(compose, tiny_overrides, tmp_path) -> None:
    """A hold-ahead run's checkpoint resumed with the simulation: one line naming the checkpoint and the way out."""
    common = [*tiny_overrides(None), *STEPS, "trainer.steps=2", "generation.max_staleness=1",
              "trainer.checkpoint_every=1"]
    Trainer(compose(common), tmp_path / "ahead").train()
    checkpoint = tmp_path / "ahead" / "checkpoints" / "step_1"
    with pytest.raises(CheckpointError, match=rf"^{checkpoint} holds no snapshot of the weights after 0 update\(s\), which "
                                        r"generation.simulate_staleness=true with generation.max_staleness=1 samples"):
        Trainer(compose([*common, "generation.simulate_staleness=true", f"trainer.resume={checkpoint}"]),
                tmp_path / "resumed")


@pytest.mark.parametrize("lora", [False, True])
def test_the_colocated_vllm_engine_takes_the_snapshot_and_the_canary_checks_it(compose, tiny_overrides, tmp_path,
                                                                               monkeypatch, lora: bool) -> None:
    """On the stand-in vLLM (sleeping as on a GPU), k = 2: each step's batch comes from the engine loaded with the
    weights of max(t − 2, 0) updates (``rollout/weight_version``), the weight-sync canary passing against them, and
    the evaluation in between from the current weights again."""
    from tests import fake_vllm

    fake_vllm.install(monkeypatch)
    lora_overrides = ["model.lora.enabled=true", "model.lora.r=4"] if lora else []
    cfg = compose([*tiny_overrides(tmp_path), *STEPS, *lora_overrides, "trainer.eval_every=1",
                   "trainer.eval_prompts=2", "generation=vllm", "generation.sleep=true", "trainer.max_new_tokens=6",
                   "generation.max_staleness=2", "generation.simulate_staleness=true"])
    Trainer(cfg, tmp_path / "run").train()
    lines = [line for line in steady_lines(tmp_path / "run") if "reward/mean" in line]
    assert [line["rollout/weight_version"] for line in lines] == [0, 0, 0, 1]
    checked = [line["rollout/weight_sync_diff"] for line in lines if "rollout/weight_sync_diff" in line]
    assert len(checked) >= 3 and max(checked) < 1e-4, checked
    assert all(line["rollout/logprob_diff_max"] > 1e-4 for line in lines[1:])
    llm = fake_vllm.LLM.built[0]
    assert len(fake_vllm.LLM.built) == 1 and llm.calls[-1] == f"sleep({1 if lora else 2})"
