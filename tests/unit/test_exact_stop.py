"""The exact task with a stop symbol (``model.exact.stop``): responses of 1 to T symbols, the last symbol their EOS
(rlhf_lab/testbed/task.py). The enumeration, the response masks, the reward's reading of a decoded response and the
engine's samples are checked against each other and against counts made by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rlhf_lab.components  # noqa: F401
from rlhf_lab.errors import ConfigError, RewardError
from rlhf_lab.generation.hf import generate
from rlhf_lab.registry import get
from rlhf_lab.scoring.logprobs import gather_logprobs
from rlhf_lab.testbed.metrics import enumerate_logits
from rlhf_lab.testbed.task import (
    PROMPT,
    SPECIAL_TOKENS,
    all_responses,
    build_model,
    build_tokenizer,
    canonical,
    parse_response,
    response_mask,
    reward_table,
    table_index,
    token_ids,
)

DIMS = SimpleNamespace(symbols=3, init_seed=0, init_std=0.5, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)


def test_the_responses_are_the_canonical_rows_counted_by_hand() -> None:
    """V = 4 (stop 'd' = 3), T = 3: the first token is never the stop, so 3 responses of two tokens (xd) and
    3·3·4 = 36 of three (xy and any third): 39 rows, each with the stop repeated after its first; the mask covers
    each response's own tokens."""
    rows = all_responses(4, 3, stop=True)
    assert rows.shape == (39, 3)
    assert torch.equal(canonical(rows, 4), rows) and bool((rows[:, 0] != 3).all())
    lengths = response_mask(rows, 4, stop=True).sum(-1)
    assert [int((lengths == n).sum()) for n in (1, 2, 3)] == [0, 3, 36]
    assert all_responses(4, 1, stop=True).tolist() == [[0], [1], [2]]
    assert torch.equal(canonical(torch.tensor([[3, 0, 1], [0, 3, 2], [0, 1, 3]]), 4),
                       torch.tensor([[3, 3, 3], [0, 3, 3], [0, 1, 3]]))
    assert response_mask(torch.tensor([[3, 3, 3], [0, 3, 3], [0, 1, 2]]), 4, stop=True).tolist() == [
        [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert torch.equal(all_responses(4, 3), all_responses(4, 3, stop=False))  # unchanged without the stop
    assert bool((response_mask(rows, 4, stop=False) == 1).all())


def test_the_enumeration_carries_the_whole_mass_and_the_engine_samples_it() -> None:
    """The policy never puts the stop first (its logit after <bos> is masked, as the engines' one-token minimum);
    its probabilities of the canonical responses (tokens up to the first stop) sum to 1; every sample of the hf
    engine ends at its first stop symbol (kept, as an EOS), its log-probs are the enumeration's for its canonical
    row, and responses of both lengths occur."""
    tokenizer = build_tokenizer(3, stop=True)
    assert tokenizer.eos_token == "c" and tokenizer.eos_token_id == len(SPECIAL_TOKENS) + 2
    model = build_model(tokenizer, DIMS)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        first = model(torch.tensor([[tokenizer.bos_token_id, 3, 4]])).logits.softmax(-1)[0]
    assert float(first[0, tokenizer.eos_token_id]) == 0 and float(first[1, tokenizer.eos_token_id]) > 0.01
    responses = all_responses(3, 3, stop=True)
    mask = response_mask(responses, 3, stop=True)
    with torch.no_grad():
        logits = enumerate_logits(model, tokenizer, responses, temperature=1.0)
    logprobs = (gather_logprobs(logits, token_ids(responses)) * mask).double().sum(-1)
    assert float(logprobs.exp().sum()) == pytest.approx(1.0, abs=1e-6)

    torch.manual_seed(0)
    rollout = generate(model, tokenizer, [PROMPT] * 4, group_size=16, max_new_tokens=3, temperature=1.0, top_p=1.0,
                       top_k=0, max_prompt_tokens=1, keep_logits=False)
    symbols = rollout.response_ids - len(SPECIAL_TOKENS)
    kept = rollout.response_mask > 0
    rows = canonical(torch.where(kept, symbols, torch.full_like(symbols, 2)), 3)
    assert torch.equal(response_mask(rows, 3, stop=True), rollout.response_mask.float())
    by_row = dict(zip(table_index(responses, 3).tolist(), logprobs.tolist()))
    sampled = (rollout.logprobs * rollout.response_mask).double().sum(-1)
    torch.testing.assert_close(sampled, torch.tensor([by_row[i] for i in table_index(rows, 3).tolist()],
                                                     dtype=torch.float64), atol=1e-5, rtol=0)
    assert set(rollout.response_mask.sum(-1).long().tolist()) == {2, 3}


def test_the_reward_reads_a_decoded_response_as_its_canonical_row() -> None:
    """A decode that skips the EOS ('a b' for 'a b c') and one that keeps it score the same row; the peaks are drawn
    among the responses there are; a response of no symbol, more than T, or the stop first is one line."""
    assert parse_response("a b", 3, 3, stop=True) == parse_response("a b c", 3, 3, stop=True) == [0, 1, 2]
    assert parse_response("a c b", 3, 3, stop=True) == [0, 2, 2]  # cut after the first stop
    table = reward_table(3, 3, seed=4, peaks=5, peak_reward=1.0, noise=0.0, stop=True)
    peaks = table.nonzero().flatten()
    rows = all_responses(3, 3, stop=True)
    assert len(peaks) == 5 and set(peaks.tolist()) <= set(table_index(rows, 3).tolist())
    reward = get("reward", "exact_table")({"symbols": 3, "length": 3, "seed": 4, "peaks": 5, "peak_reward": 1.0,
                                          "noise": 0.0, "stop": True})
    texts = ["a b", "a", "b a a"]
    expected = table[table_index(torch.tensor([[0, 1, 2], [0, 2, 2], [1, 0, 0]]), 3)].float()
    torch.testing.assert_close(reward([PROMPT] * 3, texts).scores, expected)
    with pytest.raises(RewardError, match="is not 1 to 3 symbols"):
        reward([PROMPT], ["a b a b"])
    with pytest.raises(RewardError, match="is not 1 to 3 symbols"):
        reward([PROMPT], [""])
    with pytest.raises(RewardError, match="is not 1 to 3 symbols"):
        reward([PROMPT], ["c"])  # the stop never comes first


@pytest.mark.parametrize(("overrides", "message"), [
    (["reward.stop=false"], r"reward.stop=False must equal model.exact.stop=True"),
    (["env=exact_two_turn"], r"model.exact.stop=true with env=exact_two_turn: .* use model.exact.stop=false"),
])
def test_a_stop_the_parts_disagree_on_is_one_line(compose, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose(["experiment=exact", "model.exact.stop=true", *overrides])


def test_the_mean_length_and_its_bias_against_the_optimum_by_hand() -> None:
    """Three responses of 2, 3 and 3 tokens, π = (0.5, 0.3, 0.2), the reference uniform, rewards (1, 0, 0), β = 1:
    π* ∝ (e, 1, 1), so E_π[len] = 2.5 and E_π*[len] = (2e + 6) / (e + 2)."""
    import math

    from rlhf_lab.testbed.metrics import exact_metrics

    logprobs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log()[:, None]
    ref = torch.full((3, 1), 1 / 3, dtype=torch.float64).log()
    metrics = exact_metrics(logprobs, ref, torch.tensor([1.0, 0.0, 0.0]), 1.0, lengths=torch.tensor([2.0, 3.0, 3.0]))
    optimal_length = (2 * math.e + 6) / (math.e + 2)
    assert metrics["exact/length"] == pytest.approx(2.5, rel=1e-12)
    assert metrics["exact/length_bias"] == pytest.approx(2.5 - optimal_length, rel=1e-12)
    assert "exact/length" not in exact_metrics(logprobs, ref, torch.tensor([1.0, 0.0, 0.0]), 1.0)
