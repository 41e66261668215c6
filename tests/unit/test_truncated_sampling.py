"""Sampling with top-k / top-p draws from a truncated distribution q, not the policy softmax(logits / T): every
engine reports the sampled tokens' log-probs of q (the hf decode as vLLM's ``processed_logprobs``), the trainer's
π_old is the trainer's softmax(logits / T) with q kept as the sampler's μ, the weight-sync canary compares q with q,
and ``generation.logprobs=sampler`` (π_old := q) is refused."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf_lab.config import ConfigError
from rlhf_lab.generation import vllm as vllm_engine
from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.decode import sampled_log_softmax, truncates
from rlhf_lab.generation.hf import generate
from rlhf_lab.generation.sync_check import SyncCheck
from rlhf_lab.models import loading
from rlhf_lab.runtime.precision import Precision
from rlhf_lab.step.scoring_pass import ScoringPlan
from tests import fake_vllm

TRUNCATED = SamplingSettings(max_new_tokens=6, max_prompt_tokens=64, temperature=0.7, top_p=0.9, top_k=20)


def test_the_truncated_distribution_by_hand() -> None:
    scaled = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    # top-k 2: the two largest, renormalised.
    assert torch.allclose(sampled_log_softmax(scaled, 2, 1.0).exp(), torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top-p 0.8: ascending cumulative mass 0.05, 0.15, 0.30 (≤ 0.2: the first two go), then 0.5, 1.0: three stay.
    kept = torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85
    assert torch.allclose(sampled_log_softmax(scaled, 0, 0.8).exp(), kept)
    assert torch.allclose(sampled_log_softmax(scaled, 0, 1.0), scaled.log_softmax(-1))  # no truncation
    assert truncates(20, 1.0) and truncates(0, 0.9) and not truncates(0, 1.0)


def test_it_is_the_stand_in_vllm_s_truncation() -> None:
    """Two implementations (the decode's transformers warpers; the stand-in's, written from vLLM's sampler) keep the
    same tokens and give the same log-probs on random logits."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        scaled = torch.randn(300, generator=generator) * 3
        ours = sampled_log_softmax(scaled, 20, 0.9)
        theirs = fake_vllm.truncated(scaled, 20, 0.9).log_softmax(-1)
        assert torch.equal(ours.isinf(), theirs.isinf())
        assert torch.allclose(ours[~ours.isinf()], theirs[~theirs.isinf()], atol=1e-6)


def test_the_hf_decode_reports_the_log_probs_of_what_it_sampled(compose, tiny_overrides, tiny_tokenizer) -> None:
    model = loading.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0).eval()
    torch.manual_seed(0)
    rollout = generate(model, tiny_tokenizer, ["Hi there"], group_size=4, max_new_tokens=6, temperature=0.7,
                       top_p=0.9, top_k=20, max_prompt_tokens=64, keep_logits=False)
    with torch.no_grad():
        logits = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits.float()
    width = rollout.prompt_width
    scaled = logits[:, width - 1 : -1] / 0.7
    scaled[:, 0, tiny_tokenizer.eos_token_id] = -math.inf  # at least one token: no EOS first (both engines)
    expected = sampled_log_softmax(scaled, 20, 0.9).gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    mask = rollout.response_mask.bool()
    assert torch.allclose(rollout.logprobs[mask], expected[mask], atol=1e-5)
    full = scaled.log_softmax(-1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    assert float((rollout.logprobs - full)[mask].min()) > 0.05  # q renormalises over fewer tokens: above softmax's


@pytest.mark.parametrize(("settings", "rescore", "old_from_update"), [
    (["trainer.top_p=0.9"], False, True), (["trainer.top_k=20"], False, True), ([], False, False),
    (["trainer.top_p=0.9", "algorithm.epochs=2"], True, False), (["algorithm.epochs=2"], False, False)])
def test_pi_old_is_never_the_engines_where_sampling_truncates(compose, tiny_overrides, settings, rescore,
                                                              old_from_update) -> None:
    """The hf engine in fp32: its log-probs are π_old (the trainer's own numbers) unless top-k/top-p truncate;
    then π_old is the training pass's own (one update per rollout) or a scoring pass's (several), and the
    engine's q stays as the sampler's μ."""
    from rlhf_lab.generation.hf import HFGeneration

    cfg = compose([*tiny_overrides(None), *settings])
    plan = ScoringPlan.from_config(cfg, HFGeneration, Precision("fp32", "cpu"), SimpleNamespace(reads_logits=False),
                                   keep_hidden=False, episodes=False)
    assert (plan.rescore, plan.old_from_update) == (rescore, old_from_update)


@pytest.mark.parametrize("setting", ["trainer.top_p=0.9", "trainer.top_k=20"])
def test_sampler_log_probs_as_pi_old_under_truncation_is_one_line(compose, tiny_overrides, setting) -> None:
    with pytest.raises(ConfigError, match=r"^generation.logprobs=sampler with trainer.top_p=.* the sampler's log-probs "
                                          r"are of the truncated distribution it drew from"):
        compose([*tiny_overrides(None), "generation.logprobs=sampler", setting])


def test_the_canary_rides_in_a_truncated_batch_and_compares_like_with_like(compose, tiny_tokenizer,
                                                                         monkeypatch) -> None:
    """On the stand-in vLLM (processed log-probs, truncated as vLLM does): the probe rides in a top-p/top-k batch,
    sampled as the batch is, and the trainer's log-probs of it, truncated alike, equal the engine's; compared with
    the untruncated softmax they would differ by the renormalisation."""
    fake_vllm.install(monkeypatch)
    cfg = compose(["model=tiny", "trainer.precision=fp32"])
    policy = loading.build_tiny_llama(tiny_tokenizer, cfg.model.tiny, seed=0).eval()
    engine = vllm_engine.VLLMGeneration(policy, tiny_tokenizer, TRUNCATED, options={"sleep": False})
    probe = SyncCheck.from_prompt(tiny_tokenizer, "Say something kind about the sea.", 0.0, Precision("fp32", "cpu"),
                                  torch.device("cpu"))
    _, carried = engine.generate_probed(probe.probe_ids, probe.settings, ["Hi there"], 2, seeds=[1])
    assert carried is not None and carried.response_mask.sum() == 2
    like = probe.judge(carried, policy, 0, 0.7, top_k=20, top_p=0.9)["rollout/weight_sync_diff"]
    unlike = probe.difference(carried, policy, 0.7)
    assert like < 1e-5 < 0.01 < unlike


def test_a_truncated_run_on_the_stand_in_vllm_checks_every_sync(compose, tiny_overrides, tmp_path,
                                                                monkeypatch) -> None:
    """A run sampling at temperature 0.7, top-p 0.9, top-k 20 on the stand-in vLLM: every weight sync's canary rides
    in the step's batch and finds the engine's q equal to the trainer's (fp32), and π_old is the trainer's with
    the engine's q kept as μ (``rollout/logprob_diff_*``: the truncation's renormalisation, not zero)."""
    import json

    from rlhf_lab.training.loop import Trainer

    fake_vllm.install(monkeypatch)
    cfg = compose([*tiny_overrides(tmp_path), "generation=vllm", "generation.sleep=true", "trainer.steps=3",
                   "trainer.temperature=0.7", "trainer.top_p=0.9", "trainer.top_k=20", "trainer.max_new_tokens=6",
                   "trainer.eval_prompts=0"])
    Trainer(cfg, tmp_path / "run").train()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward/mean" in line]
    assert len(steps) == 3
    assert all(line["rollout/weight_sync_diff"] < 1e-4 for line in steps), steps
    assert all(line["rollout/logprob_diff_max"] > 1e-3 for line in steps)
    assert fake_vllm.LLM.built[0].calls.count("generate") == 3  # the canary in the batches' calls, none of its own
