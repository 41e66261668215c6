"""Reward-model pooling: the last non-pad token (by attention mask) under left and right padding, or the mean."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlhf_lab.rewards.pooling import pool, sequence_rewards


def test_last_pooling_picks_the_last_real_token_under_left_and_right_padding():
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    torch.testing.assert_close(pool(hidden, right, "last"), torch.stack([hidden[0, 2], hidden[1, 4]]))
    torch.testing.assert_close(pool(hidden, left, "last"), torch.stack([hidden[0, 4], hidden[1, 4]]))
    torch.testing.assert_close(pool(hidden, right, "mean"), torch.stack([hidden[0, :3].mean(0), hidden[1].mean(0)]))


def test_rewards_do_not_depend_on_the_padding_side_even_when_pad_is_eos():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=2, eos_token_id=2)
    model = LlamaForSequenceClassification(config).eval()
    rows = [[5, 6, 7, 2], [8, 9]]  # the first ends with EOS, the pad id: masks decide, never ids
    right = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 2]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    left = torch.tensor([[5, 6, 7, 2], [2, 2, 8, 9]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        alone = torch.cat([sequence_rewards(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long), "last")
                           for r in rows])
        for pooling in ("last", "mean"):
            torch.testing.assert_close(sequence_rewards(model, *right, pooling), sequence_rewards(model, *left, pooling),
                                       atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(sequence_rewards(model, *right, "last"), alone, atol=1e-5, rtol=1e-4)
