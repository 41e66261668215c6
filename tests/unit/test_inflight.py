"""Weight updates landing mid-generation (``generation.weight_updates``, rlhf_lab/generation/inflight.py): the scripted
clock's versions per token, a partial rollout's log-probs equal to each version's own scoring of the sequence, an
in-flight update's cache of the older weights kept, the current weights back after the block, bit-identical repeats,
and the batch mode wherever no update lands."""

from __future__ import annotations

import pytest
import torch

from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.hf import HFGeneration
from rlhf_lab.generation.staleness import SnapshotRing
from rlhf_lab.generation.worker import RolloutWorker
from rlhf_lab.scoring.forward import position_ids_from_mask

PROMPTS = ["the movie was", "a great film"]
NEW_TOKENS = 6


@pytest.fixture(name="setup")
def setup_fixture(compose, tiny_overrides, tiny_tokenizer):
    """A tiny policy after 2 updates, the ring holding the weights of 0, 1 and 2 updates (each update a visible move),
    and its hf engine; the versions' parameters kept for the scoring reference."""
    from rlhf_lab.models.loading import build_policy

    cfg = compose([*tiny_overrides(None)])
    policy = build_policy(cfg.model, tiny_tokenizer, "float32", 0).policy
    ring = SnapshotRing(policy, staleness=2)
    generator = torch.Generator().manual_seed(3)
    for version in range(2):
        ring.remember(version)
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    ring.remember(2)
    engine = HFGeneration(policy, tiny_tokenizer, SamplingSettings(max_new_tokens=NEW_TOKENS, temperature=1.0),
                          keep_logits=False)
    return policy, ring, engine, dict(ring.snapshots)


def sample(setup, inflight):
    """A training batch of the policy after 2 updates, k = 2 behind (it starts with the weights of 0 updates)."""
    policy, ring, engine, versions = setup
    ring.snapshots = dict(versions)  # a batch's end drops the versions no later step samples with
    worker = RolloutWorker(engine, policy, ring=ring, inflight=inflight)
    worker.policy_version = 2
    with worker.lagging():
        return worker.generate(PROMPTS, 2, seeds=[11, 12])


@torch.no_grad()
def scored(setup, rollout, version):
    """The sampled tokens' log-probs under the weights of ``version``: one forward pass over each whole sequence."""
    policy, ring, _, versions = setup
    ring.snapshots = dict(versions)
    with ring.weights_of(version, current=2):
        mask = rollout.attention_mask
        logits = policy(input_ids=rollout.input_ids, attention_mask=mask,
                        position_ids=position_ids_from_mask(mask)).logits
    width = rollout.prompt_width
    logprobs = logits[:, width - 1 : -1].float().log_softmax(-1)
    return logprobs.gather(-1, rollout.response_ids[..., None]).squeeze(-1) * rollout.response_mask


def test_each_token_carries_the_version_that_sampled_it(setup) -> None:
    """Every 2 decode steps a version lands: steps 0–1 of version 0, 2–3 of 1, 4–5 of 2 (capped at the current)."""
    policy = setup[0]
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    rollout = sample(setup, (True, 2))
    expected = torch.tensor([0, 0, 1, 1, 2, 2])[: rollout.response_mask.shape[1]]
    assert torch.equal(rollout.versions, expected[None].expand_as(rollout.versions) * (rollout.response_mask > 0))
    assert all(torch.equal(p, before[name]) for name, p in policy.named_parameters())  # the current weights back
    batch = sample(setup, None)
    assert torch.equal(batch.versions, torch.zeros_like(batch.versions))  # one version: the ring's 0


def test_a_partial_rollout_s_log_probs_are_each_version_s_own(setup) -> None:
    """The cache recomputed at each landing: the log-prob of the token of step s is exactly what the weights of its
    version give the whole sequence (float32 rounding of a cache against one pass)."""
    rollout = sample(setup, (True, 2))
    mask = rollout.response_mask
    assert int(mask.sum(-1).min()) == NEW_TOKENS  # every row long enough to span the three versions
    for version in (0, 1, 2):
        columns = rollout.versions == version
        own = scored(setup, rollout, version)
        torch.testing.assert_close(rollout.logprobs[columns & (mask > 0)], own[columns & (mask > 0)], rtol=0,
                                   atol=2e-5)


