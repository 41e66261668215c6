"""The continuous simulator's engine (rlhf_lab/generation/continuous.py) on its own: a group decoded with no update
landing is the hf engine's sample of that prompt and seed; the buffer hands out groups in the order they completed,
each token stamped with the tick's version; and of two groups launched together, the longer is never trained first."""

from __future__ import annotations

import pytest
import torch

from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.continuous import ContinuousEngine
from rlhf_lab.generation.hf import HFGeneration

PROMPTS = ["the movie was", "a great film", "i did not like", "what a story", "so boring", "the actors"]
GROUP = 2


@pytest.fixture(name="engine")
def engine_fixture(compose, tiny_overrides, tiny_tokenizer):
    from rlhf_lab.models.loading import build_policy

    policy = build_policy(compose(tiny_overrides(None)).model, tiny_tokenizer, "float32", 0).policy
    return HFGeneration(policy, tiny_tokenizer, SamplingSettings(max_new_tokens=10, max_prompt_tokens=64, stop=("e", "s")),
                        keep_logits=False)


def simulator(engine: HFGeneration, groups: int, every: int, clock: list[int]) -> ContinuousEngine:
    continuous = ContinuousEngine(engine, GROUP, groups, every, partial=False, version=lambda: clock[0])
    continuous.source = lambda n: (PROMPTS[n % len(PROMPTS)], f"prompt {n}", 100 + n)
    return continuous


def test_a_group_with_no_update_landing_is_the_hf_engine_s_sample(engine) -> None:
    continuous = simulator(engine, 1, 0, [0])
    (group,) = continuous.take(1)
    alone = continuous.samples([group])
    expected = engine.generate([PROMPTS[0]], GROUP, seeds=[100])
    assert torch.equal(alone.response_ids, expected.response_ids)
    assert torch.equal(alone.response_mask, expected.response_mask)
    torch.testing.assert_close(alone.logprobs, expected.logprobs, rtol=0, atol=1e-6)
    assert int(alone.versions.max()) == 0
    assert group.completed == group.launched + len(group.versions) == int(alone.response_mask.sum(-1).max())


def test_groups_are_taken_as_they_complete_and_long_ones_trained_late(engine) -> None:
    """Four groups launched, batches of two, an update every 3 ticks (the weights moved at each, so the samples
    change): each batch is the groups completed first; a token's version is the clock's when it was sampled; of two
    groups launched at the same tick the longer is never taken at an earlier step than the shorter."""
    clock = [0]
    continuous = simulator(engine, 4, 3, clock)
    taken: list[tuple[int, object]] = []  # (the step that trained it, the group)
    generator = torch.Generator().manual_seed(0)
    for step in range(8):
        groups = continuous.take(2)
        assert [g.completed for g in groups] == sorted(g.completed for g in groups)
        assert all(g.completed <= other.completed for g in groups for other in continuous.buffer)
        rollout = continuous.samples(groups)
        for row, group in enumerate(groups):
            mask = rollout.response_mask[row * GROUP:(row + 1) * GROUP] > 0
            versions = rollout.versions[row * GROUP:(row + 1) * GROUP]
            assert group.versions == sorted(group.versions) and group.versions[-1] <= step
            assert torch.equal(versions[mask], torch.tensor(group.versions)[mask.nonzero()[:, 1]])
            taken.append((step, group))
        continuous.run(continuous.every)
        clock[0] += 1
        with torch.no_grad():
            for parameter in engine.policy.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    pairs = [(a, b) for a in taken for b in taken if a[1].launched == b[1].launched
             and len(a[1].versions) > len(b[1].versions)]
    assert any(longer[0] > shorter[0] for longer, shorter in pairs)  # the longer one trained later at least once
    assert all(longer[0] >= shorter[0] for longer, shorter in pairs)
    assert any(len(set(g.versions)) > 1 for _, g in taken)  # some span several versions


def test_the_state_read_back_goes_on_with_the_same_tokens(engine) -> None:
    """Mid-decode, the engine's state into a fresh one: both sample the same next batches, token for token."""
    clock = [0]
    first = simulator(engine, 3, 2, clock)
    first.take(2)
    first.run(2)
    tensors, plain = first.state()
    second = simulator(engine, 3, 2, clock)
    second.load_state(tensors, plain)
    assert any(not g.decoding.done and g.decoding.step for g in second.running)
    for _ in range(3):
        a, b = first.samples(first.take(2)), second.samples(second.take(2))
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.versions, b.versions)
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=0)
