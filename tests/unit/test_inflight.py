"""Weight updates landing mid-generation (``generation.weight_updates``, rlhf_lab/generation/inflight.py): the scripted
clock's versions per token, a partial rollout's log-probs equal to each version's own scoring of the sequence, an
in-flight update's cache of the older weights kept, the current weights back after the block, bit-identical repeats,
and the batch mode wherever no update lands."""

from __future__ import annotations

import pytest
import torch

from rlhf_lab.generation.backend import SamplingSettings
from rlhf_lab.generation.hf import HFGeneration
from rlhf_lab.generation.rollout import Samples
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
    (["generation=vllm_server", "generation.sync_folder=/tmp/sync", "generation.weight_updates=in_flight"],
     "generation.max_staleness=0 samples none ahead: set generation.max_staleness to 1–16"),
    (["generation=vllm_server", "generation.sync_folder=/tmp/sync", "generation.weight_updates=partial",
      "generation.max_staleness=1", "generation.update_every_tokens=3"],
     "generation.update_every_tokens=3 scripts the simulator's clock"),
    (["generation=vllm_server", "generation.sync_folder=/tmp/sync", "generation.weight_updates=in_flight",
      "generation.max_staleness=1", "model.lora.enabled=true"], "a LoRA adapter reaches the server between requests"),
    (["generation.max_staleness=2", "generation.staleness_cap=0"], "generation.staleness_cap=0 is out of range"),
    (["generation.staleness_cap=1"], "generation.staleness_cap=1 with generation.max_staleness=0"),
    (["generation.max_staleness=2", "generation.simulate_staleness=true", "generation.staleness_cap=1"],
     "generation.staleness_cap=1 with generation.simulate_staleness=true"),
    (["generation.max_staleness=2", "generation.staleness_cap=1", "generation.over_cap=skip"],
     "generation.over_cap='skip' is not valid; choose from: drop, wait"),
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


def capped_batch(versions: list[list[int]], group_size: int) -> Samples:
    """A batch of len(versions) samples of 3 tokens (the last row's third token off the response)."""
    rows = len(versions)
    mask = torch.ones(rows, 3)
    mask[-1, 2] = 0
    return Samples(input_ids=torch.arange(rows * 4).view(rows, 4), attention_mask=torch.ones(rows, 4, dtype=torch.long),
                   response_mask=mask, prompt_width=1, group_size=group_size, logprobs=-torch.ones(rows, 3),
                   entropy=torch.zeros(rows, 3), versions=torch.tensor(versions) * mask.long())


def test_the_cap_reads_each_sample_s_oldest_token_and_takes_its_whole_group() -> None:
    """Trained after 5 updates with a cap of 2: a sample whose oldest token is of version 2 (3 behind) is over, and
    so is the rest of its group; tokens off the response do not count (the last row's 0 there)."""
    from rlhf_lab.generation.inflight import StalenessCap

    batch = capped_batch([[3, 3, 4], [2, 4, 4], [4, 5, 5], [5, 5, 5], [3, 3, 3], [3, 4, 0]], group_size=2)
    assert StalenessCap(2, wait=False).over(batch, 5).tolist() == [True, True, False, False, False, False]
    assert StalenessCap(1, wait=False).over(batch, 5).tolist() == [True, True, False, False, True, True]


def test_wait_samples_the_groups_over_the_cap_again_in_their_places() -> None:
    """``wait``: the groups over the cap are sampled again (here by a stand-in returning rows of version 5) and put
    back where they were; the other rows are kept as they were, token for token."""
    from rlhf_lab.generation.inflight import StalenessCap

    batch = capped_batch([[4, 4, 4], [4, 4, 4], [2, 3, 3], [2, 2, 3]], group_size=2)
    cap = StalenessCap(2, wait=True)
    over = cap.over(batch, 5)
    asked = []

    def sample(prompts, seeds):
        asked.append((prompts, seeds))
        fresh = capped_batch([[5, 5, 5], [5, 5, 5]], group_size=2)
        return Samples(**{**{f: getattr(fresh, f) for f in ("attention_mask", "response_mask", "prompt_width",
                                                            "group_size", "entropy", "versions")},
                          "input_ids": fresh.input_ids + 100, "logprobs": -2 * torch.ones(2, 3)})

    resampled = cap.resampled(batch, over, ["p0", "p1"], [7, 8], sample, pad_token_id=0)
    assert asked == [(["p1"], [8])]
    assert resampled.versions.tolist() == [[4, 4, 4], [4, 4, 4], [5, 5, 5], [5, 5, 0]]
    assert torch.equal(resampled.input_ids[:2], batch.input_ids[:2])
    assert resampled.input_ids[2:].min() >= 100 and resampled.logprobs[2, 0] == -2


class PublishingEngine:
    """A server-like engine that takes weights in flight: it records each version published, and answers a batch
    started ahead with the rows it is given (their versions as a real server would report them)."""

    in_flight, holds_weights, starts_current = True, True, True

    def __init__(self, answers: list[Samples]) -> None:
        self.answers, self.published, self.asked = list(answers), [], []
        self.publish_version = None
        self.tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()

    def sync_weights(self, policy) -> None:
        self.published.append(self.publish_version)

    def submit(self, prompts, group_size, seeds=None, settings=None):
        answer = self.answers.pop(0)
        return lambda: answer

    def generate(self, prompts, group_size, seeds=None, greedy=False, settings=None):
        self.asked.append((prompts, seeds))
        return capped_batch([[9, 9, 9]] * (len(prompts) * group_size), group_size)


