"""Seeded sampling in one batched decode (rlhf_lab/generation/seeded.py): the samples of decoding each prompt
group alone with its seed, whatever shares the batch, with multinomial's draws and with a profile's own."""

from __future__ import annotations

import pytest
import torch

from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.decode import multinomial
from rlhf_lab.generation.hf import HFGeneration, generate
from rlhf_lab.generation.rollout import concat_rollouts
from rlhf_lab.hardware.fast_draws import sample_tokens
from rlhf_lab.models import loading as models

PROMPTS = ["Tell me about a film", "A short review:", "What did you think of the ending of that movie?"]
SEEDS = [11, 22, 33]
SETTINGS = SamplingSettings(max_new_tokens=6, temperature=1.3, max_prompt_tokens=64)


def one_group_at_a_time(model, tokenizer, sample):
    """The samples as each group decoded alone under its seed (the decode per prompt this replaces)."""
    parts = []
    for prompt, seed in zip(PROMPTS, SEEDS, strict=True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            parts.append(generate(model, tokenizer, [prompt], 2, SETTINGS.max_new_tokens, SETTINGS.temperature,
                                  1.0, 0, 64, keep_logits=False, sample=sample))
    return concat_rollouts(parts, tokenizer.pad_token_id)


@pytest.mark.parametrize("sample", [multinomial, sample_tokens], ids=["multinomial", "profile_draws"])
def test_batched_seeded_sampling_gives_each_group_s_own_samples(compose, tiny_overrides, tiny_tokenizer, sample):
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    engine = HFGeneration(model, tiny_tokenizer, SETTINGS, keep_logits=False)
    before = torch.get_rng_state()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(engine.hardware), "sample", property(lambda self: sample))  # the profile's draws
        batched = engine.generate(PROMPTS, 2, seeds=SEEDS)
        alone = engine.generate(PROMPTS[1:2], 2, seeds=SEEDS[1:2])  # the same group beside no other
    assert torch.equal(torch.get_rng_state(), before)  # the process's own stream untouched
    expected = one_group_at_a_time(model, tiny_tokenizer, sample)
    assert torch.equal(batched.response_ids, expected.response_ids)
    assert torch.equal(batched.response_mask, expected.response_mask)
    torch.testing.assert_close(batched.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)
    width = alone.response_ids.shape[1]
    assert torch.equal(alone.response_ids, batched.response_ids[2:4, :width])
    assert len(set(map(tuple, batched.response_ids.tolist()))) > 2  # the draws differ between groups


def test_one_seed_per_prompt_group(compose, tiny_overrides, tiny_tokenizer):
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        HFGeneration(model, tiny_tokenizer, SETTINGS).generate(PROMPTS, 2, seeds=SEEDS[:2])