def test_an_in_flight_update_keeps_the_older_weights_cache(setup) -> None:
    """In flight, the token after a landing attends to keys and values the older weights computed: its log-prob is
    neither version's own score of the sequence, while the first version's tokens are version 0's."""
    rollout = sample(setup, (False, 2))
    first = rollout.versions == 0
    torch.testing.assert_close(rollout.logprobs[first & (rollout.response_mask > 0)],
                               scored(setup, rollout, 0)[first & (rollout.response_mask > 0)], rtol=0, atol=2e-5)
    later = (rollout.versions == 1) & (rollout.response_mask > 0)
    assert later.any()
    gap = (rollout.logprobs - scored(setup, rollout, 1)).abs()[later].max()
    assert gap > 1e-3


def test_repeats_are_bit_identical_and_no_landing_is_the_batch_mode(setup) -> None:
    first, second = sample(setup, (False, 2)), sample(setup, (False, 2))
    assert torch.equal(first.input_ids, second.input_ids) and torch.equal(first.logprobs, second.logprobs)
    never = sample(setup, (True, NEW_TOKENS))  # the first landing would be after the last step
    batch = sample(setup, None)
    assert torch.equal(never.input_ids, batch.input_ids) and torch.equal(never.logprobs, batch.logprobs)
    assert torch.equal(never.versions, batch.versions)


def test_staleness_metrics_by_hand() -> None:
    """Trained by the policy after 5 updates. Row 0: tokens of versions 3, 3, 4 (oldest 3: staleness 2, spans two
    versions); row 1: 5, 5, then padding (staleness 0); row 2: 4 (staleness 1). Tokens' staleness 2, 2, 1, 0, 0, 1:
    mean 1; samples 2, 0, 1: mean 1, max 2, one of three spans versions; one sample at each staleness."""
    from rlhf_lab.generation.rollout import Rollout
    from rlhf_lab.step.step_metrics import staleness_metrics

    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    versions = torch.tensor([[3, 3, 4], [5, 5, 0], [4, 0, 0]])
    rollout = Rollout(input_ids=torch.zeros(3, 4, dtype=torch.long), attention_mask=torch.ones(3, 4, dtype=torch.long),
                      response_mask=mask, prompt_width=1, group_size=1, logprobs=torch.zeros(3, 3),
                      entropy=torch.zeros(3, 3), versions=versions)
    metrics = staleness_metrics(rollout, trained_at=5)
    assert metrics == {"staleness/token_mean": 1.0, "staleness/sample_mean": 1.0,
                       "staleness/sample_max": 2.0, "staleness/multi_version_frac": pytest.approx(1 / 3),
                       "staleness/samples_at_0": 1.0, "staleness/samples_at_1": 1.0, "staleness/samples_at_2": 1.0}
    assert staleness_metrics(rollout.select(torch.tensor([0])), trained_at=5)["staleness/multi_version_frac"] == 1.0


@pytest.mark.parametrize(("overrides", "expected"), [
    (["generation.weight_updates=in_flight"], "generation.weight_updates=in_flight lands the weights of newer "
                                              "updates mid-generation from the snapshots"),
    (["generation.weight_updates=partial", "generation.max_staleness=1", "generation.simulate_staleness=true"],
     "generation.update_every_tokens=0 is out of range"),
    (["generation.weight_updates=partial", "generation.max_staleness=1", "generation.simulate_staleness=true",
      "generation.update_every_tokens=2", "hardware=cpu_tuned"], "with hardware.generation_weights=true"),
    (["generation.weight_updates=sometimes"], "generation.weight_updates='sometimes' is not valid; choose from: "
                                              "batch, in_flight, partial"),
])
def test_weight_update_settings_that_cannot_run_are_one_line(compose, tiny_overrides, overrides, expected) -> None:
    from rlhf_lab.config import ConfigError

    with pytest.raises(ConfigError) as raised:
        compose([*tiny_overrides(None), *overrides])
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_a_landing_under_autocast_is_sampled_with_the_new_weights(setup) -> None:
    """bf16-mixed: autocast caches its casts of the weights for the whole decode, so a landing must clear them; the
    tokens after it then score as the newest version's (to bf16 rounding), not as the first's."""
    from rlhf_lab.runtime.precision import Precision

    policy, ring, engine, versions = setup
    engine.precision = Precision("bf16-mixed", "cpu")
    try:
        rollout = sample(setup, (True, 2))
        newest = (rollout.versions == 2) & (rollout.response_mask > 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            own, first = scored(setup, rollout, 2), scored(setup, rollout, 0)
    finally:
        engine.precision = Precision("fp32", "cpu")
    gap_own = (rollout.logprobs - own).abs()[newest].max()
    gap_first = (rollout.logprobs - first).abs()[newest].max()
    assert gap_own < 0.05 < gap_first, (gap_own, gap_first)
