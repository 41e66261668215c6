"""SFT packing's layout by hand (rlhf_lab/offline/packing.py): which documents share a row, token and
document ids, position ids, the loss mask and the block-diagonal causal attention mask.

Token ids are made up; the pad id is 2, the EOS id too (as in SmolLM2), so every mask here comes from the
layout, never from ``token == pad``.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rlhf_lab.offline.packing import PackedRows, block_causal_mask, first_fit, pack_documents, resolve_length

EOS = PAD = 2
DOCUMENTS = [  # (prompt, response + EOS)
    ([11, 12], [13, EOS]),  # 4 tokens
    ([21], [22, 23]),  # 3 (a response cut before its EOS)
    ([31, 32, 33], [34, 35, EOS]),  # 6
    ([41], [42]),  # 2
]


def test_first_fit_puts_each_document_into_the_first_row_with_room() -> None:
    assert first_fit([5, 3, 4, 2, 6], capacity=8) == [[0, 1], [2, 3], [4]]
    assert first_fit([4, 3, 6, 2], capacity=8) == [[0, 1], [2, 3]]  # 2 fits row 1's room, not row 0's
    assert first_fit([8, 1, 7], capacity=8) == [[0], [1, 2]]
    with pytest.raises(ValueError, match="document 1 has 9 tokens, more than a row's 8"):
        first_fit([3, 9], capacity=8)


def test_documents_are_laid_out_with_restarting_positions_and_their_own_loss_mask() -> None:
    rows = pack_documents(DOCUMENTS, capacity=8, pad_token_id=PAD)
    # Row 0: documents 0 and 1, then one pad; row 1: documents 2 and 3, full.
    assert rows.input_ids.tolist() == [[11, 12, 13, EOS, 21, 22, 23, PAD], [31, 32, 33, 34, 35, EOS, 41, 42]]
    assert rows.document_ids.tolist() == [[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 2, 2]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 1]]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
    # Rollout layout with prompt width 1: response_ids = tokens 1.., scored where the token is a response token.
    assert rows.prompt_width == 1 and rows.response_ids.tolist() == [row[1:] for row in rows.input_ids.tolist()]
    assert rows.response_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 1]]
    assert rows.response_mask.sum() == sum(len(response) for _, response in DOCUMENTS)
    assert rows.documents == 4 and rows.batch_size == 2


def test_attention_is_causal_within_each_document_only() -> None:
    rows = pack_documents(DOCUMENTS, capacity=8, pad_token_id=PAD)
    mask = block_causal_mask(rows.document_ids)
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    row_0 = [  # query (line) may attend to key (column): documents 0-3, 4-6, the pad alone
        "10000000",
        "11000000",
        "11100000",
        "11110000",
        "00001000",
        "00001100",
        "00001110",
        "00000001",
    ]
    row_1 = ["10000000", "11000000", "11100000", "11110000", "11111000", "11111100", "00000010", "00000011"]
    for row, expected in enumerate((row_0, row_1)):
        assert ["".join(str(int(v)) for v in line) for line in mask[row, 0].tolist()] == expected


def test_a_document_starting_with_its_response_scores_no_token_from_the_previous_document() -> None:
    rows = pack_documents([([5], [6]), ([], [7, 8])], capacity=8, pad_token_id=PAD)
    assert rows.input_ids[0, :4].tolist() == [5, 6, 7, 8]
    assert rows.response_mask[0, :3].tolist() == [1, 0, 1]  # token 7 would be predicted from document 0


def test_select_keeps_the_packing_fields() -> None:
    rows = pack_documents(DOCUMENTS, capacity=8, pad_token_id=PAD)
    second = rows.select(torch.tensor([1]))
    assert isinstance(second, PackedRows) and second.documents == 2
    assert second.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]]
    assert torch.equal(second.response_mask, rows.response_mask[1:])


def test_rows_are_as_wide_as_the_fullest_one() -> None:
    rows = pack_documents(DOCUMENTS[:2], capacity=100, pad_token_id=PAD)
    assert rows.input_ids.shape == (1, 7) and int(rows.attention_mask.sum()) == 7


def test_the_default_row_length_is_the_longest_unpacked_row() -> None:
    data = OmegaConf.create({"max_prompt_tokens": 256, "max_response_tokens": 128})
    assert resolve_length(None, data) == 384 and resolve_length(64, data) == 64


def test_sft_logs_the_share_of_token_slots_that_hold_a_token_and_the_length_per_demonstration() -> None:
    from rlhf_lab.offline.sft import SFT

    sft = SFT(OmegaConf.create({"packing": True, "packing_length": 8}))
    metrics = sft.batch_metrics(pack_documents(DOCUMENTS, capacity=8, pad_token_id=PAD))
    # 1 pad among 2 x 8 slots; response tokens 2 + 2 + 3 + 1 over 4 demonstrations
    assert metrics == {"sft/packing_efficiency": 15 / 16, "response/length_mean": 8 / 4}
