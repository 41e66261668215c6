"""Padding-free packing and token-budget micro-batches (rlhf_lab/scoring/packing.py): packed rows give the padded
pass's log-probs, hidden states and gradients, never attend to each other, and group by a token budget."""

from __future__ import annotations

import pytest
import torch
from conftest import SCORED_PROMPT, scoring_batch

from rlhf_lab.errors import ConfigError
from rlhf_lab.models import loading as models
from rlhf_lab.scoring.forward import response_logits
from rlhf_lab.scoring.logprobs import gather_logprobs
from rlhf_lab.scoring.packing import pack_rows, row_tokens, split_to, token_budget_groups


def ragged_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """scoring_batch's rows with responses of 4, 2, 3, 1, 0 and 4 tokens (attention 0 after each)."""
    input_ids, mask = scoring_batch(500)
    for row, length in enumerate([4, 2, 3, 1, 0, 4]):
        mask[row, SCORED_PROMPT + length:] = 0
        input_ids[row, SCORED_PROMPT + length:] = 2  # the pad token: what follows a response's end
    return input_ids, mask


def passes(model, input_ids, mask, pack: bool, head_chunk: int):
    model.zero_grad(set_to_none=True)
    logits, hidden = response_logits(model, input_ids, mask, SCORED_PROMPT, 0.9, output_hidden_states=True,
                                     head_chunk=head_chunk, pack=pack)
    response_mask = mask[:, SCORED_PROMPT:].float()
    logprobs = gather_logprobs(logits, input_ids[:, SCORED_PROMPT:]) * response_mask
    (logprobs.sum() + (hidden.float().sum(-1) * response_mask).sum() * 1e-2).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logprobs.detach(), (hidden * response_mask[..., None]).detach(), grads


@pytest.mark.parametrize("head_chunk", [0, 3])
def test_packed_rows_give_the_padded_log_probs_and_gradients(compose, tiny_overrides, tiny_tokenizer, head_chunk):
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    input_ids, mask = ragged_batch()
    packed, packed_hidden, packed_grads = passes(model, input_ids, mask, pack=True, head_chunk=head_chunk)
    padded, padded_hidden, padded_grads = passes(model, input_ids, mask, pack=False, head_chunk=head_chunk)
    assert (packed != 0).sum() == mask[:, SCORED_PROMPT:].sum()  # every response token scored, nothing else
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_hidden, padded_hidden, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():  # to fp32 rounding relative to the tensor's scale
        assert (packed_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def test_packed_rows_never_attend_to_each_other(compose, tiny_overrides, tiny_tokenizer):
    model = models.build_tiny_llama(tiny_tokenizer, compose(tiny_overrides(None)).model.tiny, seed=0)
    input_ids, mask = ragged_batch()
    with torch.no_grad():
        before, _ = response_logits(model, input_ids, mask, SCORED_PROMPT, 1.0, pack=True)
        changed = input_ids.clone()
        changed[0] = torch.randint(3, 500, changed[0].shape, generator=torch.Generator().manual_seed(5))
        after, _ = response_logits(model, changed, mask, SCORED_PROMPT, 1.0, pack=True)
        alone, _ = response_logits(model, input_ids[1:2], mask[1:2], SCORED_PROMPT, 1.0, pack=True)
    assert not torch.allclose(after[0], before[0])  # row 0's own tokens changed
    assert torch.equal(after[1:], before[1:])  # no other row saw them
    torch.testing.assert_close(alone[0], before[1], rtol=1e-5, atol=1e-5)  # as if packed with no neighbour


def test_pack_layout():
    input_ids = torch.tensor([[0, 7, 8, 9, 1], [5, 6, 7, 3, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    packed = pack_rows(input_ids, mask, prompt_width=3)
    assert packed.input_ids.tolist() == [[7, 8, 9, 1, 5, 6, 7, 3]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.keep.tolist() == [1, 2, 6]  # 8 → 9, 9 → 1; row 2: 7 → 3
    assert packed.valid.tolist() == [[True, True], [True, False]]
    assert row_tokens(mask).tolist() == [4, 4]
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert pack_rows(input_ids, holes, prompt_width=3) is None  # a hole: the pass runs padded


def test_token_budget_groups_and_the_too_small_budget():
    assert token_budget_groups([3, 4, 2, 5, 1], budget=7) == [[0, 1], [2, 3], [4]]
    assert token_budget_groups([3, 4, 2, 5, 1], budget=100) == [[0, 1, 2, 3, 4]]
    assert split_to([[0, 1, 2, 3], [4]], 4) == [[0], [1], [2, 3], [4]]
    with pytest.raises(ConfigError, match=r"max_tokens_per_micro_batch=4 is smaller than the longest row \(5 tokens"):
        token_budget_groups([3, 5], budget=4)
