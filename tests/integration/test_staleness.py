"""``generation.max_staleness=1``: each batch is sampled one update behind, the trainer's own pass gives π_old and
the correction, a checkpoint holds the batch in flight, and a server engine samples while the trainer trains.

In-process on the tiny model (fp32, so the sampler's and the trainer's numbers match exactly at equal weights).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from rlhf_lab.errors import ConfigError
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.hf import HFGeneration
from rlhf_lab.step.update import Updater
from rlhf_lab.training.loop import Trainer
from tests.limits import HANG_GUARD_S

# Rewards that differ within a group from the first step (a word-count band the tiny model's responses straddle),
# so every update moves the weights.
STEPS = ["trainer.steps=4", "trainer.eval_prompts=0", "trainer.lr=1e-2", "trainer.seed_per_prompt=true",
         "trainer.max_new_tokens=8", "reward=length", "reward.min_words=1", "reward.max_words=2",
         "reward.slope_words=1"]
WALL_TIME = ("time/", "throughput/", "perf/")


def weights_sum(module: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in module.parameters()))


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steady(line: dict) -> dict:
    return {k: v for k, v in line.items() if not k.startswith(WALL_TIME)}


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
def test_each_batch_is_sampled_by_the_weights_k_updates_behind(compose, tiny_overrides, tmp_path, monkeypatch,
                                                               staleness) -> None:
    """Weights at each generation against those after each update: staleness k samples step t with the weights
    of max(t − k, 0) updates (staleness 1: step 0 and step 1 both with the initial ones)."""
    sampled, updated = [], []
    generate, update = HFGeneration.generate, Updater.update

    def recording_generate(self, *args, **kwargs):
        sampled.append(weights_sum(self.policy))
        return generate(self, *args, **kwargs)

    def recording_update(self, *args, **kwargs):
        stats = update(self, *args, **kwargs)
        updated.append(weights_sum(self.policy))
        return stats

    monkeypatch.setattr(HFGeneration, "generate", recording_generate)
    monkeypatch.setattr(Updater, "update", recording_update)
    Trainer(compose([*tiny_overrides(None), *STEPS, f"generation.max_staleness={staleness}"]), tmp_path).train()
    assert len(sampled) == 4 and len(updated) == 4 and len(set(updated)) == 4
    versions = [sampled[0], *updated]  # the weights after 0, 1, 2, ... updates
    assert sampled == [versions[max(step - staleness, 0)] for step in range(4)]


def test_pi_old_is_the_trainers_and_the_correction_sees_the_lag(compose, tiny_overrides, tmp_path) -> None:
    """Step 0's batch comes from the weights it trains (sampler = trainer to float rounding); from step 1 on the
    sampler is an update behind: the logged difference and the importance weights show it."""
    Trainer(compose([*tiny_overrides(None), *STEPS, "generation.max_staleness=1", "algorithm.tis_cap=2"]),
            tmp_path).train()
    steps = [line for line in lines(tmp_path) if "reward/mean" in line]
    assert [line["step"] for line in steps] == [0, 1, 2, 3]
    assert steps[0]["rollout/logprob_diff_max"] < 1e-5
    assert all(line["rollout/logprob_diff_max"] > 1e-4 for line in steps[1:]), steps
    assert steps[0]["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(abs(line["rollout/is_weight_mean"] - 1.0) > 1e-6 for line in steps[1:])


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_resumed_run_trains_on_the_batches_that_were_in_flight(compose, tiny_overrides, tmp_path,
                                                                 staleness: int) -> None:
    """Checkpoint after step 1 (the next k steps' batches already sampled): resumed elsewhere, steps 2 and 3 log
    exactly what the uninterrupted run logged."""
    common = [*tiny_overrides(None), *STEPS, f"generation.max_staleness={staleness}", "trainer.checkpoint_every=2",
              "trainer.keep_last_n=2"]
    whole = tmp_path / "whole"
    Trainer(compose(common), whole).train()
    checkpoint = whole / "checkpoints" / "step_2"
    assert (checkpoint / "ahead.safetensors").is_file()
    resumed = tmp_path / "resumed"
    Trainer(compose([*common, f"trainer.resume={checkpoint}"]), resumed).train()
    expected = [steady(line) for line in lines(whole) if line["step"] >= 2]
    assert [line["step"] for line in expected] == [2, 3]
    assert [steady(line) for line in lines(resumed)] == expected


def test_staleness_values_and_dynamic_sampling_are_checked(compose, tiny_overrides) -> None:
    for value in (17, -1):
        with pytest.raises(ConfigError, match=rf"^generation.max_staleness={value} is out of range; must be an "
                                              r"integer from 0 \(on-policy\) to 16"):
            compose([*tiny_overrides(None), f"generation.max_staleness={value}"])
    with pytest.raises(ConfigError, match=r"generation.max_staleness=2 samples each batch 2 step\(s\) before its own"):
        compose([*tiny_overrides(None), "generation.max_staleness=2", "algorithm=dapo"])


class _GatedServer:
    """A stand-in ``rlhf-lab serve`` whose ``/generate`` answers only once ``gate`` is set."""

    def __init__(self) -> None:
        self.gate, self.answered = threading.Event(), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                body: dict = {"ok": True}
                if self.path == "/generate":
                    outer.gate.wait(HANG_GUARD_S)
                    rows = len(request["prompt_ids"]) * request["group_size"]
                    body = {"samples": [[[7, 8], [-0.5, -0.25]] for _ in range(rows)]}
                    outer.answered.append(rows)
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def test_a_server_engine_samples_while_the_trainer_goes_on(compose, tiny_overrides, tmp_path) -> None:
    """``submit`` returns with the request still unanswered; the claim waits for the answer and builds the
    rollout from it."""
    from rlhf_lab.generation.server import VLLMServerGeneration
    from rlhf_lab.models.loading import build_policy, load_tokenizer

    cfg = compose(tiny_overrides(None))
    tokenizer = load_tokenizer(cfg.model)
    policy = build_policy(cfg.model, tokenizer, "float32", 0).policy
    server = _GatedServer()
    (tmp_path / "sync").mkdir()
    (tmp_path / "sync" / ".serve_token").write_text("a token")  # where rlhf-lab serve writes its own (mode 0600)
    (tmp_path / "sync" / ".serve_token").chmod(0o600)
    try:
        engine = VLLMServerGeneration(policy, tokenizer, SamplingSettings(max_new_tokens=2), options={
            "url": server.url, "sync_folder": str(tmp_path / "sync")})
        claim = engine.submit(["a prompt", "another"], 2, seeds=[1, 2])
        assert server.answered == []  # the server is still on it, and the trainer's thread is free
        server.gate.set()
        rollout = claim()
        assert server.answered == [4]
        assert rollout.response_ids.tolist() == [[7, 8]] * 4
        assert torch.allclose(rollout.logprobs, torch.tensor([[-0.5, -0.25]] * 4))
    finally:
        server.gate.set()
        server.server.shutdown()


@pytest.mark.parametrize("simulated", [False, True])
def test_the_sampler_s_kept_head_inputs_are_read_with_the_sampler_s_head(compose, tiny_overrides, tmp_path,
                                                                         simulated: bool) -> None:
    """With ``generation.logprobs=sampler`` and the exact KL, a batch sampled ahead is scored from the logits the
    decode kept, after an update. Kept as the LM head's inputs (``trainer.chunked_logprobs``), they are read with a
    copy of the head as it sampled: the run's exact KL equals the run that keeps the whole logits, step by step
    (read with the updated head instead, every batch scored after an update differs: steps 1 and 2). Likewise
    where the lag is simulated (each step samples with the weights of one update before, then scores)."""
    common = [*tiny_overrides(None), *STEPS, "trainer.steps=3", "generation.max_staleness=1",
              "generation.logprobs=sampler", "kl.exact=step", "trainer.lm_head_chunk=3",
              f"generation.simulate_staleness={str(simulated).lower()}"]
    for chunked in ("true", "false"):
        Trainer(compose([*common, f"trainer.chunked_logprobs={chunked}"]), tmp_path / chunked).train()
    kl = {chunked: [line["kl/exact"] for line in lines(tmp_path / chunked) if "kl/exact" in line]
          for chunked in ("true", "false")}
    assert len(kl["true"]) == 3 and kl["true"][2] > 1e-3  # steps 0 and 1 sampled by the initial policy: 0
    assert kl["true"] == pytest.approx(kl["false"], rel=1e-4, abs=1e-6)  # (with the updated head: 6e-4 and 5% off)
