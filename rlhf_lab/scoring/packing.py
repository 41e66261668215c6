"""Token-budget micro-batches and padding-free packing of a scoring or training pass.

Packing flattens a micro-batch's rows into one sequence [1, N] of their real tokens (left padding and the padding
after each row's last attended token dropped), each row with its own position ids 0, 1, … . transformers reads
such position ids, given with no attention mask and no cache, as a packed batch and masks attention block by
block (``masking_utils.find_packed_sequence_indices``: a new row wherever a position does not follow the one
before), so no row attends to another: under SDPA on the CPU through a block-diagonal causal mask, under
``flash_attention_2`` through its variable-length kernel. The outputs at the positions that predict each
response token are then gathered back into the padded [B, T, …] layout, so every consumer reads the same
shapes as from a padded pass (tests/unit/test_packing.py checks the log-probs and gradients against it).

A row whose attended tokens have holes (an attention mask with a 0 between two 1s) cannot be packed this way;
a micro-batch with one runs padded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_lab.errors import ConfigError

_PACKING: ContextVar[bool] = ContextVar("packing", default=False)


def packing() -> bool:
    """Whether the passes in progress pack their rows (:func:`packed_passes`)."""
    return _PACKING.get()


@contextmanager
def packed_passes(enabled: bool) -> Iterator[None]:
    """Within the block the forward passes that can (the scoring passes, a separate critic) pack their rows."""
    token = _PACKING.set(enabled)
    try:
        yield
    finally:
        _PACKING.reset(token)


def row_spans(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's first attended column and one past its last: ([B], [B]); an empty row gives (0, 0)."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    attended = attention_mask > 0
    start = torch.where(attended, columns, attention_mask.shape[1]).min(-1).values
    end = torch.where(attended, columns + 1, 0).max(-1).values
    return start.clamp(max=end), end


def row_tokens(attention_mask: Tensor) -> Tensor:
    """Tokens of each row a packed pass runs (its attended span): [B]."""
    start, end = row_spans(attention_mask)
    return end - start


def token_budget_groups(tokens: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows in groups whose ``tokens`` sum to at most ``budget`` (a new group where the next row would
    overflow it). A row longer than the budget is a one-line error naming both."""
    longest = max(tokens, default=0)
    if longest > budget:
        raise ConfigError(f"trainer.max_tokens_per_micro_batch={budget} is smaller than the longest row "
                          f"({longest} tokens, prompt + response); raise it to at least {longest} or set it to 0")
    groups: list[list[int]] = []
    total = budget + 1
    for row, count in enumerate(tokens):
        if total + count > budget:
            groups.append([])
            total = 0
        groups[-1].append(row)
        total += count
    return groups


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` split (the largest first, in halves) until there are ``count`` of them (ranks that must run as
    many forward passes as each other: FSDP's collectives); each stays within the budget it was cut to."""
    groups = [list(group) for group in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        group = groups[largest]
        if len(group) < 2:
            raise ValueError(f"cannot split {len(groups)} groups of rows into {count}")
        groups[largest:largest + 1] = [group[: len(group) // 2], group[len(group) // 2:]]
    return groups


@dataclass
class PackedRows:
    """A micro-batch flattened for one packed forward pass, and where its outputs go back to."""

    input_ids: Tensor  # [1, N] the rows' attended tokens, one after the other
    position_ids: Tensor  # [1, N] 0, 1, … within each row
    keep: Tensor  # [K] the packed positions that predict a response token (the model's ``logits_to_keep``)
    source: Tensor  # [B, T] the index into ``keep`` of the position predicting each response token (0 where none)
    valid: Tensor  # [B, T] bool: a packed position predicts that response token

    def unpack(self, kept: Tensor) -> Tensor:
        """Outputs at the kept positions [1, K, …] back in the padded layout [B, T, …] (zeros where none)."""
        picked = kept[0, self.source]
        shape = (*self.valid.shape, *([1] * (picked.dim() - 2)))
        return picked.masked_fill_(~self.valid.reshape(shape), 0)


def pack_rows(input_ids: Tensor, attention_mask: Tensor, prompt_width: int) -> PackedRows | None:
    """The packed form of ``[prompt (width P) | response]`` rows; None where a row's attended span has holes or
    no row has a token."""
    start, end = row_spans(attention_mask)
    lengths = end - start
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    inside = (columns >= start[:, None]) & (columns < end[:, None])
    if int(lengths.sum()) == 0 or bool(((attention_mask > 0) != inside).any()):
        return None
    offsets = torch.cumsum(lengths, 0) - lengths  # packed index of each row's first token
    flat_ids = input_ids[inside][None]  # row-major: each row's span in order
    positions = (columns[None, :] - start[:, None])[inside][None]
    response_columns = columns[prompt_width:][None, :]  # [1, T]
    valid = (response_columns < end[:, None]) & (response_columns - 1 >= start[:, None])
    if not bool(valid.any()):
        return None
    packed_index = offsets[:, None] + response_columns - 1 - start[:, None]
    keep = torch.unique(packed_index[valid])  # sorted
    source = torch.where(valid, torch.searchsorted(keep, packed_index.clamp(min=0)), 0)
    return PackedRows(flat_ids, positions, keep, source, valid)