@pytest.mark.parametrize("over_cap", ["drop", "wait"])
def test_the_worker_publishes_every_update_and_caps_what_it_hands_out(over_cap: str) -> None:
    """An engine that takes weights in flight gets each version as the policy has it (labelled with its updates);
    a batch taken 3 updates after its launch with a cap of 2 has its over-cap group dropped (``dropped``, out of the
    loss) or sampled again now (``wait``), and the share is logged."""
    from rlhf_lab.generation.inflight import StalenessCap

    engine = PublishingEngine([capped_batch([[0, 1, 1], [0, 1, 2], [2, 2, 3], [2, 3, 3]], group_size=2)])
    worker = RolloutWorker(engine, torch.nn.Linear(1, 1), cap=StalenessCap(2, wait=over_cap == "wait"))
    worker.launch(("key",), ["p0", "p1"], 2, [5, 6], None)
    for _ in range(3):
        worker.weights_updated()
    assert engine.published == [1, 2, 3] and worker.engine_version == 3
    taken = worker.take(("key",))
    if over_cap == "drop":
        assert worker.dropped.tolist() == [True, True, False, False] and engine.asked == []
        assert taken.versions[0].tolist() == [0, 1, 1]
        assert worker.metrics()["rollout/stale_dropped_frac"] == 0.5
    else:
        assert worker.dropped is None and engine.asked == [(["p0"], [5])]
        assert taken.versions.tolist() == [[9, 9, 9], [9, 9, 0], [2, 2, 3], [2, 3, 0]]  # (the stand-in's rows)
        assert worker.metrics()["rollout/stale_waited_frac"] == 0.5


def test_a_checkpoint_keeps_the_batches_in_flight_with_their_versions_and_requests() -> None:
    """The worker's state holds each batch in flight with every token's version (as the server reported them) and its
    request; a worker built again from it hands out the same samples, and under ``wait`` samples an over-cap group
    again from the request kept (its prompt and seed)."""
    from rlhf_lab.generation.inflight import StalenessCap

    held = capped_batch([[0, 1, 1], [0, 1, 2], [2, 2, 3], [2, 3, 3]], group_size=2)
    engine = PublishingEngine([held])
    worker = RolloutWorker(engine, torch.nn.Linear(1, 1))
    worker.launch((("a", "b"), 2, (5, 6)), ["p0", "p1"], 2, [5, 6], None)
    state = worker.state()
    resumed_engine = PublishingEngine([])
    resumed = RolloutWorker(resumed_engine, torch.nn.Linear(1, 1), cap=StalenessCap(2, wait=True))
    resumed.weights_loaded(3)
    resumed.load_state(state, torch.device("cpu"))
    taken = resumed.take((("a", "b"), 2, (5, 6)))
    assert resumed_engine.asked == [(["p0"], [5])]
    assert taken.versions[2:].tolist() == held.versions[2:].tolist()
    assert torch.equal(taken.input_ids[2:], held.input_ids[2:])


def test_staleness_bias_by_hand() -> None:
    """Three samples trained after 5 updates: mean token staleness 1, 1.5 and 3 for lengths 3, 2 and 1 and scores
    0, 1, 1: the correlations are numpy's; the dropped third sample is half the mean length and 1/3 above the
    mean score."""
    import numpy

    from rlhf_lab.generation.rollout import Rollout
    from rlhf_lab.step.step_metrics import staleness_bias

    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0]])
    versions = torch.tensor([[4, 4, 4], [4, 3, 0], [2, 0, 0]])
    rollout = Rollout(input_ids=torch.zeros(3, 4, dtype=torch.long), attention_mask=torch.ones(3, 4, dtype=torch.long),
                      response_mask=mask, prompt_width=1, group_size=1, logprobs=torch.zeros(3, 3),
                      entropy=torch.zeros(3, 3), versions=versions, scores=torch.tensor([0.0, 1.0, 1.0]))
    metrics = staleness_bias(rollout, mask, 5, torch.tensor([False, False, True]))
    staleness, lengths, scores = [1.0, 1.5, 3.0], [3.0, 2.0, 1.0], [0.0, 1.0, 1.0]
    assert metrics["staleness/length_corr"] == pytest.approx(numpy.corrcoef(staleness, lengths)[0, 1], abs=1e-6)
    assert metrics["staleness/reward_corr"] == pytest.approx(numpy.corrcoef(staleness, scores)[0, 1], abs=1e-6)
    assert metrics["rollout/stale_dropped_length_ratio"] == pytest.approx(1 / 2)
    assert metrics["rollout/stale_dropped_reward_gap"] == pytest.approx(1 - 2 / 3)
    assert staleness_bias(rollout, mask, 5, None).keys() == {"staleness/length_corr", "staleness/reward_corr"}
    assert staleness_bias(replace_versions(rollout, 5), mask, 5, None) == {}  # nothing stale: nothing to correlate


def replace_versions(rollout, version: int):
    from dataclasses import replace

    return replace(rollout, versions=(rollout.response_mask > 0).long() * version)
